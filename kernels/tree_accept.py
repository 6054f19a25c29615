"""Acceptance of a static draft tree: the vectorised references beside their Triton kernels.

    tree_accept_greedy(logits [T, V], tokens [T], children [T, W], depth) -> (n [], path [depth+1], out [depth+1])
    tree_accept_sample(probs [T, V], tokens [T], children [T, W], depth, uniforms [T+1]) -> (n, path, out)

The rules, their conventions and why they are exact are in specc/acceptance.py, which also holds
the plain-Python oracles the tests check these against. `children` holds each node's children in
rank order, padded with -1; `depth` is the tree's depth (the walk makes exactly `depth` steps, so
it is static). All outputs are int64.

`accept_greedy_reference`, `accept_sample_reference` and `accept_sampled_reference` (children drawn
i.i.d. from the drafter) are vectorised with static loops, so torch.export and Inductor trace them:
they are the ops' bodies off CUDA, and the oracles of the Triton kernels.

Triton: the passes over the vocabulary are split: the argmax of each logits row (or the sum of each
probability row) runs as (row, split) programs of up to 64 splits per row, then one program per row
combines the splits, so a plain step's one row spreads over dozens of programs rather than one
program scanning 150k values. The walk itself is one program, with the tree (tens of nodes, a few
children each) held in registers: every node's matching child (greedy) or its children's probabilities
(sampling) are gathered at once, and the walk's levels then read registers, not a chain of dependent
loads from memory. Sampling then draws the final token from the residual by an inverse CDF in three
launches: the residual's sum per split, its normalised sum per split, and one program that finds the
split where the cumulative sum passes u and scans that split alone.

Floating-point caveats of the Triton path, all confined to measure-zero events:

* argmax: ties go to the lowest index, as in torch; NaN logits are ignored here, where torch.argmax
  would pick the NaN.
* sampling: a sibling is accepted iff u < p(x) / s, with an IEEE-rounded division. s is the row sum
  from the first kernel (fp32, a different summation order than torch's sum), minus the
  probabilities of the siblings already rejected, where the reference sums the zeroed row again.
  The two s differ by a few ulp, so a decision can differ only when u lies within a few ulp of the
  ratio.
* residual inverse CDF: the residual sum and the cumulative sums are accumulated in fp64, by block
  and then by split (torch's CPU cumsum accumulates fp32 in double too; CUDA's scans in fp32), so the
  drawn index can differ from the reference only when u lies within rounding of a CDF step. The guard
  of inverse_cdf_rows is kept: the draw never goes past the last index of positive mass.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .triton_support import launch, next_pow2, require_triton, tl, triton


def _check(scores: Tensor, tokens: Tensor, children: Tensor, depth: int, uniforms: Tensor | None = None) -> None:
    if scores.dim() != 2:
        raise ValueError(f"tree_accept: logits/probs must be [T, V], got {tuple(scores.shape)}")
    T = scores.shape[0]
    if tuple(tokens.shape) != (T,):
        raise ValueError(f"tree_accept: tokens must be [{T}], got {tuple(tokens.shape)}")
    if children.dim() != 2 or children.shape[0] != T:
        raise ValueError(f"tree_accept: children must be [{T}, W], got {tuple(children.shape)}")
    if not 0 <= depth < max(T, 1):
        raise ValueError(f"tree_accept: depth {depth} is impossible for a tree of {T} nodes")
    if uniforms is not None and tuple(uniforms.shape) != (T + 1,):
        raise ValueError(f"tree_accept: uniforms must be [{T + 1}], got {tuple(uniforms.shape)}")


def _at(table: Tensor, idx: Tensor) -> Tensor:
    """``table[idx]`` for a 0-d index tensor, as a gather (export friendly)."""
    return torch.index_select(table, 0, idx.reshape(1)).squeeze(0)


def _finish(nodes: list[Tensor], n: Tensor, tokens: Tensor, bonus: Tensor):
    """Assemble (n, path, out_tokens) from per-depth node indices."""
    path = torch.stack(nodes)  # [D + 1]
    depth = path.shape[0] - 1
    bonus = bonus.reshape(()).to(torch.int64)
    if depth == 0:
        return n, path, bonus.reshape(1)
    drafted = tokens[path[1:]].to(torch.int64)  # [D]
    idx = torch.arange(depth, device=path.device)
    head = torch.where(idx < n, drafted, bonus)
    return n, path, torch.cat([head, bonus.reshape(1)])


def accept_greedy_reference(logits: Tensor, tokens: Tensor, children: Tensor, depth: int) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy acceptance, vectorised with static loops (depth, width): the op's body off CUDA and the
    Triton kernel's reference. Walk from the root to the first child (in rank order) whose token is
    the argmax of the current node's row; the bonus is the argmax at the last accepted node."""
    device = logits.device
    children = children.to(torch.int64)
    tokens = tokens.to(torch.int64)
    target = torch.argmax(logits, dim=-1)  # [T]
    valid = children >= 0  # [T, W]
    child_idx = torch.where(valid, children, 0)  # not clamp: integer Clip does not lower to TensorRT
    match = valid & (tokens[child_idx] == target.unsqueeze(-1))  # [T, W]

    cur = torch.zeros((), dtype=torch.int64, device=device)
    n = torch.zeros((), dtype=torch.int64, device=device)
    alive = torch.ones((), dtype=torch.bool, device=device)
    nodes = [cur]
    for _ in range(depth):
        m = _at(match, cur)  # [W]
        found = m.any()
        first = torch.argmax(m.to(torch.int64))  # first True (0 if none)
        nxt = _at(_at(child_idx, cur), first)
        step = alive & found
        cur = torch.where(step, nxt, cur)
        n = n + step.to(torch.int64)
        alive = step
        nodes.append(cur)
    bonus = _at(target, cur)
    return _finish(nodes, n, tokens, bonus)


