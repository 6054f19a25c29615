"""Lossless verification of a static draft token tree.

Conventions
-----------
A tree has ``T`` nodes.  Node 0 is the root (the last committed token); every
other node ``i`` carries a draft token ``tokens[i]``.  ``logits[i]`` is the
target model's distribution for the token that FOLLOWS node ``i``.  The tree
shape is given by ``parents`` (a static Python tuple, ``parents[0] == -1`` and
``parents[i] < i``) and by ``children`` (an int64 ``[T, W]`` table holding the
children of each node sorted by sibling rank, padded with ``-1``).

Drafts are deterministic (the draft distribution ``q`` is one-hot), so the
rules are:

* greedy (``temperature <= 0``): walk from the root, moving to the first child
  (in rank order) whose token equals ``argmax(logits[current])``; stop when no
  child matches; the bonus token is ``argmax(logits[final])``.
* sampling (``temperature > 0``): with ``p = sampling_probs(logits[current])``
  try the children in rank order; child ``c`` with token ``x`` is accepted iff
  ``uniforms[c] < p(x) / sum(p)``; on acceptance move to ``c`` and continue
  with a fresh ``p``; on rejection set ``p(x) = 0`` and try the next sibling.
  When every child is rejected (or there is none), the final token is drawn
  from the residual ``p / sum(p)`` by inverse CDF with ``uniforms[T]``: the
  first index whose cumulative sum exceeds ``uniforms[T]``.

Sampled children (``accept_sample_sampled``, ``accept(..., draft_probs=q)``)
------------------------------------------------------------------------------
A drafter may instead SAMPLE each node's children i.i.d. from a draft
distribution: ``draft_probs[i]`` (``[T, V]``) is the distribution ``q`` the
children of node ``i`` were drawn from (after the drafter's own temperature /
top-p; rows are renormalised here; rows of leaves are ignored).  The rule, at
temperature > 0, with ``p = sampling_probs(logits[current])``: try the
children in rank order; child ``c`` with token ``x`` is accepted iff
``uniforms[c] * q(x) < p(x)`` (i.e. ``u < p(x) / q(x)``, probability
``min(1, p(x) / q(x))``); on acceptance move to ``c`` and continue with its
fresh ``p`` and its own ``q = draft_probs[c]``; on rejection set
``p <- norm(max(p - q, 0))`` with the SAME ``q`` and try the next sibling.
When every child is rejected (or there is none) the final token is drawn
from the residual ``p`` by inverse CDF with ``uniforms[T]`` as above.

Why this is exact (the multi-round / multi-draft rule).  Claim: if ``k``
draws ``x_1 .. x_k`` i.i.d. from ``q`` remain, independent of everything
decided so far, and the current residual is ``r``, the procedure emits a
token distributed as ``r``.  ``k = 0``: we sample from ``r``.  ``k > 0``:
``P(accept x_1 = y) = q(y) min(1, r(y)/q(y)) = min(q(y), r(y))``; the
rejection probability is ``Z = 1 - sum_y min(q, r) = sum_y max(r - q, 0)``.
Rejection depends only on ``(x_1, u_1)``, so ``x_2 .. x_k`` are still i.i.d.
``q`` afterwards: the proposal for the next sibling is the unchanged ``q``
(not ``q`` with ``x_1`` removed, which would be the rule for sampling without
replacement), and by induction the rest emits ``r' = max(r - q, 0) / Z``.
Total: ``min(q, r)(y) + Z r'(y) = min(q, r)(y) + max(r - q, 0)(y) = r(y)``.
Once a child is accepted, its subtree was drawn from ``q(. | prefix, x)``
independently of the sibling tests and its uniforms are fresh, so the same
argument applies one level down, and the committed tokens are jointly
distributed as the target.  A rejected token ``x`` had ``p(x) < q(x)``, so
the residual gives it 0: a duplicate sibling (i.i.d. draws repeat) is then
rejected (``u q(x) < 0`` is false) and the residual update is applied again,
as the rule demands.  Degenerate cases, each kept exact:

* ``q(x) == 0`` for a drawn ``x`` (impossible if ``x ~ q``; happens when a
  drafter samples from a wider distribution than the ``q`` it reports, e.g.
  it reports the top-p-filtered ``q``): the draw is VOID -- neither accepted
  nor used to update ``p``.  The remaining valid draws are still i.i.d.
  ``q`` (a filtered distribution restricted to its support IS ``q``), and
  by the claim above the rule is exact for any number of them, so this
  stays exact; accepting ``x`` whenever ``p(x) > 0`` would not.
* ``p == q``: ``u q(x) < q(x) = p(x)`` always holds for ``u < 1``, so a
  rejection has probability 0 and ``max(p - q, 0) == 0`` is never needed.
  If rounding nevertheless produces a rejection whose residual is all zero
  (``Z == 0``), the residual stays ``p`` (the draw is treated as void), so
  the final token always has positive target probability.
* ``p(x) == 0``: never accepted (``u q(x) < 0`` is false).
* A one-hot ``q`` on a chain (one child per node) reduces to the
  deterministic rule: accept iff ``u < p(x)``, residual ``p`` without ``x``.

The rule assumes siblings are i.i.d. draws (with replacement) from ``q``;
distinct-token (without replacement) or top-k children need the
deterministic rule above.  Greedy (``temperature <= 0``) is argmax matching
whatever the children are.

All results are ``(n_accepted, path, out_tokens)`` where, with ``D`` the tree
depth, ``path`` (``[D + 1]``) lists node indices from the root, padded by
repeating the last accepted node, and ``out_tokens`` (``[D + 1]``) lists the
accepted draft tokens, then the bonus token at index ``n_accepted``, then the
bonus token repeated.

The vectorised functions are traceable by ``torch.export`` with static shapes:
every loop runs over the static depth ``D`` or the static width ``W``.
The vectorised walks live beside their Triton kernels (specc/kernels/tree_accept.py); this module
keeps the rules' entry points, the sampling distribution, and ``reference_*``: plain-Python oracles
for tests.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

# The vectorised rules are the acceptance ops' references, beside their Triton kernels; importing
# the package registers the ops (torch.ops.specc.*) that `accept` puts in the step graphs.
from specc.kernels.tree_accept import (accept_greedy_reference, accept_sample_reference, accept_sampled_reference,
                                       inverse_cdf_rows)

__all__ = [
    "tree_depth",
    "sampling_probs",
    "accept_greedy",
    "accept_sample",
    "accept_sample_sampled",
    "accept",
    "inverse_cdf_rows",
    "reference_sampling_probs",
    "reference_accept_greedy",
    "reference_accept_sample",
    "reference_accept_sample_sampled",
]

_MIN_TEMPERATURE = 1e-5


def tree_depth(parents: Sequence[int]) -> int:
    """Maximum node depth of a tree given by ``parents`` (root has depth 0)."""
    depths: list[int] = []
    for i, par in enumerate(parents):
        par = int(par)
        if i == 0:
            if par != -1:
                raise ValueError("parents[0] must be -1")
            depths.append(0)
            continue
        if not 0 <= par < i:
            raise ValueError(f"parents[{i}] = {par} must be in [0, {i})")
        depths.append(depths[par] + 1)
    if not depths:
        raise ValueError("empty tree")
    return max(depths)


# ---------------------------------------------------------------------------
# vectorised (exportable) implementation
# ---------------------------------------------------------------------------


def _top_p_filter(probs: Tensor, top_p: Tensor) -> Tensor:
    """Keep the smallest highest-probability set whose mass is >= top_p."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    cum = torch.cumsum(sorted_p, dim=-1)
    # exclusive cumulative sum: mass strictly before each sorted position
    excl = torch.cat([torch.zeros_like(cum[..., :1]), cum[..., :-1]], dim=-1)
    first = torch.arange(excl.shape[-1], device=excl.device) == 0
    keep_sorted = (excl < top_p) | first | (top_p >= 1.0)  # exact at top_p >= 1: rounding drops no tail
    # the kept probabilities scattered back to vocabulary order (values moved, not recomputed; a
    # float scatter, as TensorRT's ScatterElements takes no bool)
    kept_sorted = torch.where(keep_sorted, sorted_p, torch.zeros_like(sorted_p))
    kept = torch.zeros_like(probs).scatter(-1, order, kept_sorted)
    return kept / kept.sum(dim=-1, keepdim=True)


