"""Pass `attend_prefix` (lowering, CPU): attention reads the filled prefix of the cache, not all of it.

Why: on CPU `specc::tree_attention` runs SDPA over the whole static cache (cache_len keys, 1056 for a
1024-token engine), the empty slots hidden by the mask. Profiled in an AOTInductor step graph of
SmolLM2 on this project's 2-core CPU, that SDPA took 5.7 ms of a 24 ms plain step and 12 ms of a
58 ms 9-token step at context 256. Slicing K, V and the mask to the first kv_len keys makes the work
follow the context length, as the Triton kernel's kv_len does on CUDA. The length is a data-dependent
(unbacked) size, which AOTInductor compiles for CPU; on CUDA the graphs keep static shapes (CUDA
graphs replay fixed launches) and the kernel skips the empty keys itself, so this pass is CPU-only.
"""
from __future__ import annotations

import operator

import torch

import specc.kernels  # noqa: F401  (registers torch.ops.specc.*)
from specc.passes.tree_attention import tree_attention

aten = torch.ops.aten


def attend_prefix(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Invariant: every `specc::tree_attention(q, k, v, mask, scale, kv_len)` becomes SDPA over
    k[:, :, :n], v[:, :, :n] and mask[..., :n] with n = kv_len as an integer, asserted in [1, S]
    (one n per kv_len node, shared by all layers). The keys dropped are exactly those the mask hides
    (tree_attention's contract for kv_len), so the values equal the op's CPU reference up to the
    order of the float sums. Calls without kv_len and the signature are unchanged.

    Plain SDPA calls over a cache just written (a prefill chunk's, which its plan leaves as SDPA for
    every backend) first become the op with kv_len = 1 + the last slot written (`tree_attention`),
    so a chunk attends over the prompt so far, not the whole cache."""
    ep = tree_attention(ep)
    g = ep.graph_module.graph
    lengths: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in list(g.nodes):
        if node.op != "call_function" or node.target is not torch.ops.specc.tree_attention.default:
            continue
        if len(node.args) < 6 or node.args[5] is None:
            continue
        q, k, v, mask, scale, kv_len = node.args[:6]
        S = k.meta["val"].shape[2]
        with g.inserting_before(node):
            if kv_len not in lengths:
                lengths[kv_len] = _length(g, kv_len, S)
            n = lengths[kv_len]
            ks = _fake(g.call_function(aten.slice.Tensor, (k, 2, None, n)))
            vs = _fake(g.call_function(aten.slice.Tensor, (v, 2, None, n)))
            ms = _fake(g.call_function(aten.slice.Tensor, (mask, 3, None, n))) if mask.meta["val"].shape[3] != 1 \
                else mask
            out = _fake(g.call_function(aten.scaled_dot_product_attention.default, (q, ks, vs, ms), {"scale": scale}))
            # the op's reference returns a contiguous tensor (the CPU flash kernel's output may not be)
            out = _fake(g.call_function(aten.clone.default, (out,), {"memory_format": torch.contiguous_format}))
        out.meta.update({k_: v_ for k_, v_ in node.meta.items() if k_ != "val"})
        node.replace_all_uses_with(out)
        g.erase_node(node)
    g.lint()
    ep.graph_module.recompile()
    return ep


def _length(g: torch.fx.Graph, kv_len: torch.fx.Node, S: int) -> torch.fx.Node:
    """kv_len as an unbacked integer, with the asserts that bound it (what torch.export writes for
    `n = t.item(); torch._check(1 <= n <= S)`)."""
    item = g.call_function(aten.item.default, (kv_len,))
    mode = _fake_mode(kv_len.meta["val"])
    with mode:
        u = aten.item.default(kv_len.meta["val"])
    # the symbol is bound by this node's output: record it as export does, and clear it from the
    # shape environment's pending list (the next trace would otherwise look for it in other outputs)
    mode.shape_env.pending_fresh_unbacked_symbols.clear()
    item.meta["val"], item.meta["unbacked_bindings"] = u, {u.node.expr: ()}
    for op, bound in ((operator.ge, 1), (operator.le, S)):
        check = g.call_function(op, (item, bound))
        check.meta["val"] = op(u, bound)
        g.call_function(aten._assert_scalar.default, (check, f"kv_len must lie in [1, {S}]"))
        torch._check(op(u, bound))  # tells the shape environment the range
    return item


def _fake_mode(val):
    return torch._guards.detect_fake_mode([val])


def _fake(node: torch.fx.Node) -> torch.fx.Node:
    """Fill `meta["val"]` by running the node on its inputs' fake values."""
    def val(a):
        return a.meta["val"] if isinstance(a, torch.fx.Node) else a
    args, kwargs = torch.fx.node.map_arg(node.args, val), torch.fx.node.map_arg(node.kwargs, val)
    with torch._guards.detect_fake_mode(torch.utils._pytree.tree_leaves(args)):
        node.meta["val"] = node.target(*args, **kwargs)
    return node