def inverse_cdf_rows(p: Tensor, u: Tensor) -> Tensor:
    """The inverse-CDF draw of every row of ``p`` (``[N, V]``) with its own ``u[n]``: one draw per
    row: the first index whose cumulative sum of p/sum(p) exceeds u, never past the last index with
    positive mass (also how drafters with sampled children draw them)."""
    vocab = p.shape[-1]
    s = p.sum(dim=-1, keepdim=True)
    cdf = torch.cumsum(p / torch.where(s > 0, s, torch.ones_like(s)), dim=-1)
    ar = torch.arange(vocab, device=p.device)
    # guard against cdf[-1] < 1 from rounding: never go past the last
    # index with positive mass
    last_nz = torch.amax(torch.where(p > 0, ar, torch.zeros_like(ar)), dim=-1, keepdim=True)
    hit = (cdf > u.unsqueeze(-1)) | (ar >= last_nz)
    return torch.argmax(hit.to(torch.int64), dim=-1)


def _sibling_walk(probs: Tensor, tokens: Tensor, children: Tensor, depth: int, uniforms: Tensor,
                  try_child) -> tuple[Tensor, Tensor, Tensor]:
    """The walk both sampling rules share: from the root, try the current node's children in rank
    order against the residual ``row`` of its target distribution; move to the first accepted one
    (with that node's fresh ``p``); when all are rejected, draw the final token from the residual.

    ``try_child(row, x, u, cur) -> (counts, ok, row_if_rejected)``: whether child token ``x`` is a
    real trial, whether ``u`` accepts it, and the residual after a rejection."""
    num_nodes, width = tokens.shape[0], children.shape[1]
    device = probs.device
    children = children.to(torch.int64)
    tokens = tokens.to(torch.int64)
    uniforms = uniforms.to(torch.float32)
    valid_all = children >= 0
    child_idx = torch.where(valid_all, children, 0)

    cur = torch.zeros((), dtype=torch.int64, device=device)
    n = torch.zeros((), dtype=torch.int64, device=device)
    searching = torch.ones((), dtype=torch.bool, device=device)
    resid = probs[0]
    nodes = [cur]
    for _ in range(depth):
        row = resid
        kids = _at(child_idx, cur)  # [W]
        valid = _at(valid_all, cur)  # [W]
        accepted = torch.zeros((), dtype=torch.bool, device=device)
        nxt = cur
        for w in range(width):
            c = kids[w]
            counts, passes, rejected_row = try_child(row, _at(tokens, c), _at(uniforms, c), cur)
            tried = searching & valid[w] & ~accepted & counts
            ok = tried & passes
            nxt = torch.where(ok, c, nxt)
            accepted = accepted | ok
            row = torch.where(tried & ~passes, rejected_row, row)
        cur = torch.where(accepted, nxt, cur)
        n = n + accepted.to(torch.int64)
        searching = accepted
        resid = torch.where(accepted, _at(probs, cur), row)
        nodes.append(cur)
    bonus = inverse_cdf_rows(resid.unsqueeze(0), uniforms[num_nodes].reshape(1))[0]
    return _finish(nodes, n, tokens, bonus)


