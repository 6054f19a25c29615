"""`specc::tree_accept_greedy` and `specc::tree_accept_sample`: acceptance of a static draft tree.

Semantics are those of specc.verify (read its module docstring for the tree conventions):

    tree_accept_greedy(logits [T, V], tokens [T], children [T, W], depth) -> (n [], path [depth+1], out [depth+1])
        == specc.verify.accept_greedy(logits, tokens, parents, children)
    tree_accept_sample(probs [T, V], tokens [T], children [T, W], depth, uniforms [T+1]) -> (n, path, out)
        == specc.verify.accept_sample(...) with probs = specc.verify.sampling_probs(logits, temperature, top_p)

`children` holds each node's children in rank order, padded with -1; `depth` is the tree's depth
(the walk makes exactly `depth` steps, so it is static). All outputs are int64.

The references walk the tree in Python over concrete values, with the same tensor operations
accept_greedy / accept_sample use, so on CPU they give the same bits.

Triton: a first kernel reduces every row in parallel (the argmax of each logits row, or the sum of
each probability row); a second, single-program kernel walks the tree (depth and width are small)
and, for sampling, draws the final token from the residual by an inverse CDF over the vocabulary
in blocks.

Floating-point caveats of the Triton path, all confined to measure-zero events:

* argmax: ties go to the lowest index, as in torch; NaN logits are ignored here, where torch.argmax
  would pick the NaN.
* sampling: a sibling is accepted iff u < p(x) / s, with an IEEE-rounded division. s is the row sum
  from the first kernel (fp32, a different summation order than torch's sum), minus the
  probabilities of the siblings already rejected, where the reference sums the zeroed row again.
  The two s differ by a few ulp, so a decision can differ only when u lies within a few ulp of the
  ratio.
* residual inverse CDF: the residual sum and the cumulative sums are accumulated in fp64 blocks
  (torch's CPU cumsum accumulates fp32 in double too; CUDA's scans in fp32), so the drawn index
  can differ from the reference only when u lies within rounding of a CDF step. The guard of
  specc.verify._inverse_cdf is kept: the draw never goes past the last index of positive mass.
"""
from __future__ import annotations

import torch
from torch import Tensor

from specc.verify import _inverse_cdf, greedy_walk, one_hot_walk

from ._triton import next_pow2, require_triton, tl, triton, wrap_triton


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