def sampling_probs(logits: Tensor, temperature: Tensor, top_p: Tensor | None = None) -> Tensor:
    """Target sampling distribution: softmax(logits / T) then top-p, float32.

    ``temperature`` is a 0-d tensor; assumes temperature > 0 (it is clamped to >= 1e-5).
    ``top_p=None`` applies no filter (the `sample` mode's graphs); a 0-d tensor always runs the
    filter, which keeps every token at ``top_p >= 1`` (the `top_p` mode's graphs).
    """
    temperature = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
    t = torch.clamp(temperature, min=_MIN_TEMPERATURE)
    probs = torch.softmax(logits.to(torch.float32) / t, dim=-1)
    if top_p is None:
        return probs
    return _top_p_filter(probs, torch.as_tensor(top_p, dtype=torch.float32, device=logits.device))


def _tree_setup(tokens: Tensor, parents: Sequence[int], children: Tensor):
    depth = tree_depth(parents)
    num_nodes = len(parents)
    if children.dim() != 2 or children.shape[0] != num_nodes:
        raise ValueError("children must be [T, W] with T == len(parents)")
    if tokens.shape[0] != num_nodes:
        raise ValueError("tokens must have length T == len(parents)")
    return depth, num_nodes, children.shape[1]


def accept_greedy(
    logits: Tensor, tokens: Tensor, parents: Sequence[int], children: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy verification (argmax match).  See module docstring."""
    depth, _, _ = _tree_setup(tokens, parents, children)
    return accept_greedy_reference(logits, tokens, children, depth)


def accept_sample(
    logits: Tensor,
    tokens: Tensor,
    parents: Sequence[int],
    children: Tensor,
    temperature: Tensor,
    top_p: Tensor,
    uniforms: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Lossless stochastic verification with sibling retry.  See module docstring."""
    depth, _, _ = _tree_setup(tokens, parents, children)
    return accept_sample_reference(sampling_probs(logits, temperature, top_p), tokens, children, depth, uniforms)


def accept_sample_sampled(
    logits: Tensor,
    tokens: Tensor,
    parents: Sequence[int],
    children: Tensor,
    draft_probs: Tensor,
    temperature: Tensor,
    top_p: Tensor,
    uniforms: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Lossless stochastic verification of SAMPLED children (module docstring).

    ``draft_probs`` (``[T, V]``, same shape as ``logits``): row ``i`` is the
    distribution node ``i``'s children were drawn from, i.i.d.; rows are
    renormalised and rows of leaves are ignored.  Other arguments and the
    outputs are as for :func:`accept_sample`.
    """
    if tuple(draft_probs.shape) != tuple(logits.shape):
        raise ValueError("draft_probs must have the shape of logits, [T, V]")
    depth, _, _ = _tree_setup(tokens, parents, children)
    return accept_sampled_reference(sampling_probs(logits, temperature, top_p), draft_probs, tokens, children, depth,
                                    uniforms)


def accept(
    logits: Tensor,
    tokens: Tensor,
    parents: Sequence[int],
    children: Tensor,
    temperature: Tensor | None,
    top_p: Tensor | None,
    uniforms: Tensor | None,
    draft_probs: Tensor | None = None,
    mode: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy, sampling, or sampling with top-p: `mode` (specc.signature.MODES), a static choice.

    A graph passes its mode; eager callers may leave it None to take it from the concrete
    ``temperature`` and ``top_p`` (greedy at temperature <= 0). Greedy reads neither them nor
    the uniforms, and `sample` ignores ``top_p``. ``draft_probs=None``: children are
    deterministic drafts (one-hot ``q``, :func:`accept_sample`). Given (``[T, V]``), children
    were sampled i.i.d. from ``draft_probs[parent]`` and :func:`accept_sample_sampled` verifies
    them when sampling; greedy is unchanged.
    """
    from .signature import check_mode, mode_of

    mode = check_mode(mode) if mode is not None else mode_of(float(temperature), float(top_p))
    parents = tuple(int(p) for p in parents)
    depth, _, _ = _tree_setup(tokens, parents, children)
    tokens, children = tokens.to(torch.int64), children.to(torch.int64)
    if mode == "greedy":
        return tuple(torch.ops.specc.tree_accept_greedy(logits, tokens, children, depth))
    probs = sampling_probs(logits, temperature, top_p if mode == "top_p" else None)
    uniforms = uniforms.to(torch.float32)
    if draft_probs is not None:
        return accept_sampled_reference(probs, draft_probs.to(torch.float32), tokens, children, depth, uniforms)
    return tuple(torch.ops.specc.tree_accept_sample(probs, tokens, children, depth, uniforms))


# ---------------------------------------------------------------------------
# plain-Python reference oracles
# ---------------------------------------------------------------------------


def _to_list(x):
    if isinstance(x, Tensor):
        return x.detach().cpu().tolist()
    return list(x)


def _argmax(row: Sequence[float]) -> int:
    best = 0
    for i in range(1, len(row)):
        if row[i] > row[best]:
            best = i
    return best


def _child_lists(children) -> list[list[int]]:
    return [[int(c) for c in r if int(c) >= 0] for r in _to_list(children)]


def _pad(path: list[int], out: list[int], depth: int) -> tuple[int, list[int], list[int]]:
    n = len(path) - 1
    path = path + [path[-1]] * (depth + 1 - len(path))
    out = out + [out[-1]] * (depth + 1 - len(out))
    return n, path, out


def reference_sampling_probs(row: Sequence[float], temperature: float, top_p: float) -> list[float]:
    """Plain-Python softmax(row / T) followed by top-p (list of floats)."""
    t = max(float(temperature), _MIN_TEMPERATURE)
    row = [float(v) for v in row]
    m = max(row)
    e = [math.exp((v - m) / t) for v in row]
    s = sum(e)
    p = [v / s for v in e]
    if top_p >= 1.0:
        return p
    # stable descending order: ties keep lower index first
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep = [False] * len(p)
    cum = 0.0
    for rank, i in enumerate(order):
        if rank == 0 or cum < top_p:
            keep[i] = True
            cum += p[i]
        else:
            break
    kept = [p[i] if keep[i] else 0.0 for i in range(len(p))]
    s = sum(kept)
    return [v / s for v in kept]


def reference_accept_greedy(logits, tokens, parents, children) -> tuple[int, list[int], list[int]]:
    rows = _to_list(logits)
    toks = [int(t) for t in _to_list(tokens)]
    kids = _child_lists(children)
    depth = tree_depth([int(p) for p in _to_list(parents)])
    cur = 0
    path = [0]
    out: list[int] = []
    while True:
        target = _argmax(rows[cur])
        nxt = -1
        for c in kids[cur]:
            if toks[c] == target:
                nxt = c
                break
        if nxt < 0:
            break
        path.append(nxt)
        out.append(toks[nxt])
        cur = nxt
    out.append(_argmax(rows[cur]))
    return _pad(path, out, depth)


def reference_accept_sample(
    logits, tokens, parents, children, temperature: float, top_p: float, uniforms
) -> tuple[int, list[int], list[int]]:
    rows = _to_list(logits)
    toks = [int(t) for t in _to_list(tokens)]
    kids = _child_lists(children)
    us = [float(u) for u in _to_list(uniforms)]
    num_nodes = len(rows)
    depth = tree_depth([int(p) for p in _to_list(parents)])
    temperature = float(temperature)
    top_p = float(top_p)
    cur = 0
    path = [0]
    out: list[int] = []
    p = reference_sampling_probs(rows[cur], temperature, top_p)
    while True:
        nxt = -1
        for c in kids[cur]:
            x = toks[c]
            s = sum(p)
            ratio = p[x] / s if s > 0 else 0.0
            if us[c] < ratio:
                nxt = c
                break
            p[x] = 0.0
        if nxt < 0:
            break
        path.append(nxt)
        out.append(toks[nxt])
        cur = nxt
        p = reference_sampling_probs(rows[cur], temperature, top_p)
    out.append(_reference_inverse_cdf(p, us[num_nodes]))  # the residual
    return _pad(path, out, depth)


def _reference_inverse_cdf(p: Sequence[float], u: float) -> int:
    """First index whose cumulative sum of p/sum(p) exceeds u, never past the
    last index with positive mass (as ``inverse_cdf_rows``)."""
    s = sum(p)
    last_nz = 0
    for i, v in enumerate(p):
        if v > 0:
            last_nz = i
    cum = 0.0
    for i, v in enumerate(p):
        cum += v / s if s > 0 else 0.0
        if cum > u or i >= last_nz:
            return i
    return last_nz  # pragma: no cover - the loop always returns


def reference_accept_sample_sampled(
    logits, tokens, parents, children, draft_probs, temperature: float, top_p: float, uniforms
) -> tuple[int, list[int], list[int]]:
    """Plain-Python oracle for :func:`accept_sample_sampled`."""
    rows = _to_list(logits)
    toks = [int(t) for t in _to_list(tokens)]
    kids = _child_lists(children)
    qrows = _to_list(draft_probs)
    us = [float(u) for u in _to_list(uniforms)]
    num_nodes = len(rows)
    depth = tree_depth([int(p) for p in _to_list(parents)])
    temperature = float(temperature)
    top_p = float(top_p)
    cur = 0
    path = [0]
    out: list[int] = []
    p = reference_sampling_probs(rows[cur], temperature, top_p)
    while kids[cur]:
        raw = [float(v) for v in qrows[cur]]
        s = sum(raw)
        q = [v / s for v in raw] if s > 0 else raw
        nxt = -1
        for c in kids[cur]:
            x = toks[c]
            if not q[x] > 0:
                continue  # void draw: q(x) == 0
            if us[c] * q[x] < p[x]:
                nxt = c
                break
            r = [max(a - b, 0.0) for a, b in zip(p, q)]
            z = sum(r)
            if z > 0:
                p = [v / z for v in r]
        if nxt < 0:
            break
        path.append(nxt)
        out.append(toks[nxt])
        cur = nxt
        p = reference_sampling_probs(rows[cur], temperature, top_p)
    out.append(_reference_inverse_cdf(p, us[num_nodes]))
    return _pad(path, out, depth)