def accept_sample_reference(probs: Tensor, tokens: Tensor, children: Tensor, depth: int,
                 uniforms: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Sampling acceptance of deterministic drafts (q one-hot) on the target's probabilities ``[T, V]``:
    child x is accepted with probability p(x) / sum(p); on rejection p(x) = 0 and the next sibling is
    tried; the final token is drawn from the residual. The op's body off CUDA; the kernel's reference."""
    ar = torch.arange(probs.shape[-1], device=probs.device)

    def one_hot_rule(row, x, u, cur):  # q = one-hot(x): accept with p(x), then p(x) = 0
        s = row.sum()
        ratio = _at(row, x) / torch.where(s > 0, s, torch.ones_like(s))
        return torch.ones((), dtype=torch.bool, device=row.device), u < ratio, torch.where(ar == x, 0.0, row)

    return _sibling_walk(probs.to(torch.float32), tokens, children, depth, uniforms, one_hot_rule)


def normalize_rows(q: Tensor) -> Tensor:
    """Rows of ``q`` divided by their sums; all-zero rows stay zero."""
    s = q.sum(dim=-1, keepdim=True)
    return torch.where(s > 0, q / torch.where(s > 0, s, torch.ones_like(s)), q)


def sampled_residual(row: Tensor, q: Tensor) -> Tensor:
    """``norm(max(row - q, 0))``; ``row`` itself when that is all zero."""
    r = torch.clamp(row - q, min=0.0)
    z = r.sum()
    return torch.where(z > 0, r / torch.where(z > 0, z, torch.ones_like(z)), row)


def accept_sampled_reference(probs: Tensor, draft_probs: Tensor, tokens: Tensor, children: Tensor, depth: int,
                             uniforms: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Sampling acceptance of children drawn i.i.d. from ``draft_probs[i]`` (node i's q, ``[T, V]``,
    renormalised here): child x is accepted with probability min(1, p(x)/q(x)); on rejection
    p = norm(max(p - q, 0)) and the next sibling is tried; a draw with q(x) == 0 is void. Why this is
    exact: specc/acceptance.py. No Triton kernel yet: compiled graphs inline this body."""
    qs = normalize_rows(draft_probs.to(torch.float32))

    def min_ratio_rule(row, x, u, cur):
        q = _at(qs, cur)  # the distribution cur's children were drawn from
        qx = _at(q, x)
        return qx > 0, u * qx < _at(row, x), sampled_residual(row, q)

    return _sibling_walk(probs.to(torch.float32), tokens, children, depth, uniforms, min_ratio_rule)


if triton is not None:
    @triton.jit
    def _argmax_partial_kernel(x_ptr, best_ptr, index_ptr, V, stride, CHUNK, SPLITS: tl.constexpr,
                               BLOCK_V: tl.constexpr):
        """One (row, split of the vocabulary): the split's maximum and the first index holding it."""
        r = tl.program_id(0)
        split = tl.program_id(1)
        lanes = tl.arange(0, BLOCK_V)
        lo = split * CHUNK
        hi = tl.minimum(V, lo + CHUNK)
        # Each lane keeps its first maximum (strict >); the pick takes the lowest index among the lanes
        # holding the maximum, so ties go to the first index, as torch.argmax does. Starting from -inf
        # at the split's first indices makes an all -inf row give index 0 in the end.
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_i = (lo + lanes).to(tl.int64)
        for start in range(lo, hi, BLOCK_V):
            cols = start + lanes
            x = tl.load(x_ptr + r * stride + cols, mask=cols < hi, other=float("-inf")).to(tl.float32)
            take = x > best
            best = tl.where(take, x, best)
            best_i = tl.where(take, cols.to(tl.int64), best_i)
        top = tl.max(best, 0)
        tl.store(best_ptr + r * SPLITS + split, top)
        tl.store(index_ptr + r * SPLITS + split, tl.min(tl.where(best == top, best_i, V), 0))

    @triton.jit
    def _argmax_combine_kernel(best_ptr, index_ptr, out_ptr, V, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
        """One row: the first index of the largest split maximum (splits are in index order)."""
        r = tl.program_id(0)
        s = tl.arange(0, BLOCK_S)
        ok = s < SPLITS
        best = tl.load(best_ptr + r * SPLITS + s, mask=ok, other=float("-inf"))
        index = tl.load(index_ptr + r * SPLITS + s, mask=ok, other=V)
        top = tl.max(best, 0)
        tl.store(out_ptr + r, tl.min(tl.where(ok & (best == top), index, V), 0))

    @triton.jit
    def _sum_partial_kernel(x_ptr, out_ptr, V, stride, CHUNK, SPLITS: tl.constexpr, BLOCK_V: tl.constexpr):
        """One (row, split): the split's sum, float32."""
        r = tl.program_id(0)
        split = tl.program_id(1)
        lanes = tl.arange(0, BLOCK_V)
        lo = split * CHUNK
        hi = tl.minimum(V, lo + CHUNK)
        acc = tl.zeros([BLOCK_V], tl.float32)
        for start in range(lo, hi, BLOCK_V):
            cols = start + lanes
            acc += tl.load(x_ptr + r * stride + cols, mask=cols < hi, other=0.0).to(tl.float32)
        tl.store(out_ptr + r * SPLITS + split, tl.sum(acc, 0))

    @triton.jit
    def _sum_combine_kernel(part_ptr, out_ptr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
        r = tl.program_id(0)
        s = tl.arange(0, BLOCK_S)
        tl.store(out_ptr + r, tl.sum(tl.load(part_ptr + r * SPLITS + s, mask=s < SPLITS, other=0.0), 0))

    @triton.jit
    def _pick(values, nodes, at):
        """values[at] for a register vector indexed by `nodes` (0 where `at` is not a node)."""
        return tl.sum(tl.where(nodes == at, values, 0), 0)

    @triton.jit
    def _greedy_walk_kernel(target_ptr, tokens_ptr, children_ptr, n_ptr, path_ptr, out_ptr, T, depth, W,
                            BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
        """The walk, one program. The tree (T nodes, W children each) is small: every node's first
        matching child is found at once in registers, and the walk then reads registers only, instead
        of a chain of dependent loads from memory per level."""
        nodes = tl.arange(0, BLOCK_T)
        slots = tl.arange(0, BLOCK_W)
        node_ok = nodes < T
        kid = tl.load(children_ptr + nodes[:, None] * W + slots[None, :],
                      mask=node_ok[:, None] & (slots[None, :] < W), other=-1)
        kid_token = tl.load(tokens_ptr + tl.maximum(kid, 0), mask=kid >= 0, other=-1)
        want = tl.load(target_ptr + nodes, mask=node_ok, other=-1)
        tokens = tl.load(tokens_ptr + nodes, mask=node_ok, other=0)
        hit = (kid >= 0) & (kid_token == want[:, None])
        first = tl.min(tl.where(hit, slots[None, :], BLOCK_W), 1)  # the first child in rank order wins
        found = (first < BLOCK_W).to(tl.int32)
        nxt = tl.sum(tl.where(slots[None, :] == first[:, None], kid, 0), 1)
        cur = tl.zeros([], tl.int64)
        n = tl.zeros([], tl.int64)
        alive = tl.full([], 1, tl.int1)
        tl.store(path_ptr, cur)
        for d in range(depth):
            step = alive & (_pick(found, nodes, cur) > 0)
            cur = tl.where(step, _pick(nxt, nodes, cur).to(tl.int64), cur)
            n += step.to(tl.int64)
            alive = step
            tl.store(path_ptr + d + 1, cur)
            tl.store(out_ptr + d, _pick(tokens, nodes, cur), mask=step)
        bonus = _pick(want, nodes, cur)
        for d in range(depth + 1):
            tl.store(out_ptr + d, bonus, mask=d >= n)  # the bonus, then the bonus repeated
        tl.store(n_ptr, n)

    @triton.jit
    def _sample_walk_kernel(probs_ptr, sums_ptr, tokens_ptr, children_ptr, u_ptr, n_ptr, path_ptr, out_ptr,
                            T, stride, depth, W, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
        """The walk of sampling acceptance, one program, in registers as the greedy walk: each child's
        probability under its parent (a token repeated among earlier siblings counts 0: while still
        searching every earlier sibling was rejected and zeroed it) is gathered at once. Leaves the
        final token to the residual kernels (path[depth] is the node whose residual is drawn from)."""
        nodes = tl.arange(0, BLOCK_T)
        slots = tl.arange(0, BLOCK_W)
        node_ok = nodes < T
        kid = tl.load(children_ptr + nodes[:, None] * W + slots[None, :],
                      mask=node_ok[:, None] & (slots[None, :] < W), other=-1)
        x = tl.load(tokens_ptr + tl.maximum(kid, 0), mask=kid >= 0, other=-1)
        dup = tl.zeros([BLOCK_T, BLOCK_W], tl.int1)
        for w2 in range(W):
            x2 = tl.sum(tl.where(slots[None, :] == w2, x, 0), 1)  # [BLOCK_T]: each node's child w2's token
            dup = dup | ((slots[None, :] > w2) & (x2[:, None] == x) & (x2[:, None] >= 0))
        px = tl.load(probs_ptr + nodes[:, None] * stride + tl.maximum(x, 0), mask=(kid >= 0) & ~dup, other=0.0)
        sums = tl.load(sums_ptr + nodes, mask=node_ok, other=0.0)
        u = tl.load(u_ptr + nodes, mask=node_ok, other=2.0)
        tokens = tl.load(tokens_ptr + nodes, mask=node_ok, other=0)
        cur = tl.zeros([], tl.int64)
        n = tl.zeros([], tl.int64)
        searching = tl.full([], 1, tl.int1)
        tl.store(path_ptr, cur)
        for d in range(depth):
            s = _pick(sums, nodes, cur)
            row = nodes == cur
            accepted = tl.full([], 0, tl.int1)
            nxt = cur
            for w in range(W):
                at = row[:, None] & (slots[None, :] == w)
                c = tl.sum(tl.sum(tl.where(at, kid, 0), 1), 0).to(tl.int64)
                p = tl.sum(tl.sum(tl.where(at, px, 0.0), 1), 0)
                ratio = tl.math.div_rn(p, tl.where(s > 0, s, 1.0))
                active = searching & (c >= 0) & ~accepted
                ok = active & (_pick(u, nodes, c) < ratio)
                nxt = tl.where(ok, c, nxt)
                accepted = accepted | ok
                s = tl.where(active & ~ok, s - p, s)
            cur = tl.where(accepted, nxt, cur)
            n += accepted.to(tl.int64)
            searching = accepted
            tl.store(path_ptr + d + 1, cur)
            tl.store(out_ptr + d, _pick(tokens, nodes, cur), mask=accepted)
        tl.store(n_ptr, n)

    @triton.jit
    def _residual_row(probs_ptr, tokens_ptr, children_ptr, cur, cols, V, stride, W):
        """The residual row's values at `cols`: node cur's probabilities with its children's tokens zeroed
        (the walk stops at a node only when all its valid children were rejected)."""
        p = tl.load(probs_ptr + cur * stride + cols, mask=cols < V, other=0.0).to(tl.float32)
        for w in range(W):
            c = tl.load(children_ptr + cur * W + w)
            p = tl.where((c >= 0) & (cols == tl.load(tokens_ptr + tl.maximum(c, 0))), 0.0, p)
        return p

    @triton.jit
    def _residual_partial_kernel(probs_ptr, tokens_ptr, children_ptr, path_ptr, part_ptr, last_ptr, V, stride, depth,
                                 W, CHUNK, BLOCK_V: tl.constexpr):
        """One split of the vocabulary: the residual's sum there (fp64) and its last index of positive mass."""
        split = tl.program_id(0)
        cur = tl.load(path_ptr + depth)
        lanes = tl.arange(0, BLOCK_V)
        lo = split * CHUNK
        acc = tl.zeros([BLOCK_V], tl.float64)
        last = tl.zeros([BLOCK_V], tl.int64)
        for start in range(lo, tl.minimum(V, lo + CHUNK), BLOCK_V):
            cols = start + lanes
            p = _residual_row(probs_ptr, tokens_ptr, children_ptr, cur, cols, V, stride, W)
            acc += p.to(tl.float64)
            last = tl.maximum(last, tl.where(p > 0, cols.to(tl.int64), 0))
        tl.store(part_ptr + split, tl.sum(acc, 0))
        tl.store(last_ptr + split, tl.max(last, 0))

    @triton.jit
    def _residual_cdf_kernel(probs_ptr, tokens_ptr, children_ptr, path_ptr, part_ptr, last_ptr, cdf_ptr, V, stride,
                             depth, W, CHUNK, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr):
        """One split: the sum of the normalised residual p / total over the split (fp64), the total
        being the sum of every split's residual sum, in split order."""
        split = tl.program_id(0)
        s = tl.arange(0, BLOCK_S)
        total = tl.sum(tl.load(part_ptr + s, mask=s < SPLITS, other=0.0), 0).to(tl.float32)
        denom = tl.where(total > 0, total, 1.0)
        cur = tl.load(path_ptr + depth)
        lanes = tl.arange(0, BLOCK_V)
        lo = split * CHUNK
        acc = tl.zeros([], tl.float64)
        for start in range(lo, tl.minimum(V, lo + CHUNK), BLOCK_V):
            p = _residual_row(probs_ptr, tokens_ptr, children_ptr, cur, start + lanes, V, stride, W)
            acc += tl.sum(tl.math.div_rn(p, denom).to(tl.float64), 0)
        tl.store(cdf_ptr + split, acc)

    @triton.jit
    def _residual_draw_kernel(probs_ptr, tokens_ptr, children_ptr, u_ptr, n_ptr, path_ptr, part_ptr, last_ptr,
                              cdf_ptr, out_ptr, T, V, stride, depth, W, CHUNK, SPLITS: tl.constexpr,
                              BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr):
        """The inverse-CDF draw from the residual, one program: the split where the cumulative sum passes
        u from the splits' sums, then the values from there one block at a time, stopping at the block
        that holds the first index whose cumulative sum exceeds u (never past the last index of positive
        mass)."""
        s = tl.arange(0, BLOCK_S)
        ok = s < SPLITS
        total = tl.sum(tl.load(part_ptr + s, mask=ok, other=0.0), 0).to(tl.float32)
        denom = tl.where(total > 0, total, 1.0)
        last_nz = tl.max(tl.load(last_ptr + s, mask=ok, other=0), 0)
        u = tl.load(u_ptr + T)
        sums = tl.load(cdf_ptr + s, mask=ok, other=0.0)
        before = tl.cumsum(sums, 0) - sums  # each split's carry: the sums of the splits before it
        # the first split whose end passes u, or the one holding the last index of positive mass
        ends = (before + sums).to(tl.float32)
        hit = ok & ((ends > u) | ((s + 1) * CHUNK > last_nz))
        split = tl.min(tl.where(hit, s, SPLITS - 1), 0)
        carry = tl.sum(tl.where(s == split, before, 0.0), 0)
        cur = tl.load(path_ptr + depth)
        lanes = tl.arange(0, BLOCK_V)
        start = split * CHUNK
        pick = tl.full([], V, tl.int64)
        # From that split on, a block at a time, until a block holds the pick: the split's own sums were
        # added in another order than this scan's, so where they disagree by a rounding the scan goes on
        # into the next split rather than ever returning no token.
        while (pick == V) & (start < V):
            cols = start + lanes
            q = tl.math.div_rn(_residual_row(probs_ptr, tokens_ptr, children_ptr, cur, cols, V, stride, W),
                               denom).to(tl.float64)
            cdf = (carry + tl.cumsum(q, 0)).to(tl.float32)
            take = ((cdf > u) | (cols >= last_nz)) & (cols < V)
            pick = tl.minimum(pick, tl.min(tl.where(take, cols.to(tl.int64), V), 0))
            carry += tl.sum(q, 0)
            start += BLOCK_V
        n = tl.load(n_ptr)
        for d in range(depth + 1):
            tl.store(out_ptr + d, pick, mask=d >= n)


def vocab_splits(V: int, block_v: int) -> tuple[int, int]:
    """(keys per split, splits) of a pass over a vocabulary row: up to 64 splits of whole blocks, so one
    row (a plain step has one) spreads over dozens of programs instead of one scanning 150k values."""
    chunk = max(block_v, next_pow2(triton.cdiv(V, 64)))
    return chunk, triton.cdiv(V, chunk)


def _outputs(depth: int, device):
    return (torch.empty((), dtype=torch.int64, device=device), torch.empty(depth + 1, dtype=torch.int64, device=device),
            torch.empty(depth + 1, dtype=torch.int64, device=device))


def row_argmax_triton(x: Tensor, block_v: int = 1024) -> Tensor:
    """torch.argmax(x, -1) of a [T, V] row block, each row split over the vocabulary (ties: first index)."""
    T, V = x.shape
    block_v = min(block_v, next_pow2(V))
    chunk, splits = vocab_splits(V, block_v)
    best = torch.empty((T, splits), dtype=torch.float32, device=x.device)
    index = torch.empty((T, splits), dtype=torch.int64, device=x.device)
    launch(_argmax_partial_kernel, (T, splits), x, best, index, V, x.stride(0), chunk, SPLITS=splits, BLOCK_V=block_v)
    out = torch.empty(T, dtype=torch.int64, device=x.device)
    launch(_argmax_combine_kernel, (T,), best, index, out, V, SPLITS=splits, BLOCK_S=max(2, next_pow2(splits)))
    return out


def row_sum_triton(x: Tensor, block_v: int = 1024) -> Tensor:
    """x.sum(-1) in float32 of a [T, V] row block, each row split over the vocabulary."""
    T, V = x.shape
    block_v = min(block_v, next_pow2(V))
    chunk, splits = vocab_splits(V, block_v)
    part = torch.empty((T, splits), dtype=torch.float32, device=x.device)
    launch(_sum_partial_kernel, (T, splits), x, part, V, x.stride(0), chunk, SPLITS=splits, BLOCK_V=block_v)
    out = torch.empty(T, dtype=torch.float32, device=x.device)
    launch(_sum_combine_kernel, (T,), part, out, SPLITS=splits, BLOCK_S=max(2, next_pow2(splits)))
    return out


def accept_greedy_triton(logits: Tensor, tokens: Tensor, children: Tensor, depth: int, block_v: int = 1024):
    """Launch the Triton kernels (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    require_triton("accept_greedy_triton")
    _check(logits, tokens, children, depth)
    T, V = logits.shape
    logits = logits.contiguous()
    tokens = tokens.to(torch.int64).contiguous()
    children = children.to(torch.int64).contiguous()
    target = row_argmax_triton(logits, block_v)
    n, path, out = _outputs(depth, logits.device)
    W = children.shape[1]
    launch(_greedy_walk_kernel, (1,), target, tokens, children, n, path, out, T, depth, W,
           BLOCK_T=max(2, next_pow2(T)), BLOCK_W=max(2, next_pow2(W)))
    return n, path, out


def accept_sample_triton(probs: Tensor, tokens: Tensor, children: Tensor, depth: int, uniforms: Tensor,
                         block_v: int = 1024):
    """Launch the Triton kernels (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1): the row sums,
    the walk, then the residual draw over splits of the vocabulary (sums, normalised sums, the draw)."""
    require_triton("accept_sample_triton")
    _check(probs, tokens, children, depth, uniforms)
    T, V = probs.shape
    probs = probs.to(torch.float32).contiguous()
    tokens = tokens.to(torch.int64).contiguous()
    children = children.to(torch.int64).contiguous()
    uniforms = uniforms.to(torch.float32).contiguous()
    sums = row_sum_triton(probs, block_v)
    n, path, out = _outputs(depth, probs.device)
    W = children.shape[1]
    launch(_sample_walk_kernel, (1,), probs, sums, tokens, children, uniforms, n, path, out, T, probs.stride(0), depth,
           W, BLOCK_T=max(2, next_pow2(T)), BLOCK_W=max(2, next_pow2(W)))
    block_v = min(block_v, next_pow2(V))
    chunk, splits = vocab_splits(V, block_v)
    part = torch.empty(splits, dtype=torch.float64, device=probs.device)
    last = torch.empty(splits, dtype=torch.int64, device=probs.device)
    cdf = torch.empty(splits, dtype=torch.float64, device=probs.device)
    block_s = max(2, next_pow2(splits))
    launch(_residual_partial_kernel, (splits,), probs, tokens, children, path, part, last, V, probs.stride(0), depth, W,
           chunk, BLOCK_V=block_v)
    launch(_residual_cdf_kernel, (splits,), probs, tokens, children, path, part, last, cdf, V, probs.stride(0), depth,
           W, chunk, SPLITS=splits, BLOCK_S=block_s, BLOCK_V=block_v)
    launch(_residual_draw_kernel, (1,), probs, tokens, children, uniforms, n, path, part, last, cdf, out, T, V,
           probs.stride(0), depth, W, chunk, SPLITS=splits, BLOCK_S=block_s, BLOCK_V=block_v)
    return n, path, out


# triton_ops, as tree_attention: compiled graphs inline the kernels (CUDA) or the vectorised walks of
# specc.acceptance (elsewhere), which give the references' bits on CPU.
@torch.library.triton_op("specc::tree_accept_greedy", mutates_args=())
def tree_accept_greedy(logits: Tensor, tokens: Tensor, children: Tensor, depth: int) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy acceptance: specc.acceptance.accept_greedy's semantics (see the module docstring)."""
    _check(logits, tokens, children, depth)
    if logits.device.type == "cuda" and triton is not None:
        return accept_greedy_triton(logits, tokens, children, depth)
    return accept_greedy_reference(logits, tokens, children, depth)


@torch.library.triton_op("specc::tree_accept_sample", mutates_args=())
def tree_accept_sample(probs: Tensor, tokens: Tensor, children: Tensor, depth: int,
                       uniforms: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Stochastic acceptance with sibling retry: specc.acceptance.accept_sample's rule on given probs."""
    _check(probs, tokens, children, depth, uniforms)
    if probs.device.type == "cuda" and triton is not None:
        return accept_sample_triton(probs, tokens, children, depth, uniforms)
    return accept_sample_reference(probs, tokens, children, depth, uniforms)
