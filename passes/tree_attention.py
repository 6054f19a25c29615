"""Pass `tree_attention`: the captured attention calls become `specc::tree_attention`.

Why: the op is the project's own kernel on CUDA (GQA-native, one read of K/V per kv head, tree
mask as given), and plain SDPA everywhere else; rewriting the node keeps the graph's meaning while
choosing the kernel.
"""
from __future__ import annotations

import math

import torch
from torch.fx.operator_schemas import normalize_function

import specc.kernels  # noqa: F401  (registers torch.ops.specc.*)

SDPA = torch.ops.aten.scaled_dot_product_attention.default
CACHE_WRITES = (torch.ops.aten.index_copy_.default, torch.ops.aten.index_copy.default)


def _written_slots(key: torch.fx.Node) -> torch.fx.Node | None:
    """The slots a key cache was just written at (Block.forward: k_cache.index_copy_(2, cache_pos, k)),
    or None when the key is anything else."""
    if key.op == "call_function" and key.target in CACHE_WRITES and key.args[1] == 2:
        return key.args[2]
    return None


def _fits(kw: dict) -> bool:
    """Whether an SDPA call is one the op computes: batch 1, q/k/v with the same number of heads
    (GQA already folded into the rows), a float additive mask broadcastable to [1, 1, M, S], and
    no dropout, causal flag or GQA flag."""
    q, k, v, mask = (kw.get(n) for n in ("query", "key", "value", "attn_mask"))
    if not all(isinstance(a, torch.fx.Node) and "val" in a.meta for a in (q, k, v, mask)):
        return False
    if kw.get("dropout_p", 0.0) != 0.0 or kw.get("is_causal", False) or kw.get("enable_gqa", False):
        return False
    qv, kv, vv, mv = (a.meta["val"] for a in (q, k, v, mask))
    if qv.dim() != 4 or qv.shape[0] != 1 or kv.shape != vv.shape or kv.dim() != 4:
        return False
    if kv.shape[0] != 1 or kv.shape[1] != qv.shape[1] or kv.shape[3] != qv.shape[3]:
        return False
    M, S = qv.shape[2], kv.shape[2]
    if not mv.is_floating_point() or mv.dim() != 4 or tuple(mv.shape[:2]) != (1, 1):
        return False
    return mv.shape[2] in (1, M) and mv.shape[3] in (1, S)


def tree_attention(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Invariant: every `aten.scaled_dot_product_attention` node that fits the op's contract (as
    every attention of capture.Block does: batch 1, GQA folded into the query rows, a float
    additive mask, no dropout or causal flag) is replaced by `specc::tree_attention` with the same
    q, k, v, mask and scale (SDPA's default 1/sqrt(D) made explicit). Where the key is a cache just
    written at slots `cache_pos`, the op also gets kv_len = 1 + max(cache_pos): every later slot is
    empty and masked (the step's own tree is the last thing written), so the kernel need not read
    it. On CPU the op runs that very SDPA call, so values are unchanged; nothing else in the graph
    changes, nor the signature. Calls that do not fit are left as they are."""
    g = ep.graph_module.graph
    bounds: dict[torch.fx.Node, torch.fx.Node] = {}  # slots -> kv_len: computed once, before the first layer
    for node in list(g.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        norm = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        kw = dict(norm.kwargs) if norm is not None else {}
        if not _fits(kw):
            continue
        q = kw["query"]
        scale = kw.get("scale")
        if scale is None:
            scale = 1.0 / math.sqrt(q.meta["val"].shape[-1])  # SDPA's default, computed as it does (double)
        args = (q, kw["key"], kw["value"], kw["attn_mask"], float(scale))
        slots = _written_slots(kw["key"])
        with g.inserting_before(node):
            if slots is not None and slots not in bounds:
                last = g.call_function(torch.ops.aten.amax.default, (slots, [0]))
                bounds[slots] = g.call_function(torch.ops.aten.add.Tensor, (last, 1))
                for n in (last, bounds[slots]):  # the fake values that later passes and Inductor read
                    vals = torch.fx.node.map_arg(n.args, lambda a: a.meta["val"])
                    with torch._guards.detect_fake_mode(torch.utils._pytree.tree_leaves(vals)):
                        n.meta["val"] = n.target(*vals)
            if slots is not None:
                args = (*args, bounds[slots])
            new = g.call_function(torch.ops.specc.tree_attention.default, args)
        new.meta.update(node.meta)  # keep stack trace and module path for dumps and unflattening
        vals = torch.fx.node.map_arg(args, lambda a: a.meta["val"])
        with torch._guards.detect_fake_mode(torch.utils._pytree.tree_leaves(vals)):
            new.meta["val"] = torch.ops.specc.tree_attention.default(*vals)
        node.replace_all_uses_with(new)
        g.erase_node(node)
    g.lint()
    ep.graph_module.recompile()
    return ep