def _result(path: list[int], out: list[int], depth: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """(n, path, out) padded to depth + 1 by repeating the last entry, as specc.verify pads them."""
    n = len(path) - 1
    path = path + [path[-1]] * (depth + 1 - len(path))
    out = out + [out[-1]] * (depth + 1 - len(out))
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    return as_t(n), as_t(path), as_t(out)


def accept_greedy_reference(logits: Tensor, tokens: Tensor, children: Tensor, depth: int):
    target = torch.argmax(logits, dim=-1).tolist()  # the same argmax as accept_greedy: first maximum
    toks = tokens.tolist()
    kids = children.tolist()
    cur, path, out = 0, [0], []
    for _ in range(depth):
        nxt = next((c for c in kids[cur] if c >= 0 and toks[c] == target[cur]), -1)
        if nxt < 0:
            break
        path.append(nxt)
        out.append(toks[nxt])
        cur = nxt
    out.append(target[cur])
    return _result(path, out, depth, logits.device)


def accept_sample_reference(probs: Tensor, tokens: Tensor, children: Tensor, depth: int, uniforms: Tensor):
    probs = probs.to(torch.float32)
    u = uniforms.to(torch.float32)
    toks = tokens.tolist()
    kids = children.tolist()
    T = probs.shape[0]
    cur, path, out = 0, [0], []
    row = probs[0].clone()
    for _ in range(depth):
        nxt = -1
        for c in kids[cur]:
            if c < 0:
                continue
            x = toks[c]
            s = row.sum()  # summed again after each rejection, as accept_sample does
            ratio = row[x] / torch.where(s > 0, s, torch.ones_like(s))
            if bool(u[c] < ratio):
                nxt = c
                break
            row[x] = 0.0
        if nxt < 0:
            break
        path.append(nxt)
        out.append(toks[nxt])
        cur = nxt
        row = probs[cur].clone()
    out.append(int(_inverse_cdf(row, u[T])))
    return _result(path, out, depth, probs.device)


if triton is not None:
    @triton.jit
    def _row_argmax_kernel(x_ptr, out_ptr, V, stride, BLOCK_V: tl.constexpr):
        r = tl.program_id(0)
        lanes = tl.arange(0, BLOCK_V)
        # Each lane keeps its first maximum (strict >); the final pick takes the lowest index among
        # the lanes holding the row maximum, so ties go to the first index, as torch.argmax does.
        # Starting from -inf at index `lane` makes an all -inf row give index 0.
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_i = lanes.to(tl.int64)
        for start in range(0, V, BLOCK_V):
            cols = start + lanes
            x = tl.load(x_ptr + r * stride + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            take = x > best
            best = tl.where(take, x, best)
            best_i = tl.where(take, cols.to(tl.int64), best_i)
        top = tl.max(best, 0)
        tl.store(out_ptr + r, tl.min(tl.where(best == top, best_i, V), 0))

    @triton.jit
    def _row_sum_kernel(x_ptr, out_ptr, V, stride, BLOCK_V: tl.constexpr):
        r = tl.program_id(0)
        lanes = tl.arange(0, BLOCK_V)
        acc = tl.zeros([BLOCK_V], tl.float32)
        for start in range(0, V, BLOCK_V):
            cols = start + lanes
            acc += tl.load(x_ptr + r * stride + cols, mask=cols < V, other=0.0).to(tl.float32)
        tl.store(out_ptr + r, tl.sum(acc, 0))

    @triton.jit
    def _greedy_walk_kernel(target_ptr, tokens_ptr, children_ptr, n_ptr, path_ptr, out_ptr, depth, W):
        cur = tl.zeros([], tl.int64)
        n = tl.zeros([], tl.int64)
        alive = tl.full([], 1, tl.int1)
        tl.store(path_ptr, cur)
        for d in range(depth):
            want = tl.load(target_ptr + cur)
            found = tl.full([], 0, tl.int1)
            nxt = cur
            for w in range(W):
                c = tl.load(children_ptr + cur * W + w)
                tok = tl.load(tokens_ptr + tl.maximum(c, 0))
                hit = (c >= 0) & (tok == want) & ~found  # the first child in rank order wins
                nxt = tl.where(hit, c, nxt)
                found = found | hit
            step = alive & found
            cur = tl.where(step, nxt, cur)
            n += step.to(tl.int64)
            alive = step
            tl.store(path_ptr + d + 1, cur)
            tl.store(out_ptr + d, tl.load(tokens_ptr + cur), mask=step)
        bonus = tl.load(target_ptr + cur)
        for d in range(depth + 1):
            tl.store(out_ptr + d, bonus, mask=d >= n)  # the bonus, then the bonus repeated
        tl.store(n_ptr, n)

    @triton.jit
    def _sample_walk_kernel(probs_ptr, sums_ptr, tokens_ptr, children_ptr, u_ptr, n_ptr, path_ptr, out_ptr,
                            T, V, stride, depth, W, BLOCK_V: tl.constexpr):
        cur = tl.zeros([], tl.int64)
        n = tl.zeros([], tl.int64)
        searching = tl.full([], 1, tl.int1)
        tl.store(path_ptr, cur)
        for d in range(depth):
            s = tl.load(sums_ptr + cur)
            accepted = tl.full([], 0, tl.int1)
            nxt = cur
            for w in range(W):
                c = tl.load(children_ptr + cur * W + w)
                cc = tl.maximum(c, 0)
                x = tl.load(tokens_ptr + cc)
                # While still searching, every earlier valid sibling was rejected and zeroed its token:
                # a repeated token has probability 0 now (and must not be subtracted twice).
                dup = tl.full([], 0, tl.int1)
                for w2 in range(w):
                    c2 = tl.load(children_ptr + cur * W + w2)
                    dup = dup | ((c2 >= 0) & (tl.load(tokens_ptr + tl.maximum(c2, 0)) == x))
                px = tl.where(dup, 0.0, tl.load(probs_ptr + cur * stride + x).to(tl.float32))
                ratio = tl.math.div_rn(px, tl.where(s > 0, s, 1.0))
                active = searching & (c >= 0) & ~accepted
                ok = active & (tl.load(u_ptr + cc) < ratio)
                rej = active & ~ok
                nxt = tl.where(ok, cc, nxt)
                accepted = accepted | ok
                s = tl.where(rej, s - px, s)
            cur = tl.where(accepted, nxt, cur)
            n += accepted.to(tl.int64)
            searching = accepted
            tl.store(path_ptr + d + 1, cur)
            tl.store(out_ptr + d, tl.load(tokens_ptr + cur), mask=accepted)

        # The residual is the final node's row with every child's token zeroed: the walk stops at a
        # node only when all its valid children were rejected (a node at the full depth has none).
        lanes = tl.arange(0, BLOCK_V)
        acc = tl.zeros([BLOCK_V], tl.float64)
        last = tl.zeros([BLOCK_V], tl.int64)
        for start in range(0, V, BLOCK_V):
            cols = start + lanes
            p = tl.load(probs_ptr + cur * stride + cols, mask=cols < V, other=0.0).to(tl.float32)
            for w in range(W):
                c = tl.load(children_ptr + cur * W + w)
                p = tl.where((c >= 0) & (cols == tl.load(tokens_ptr + tl.maximum(c, 0))), 0.0, p)
            acc += p.to(tl.float64)
            last = tl.maximum(last, tl.where(p > 0, cols.to(tl.int64), 0))
        total = tl.sum(acc, 0).to(tl.float32)
        last_nz = tl.max(last, 0)
        denom = tl.where(total > 0, total, 1.0)
        u = tl.load(u_ptr + T)
        carry = tl.zeros([], tl.float64)
        pick = tl.full([], V, tl.int64)
        for start in range(0, V, BLOCK_V):
            cols = start + lanes
            p = tl.load(probs_ptr + cur * stride + cols, mask=cols < V, other=0.0).to(tl.float32)
            for w in range(W):
                c = tl.load(children_ptr + cur * W + w)
                p = tl.where((c >= 0) & (cols == tl.load(tokens_ptr + tl.maximum(c, 0))), 0.0, p)
            q = tl.math.div_rn(p, denom).to(tl.float64)
            cdf = (carry + tl.cumsum(q, 0)).to(tl.float32)
            hit = ((cdf > u) | (cols >= last_nz)) & (cols < V)
            pick = tl.minimum(pick, tl.min(tl.where(hit, cols.to(tl.int64), V), 0))
            carry += tl.sum(q, 0)
        for d in range(depth + 1):
            tl.store(out_ptr + d, pick, mask=d >= n)
        tl.store(n_ptr, n)


def _outputs(depth: int, device):
    return (torch.empty((), dtype=torch.int64, device=device), torch.empty(depth + 1, dtype=torch.int64, device=device),
            torch.empty(depth + 1, dtype=torch.int64, device=device))


def accept_greedy_triton(logits: Tensor, tokens: Tensor, children: Tensor, depth: int, block_v: int = 1024):
    """Launch the Triton kernels (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    require_triton("accept_greedy_triton")
    _check(logits, tokens, children, depth)
    T, V = logits.shape
    logits = logits.contiguous()
    tokens = tokens.to(torch.int64).contiguous()
    children = children.to(torch.int64).contiguous()
    target = torch.empty(T, dtype=torch.int64, device=logits.device)
    block_v = min(block_v, next_pow2(V))
    wrap_triton(_row_argmax_kernel)[(T,)](logits, target, V, logits.stride(0), BLOCK_V=block_v)
    n, path, out = _outputs(depth, logits.device)
    wrap_triton(_greedy_walk_kernel)[(1,)](target, tokens, children, n, path, out, depth, children.shape[1])
    return n, path, out


def accept_sample_triton(probs: Tensor, tokens: Tensor, children: Tensor, depth: int, uniforms: Tensor,
                         block_v: int = 1024):
    """Launch the Triton kernels (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    require_triton("accept_sample_triton")
    _check(probs, tokens, children, depth, uniforms)
    T, V = probs.shape
    probs = probs.to(torch.float32).contiguous()
    tokens = tokens.to(torch.int64).contiguous()
    children = children.to(torch.int64).contiguous()
    uniforms = uniforms.to(torch.float32).contiguous()
    sums = torch.empty(T, dtype=torch.float32, device=probs.device)
    block_v = min(block_v, next_pow2(V))
    wrap_triton(_row_sum_kernel)[(T,)](probs, sums, V, probs.stride(0), BLOCK_V=block_v)
    n, path, out = _outputs(depth, probs.device)
    wrap_triton(_sample_walk_kernel)[(1,)](probs, sums, tokens, children, uniforms, n, path, out, T, V,
                                           probs.stride(0), depth, children.shape[1], BLOCK_V=block_v)
    return n, path, out


# triton_ops, as tree_attention: compiled graphs inline the kernels (CUDA) or the vectorised walks of
# specc.verify (elsewhere), which give the references' bits on CPU.
@torch.library.triton_op("specc::tree_accept_greedy", mutates_args=())
def tree_accept_greedy(logits: Tensor, tokens: Tensor, children: Tensor, depth: int) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy acceptance: specc.verify.accept_greedy's semantics (see the module docstring)."""
    _check(logits, tokens, children, depth)
    if logits.device.type == "cuda" and triton is not None:
        return accept_greedy_triton(logits, tokens, children, depth)
    return greedy_walk(logits, tokens, children, depth)


@torch.library.triton_op("specc::tree_accept_sample", mutates_args=())
def tree_accept_sample(probs: Tensor, tokens: Tensor, children: Tensor, depth: int,
                       uniforms: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Stochastic acceptance with sibling retry: specc.verify.accept_sample's rule on given probs."""
    _check(probs, tokens, children, depth, uniforms)
    if probs.device.type == "cuda" and triton is not None:
        return accept_sample_triton(probs, tokens, children, depth, uniforms)
    return one_hot_walk(probs, tokens, children, depth, uniforms)
