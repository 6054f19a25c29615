"""Pass `attend_prefix` (lowering, CPU): attention reads the filled prefix of the cache, not all of it.

Why: on CPU `specc::tree_attention` runs SDPA over the whole static cache (cache_len keys, 1056 for a
1024-token engine), the empty slots hidden by the mask. Profiled in an AOTInductor step graph of
SmolLM2 on this project's 2-core CPU, that SDPA took 5.7 ms of a 24 ms plain step and 12 ms of a
58 ms 9-token step at context 256. Slicing K, V and the mask to the first kv_len keys makes the work
follow the context length, as the Triton kernel's kv_len does on CUDA. The length is a data-dependent
(unbacked) size, which AOTInductor compiles for CPU; on CUDA the graphs keep static shapes (CUDA
graphs replay fixed launches) and the kernel skips the empty keys itself, so this pass is CPU-only.

Where specc's C++ attention serves the decode graphs (kernels/attention_cpu.cpp: it reads only the keys
below kv_len and sums each row in slot order, so a tree node's row gets the plain step's bits), their
ops stay as they are; this pass then slices the prefill chunks' attention (and, without the C++
kernels, the decode graphs' too, in whole KEY_BLOCKs).
"""
from __future__ import annotations

import operator

import torch

import specc.kernels  # noqa: F401  (registers torch.ops.specc.*)
from specc.passes.tree_attention import tree_attention

aten = torch.ops.aten


# Keys are read in whole blocks of this many: n = kv_len rounded up to a multiple of it (at most S).
# A row's attention sums exp(score) and p * v over the keys in vector lanes and GEMM blocks whose
# boundaries follow n; at n = kv_len exactly, the plain step (kv_len = base + 1) and a T-node step
# (base + T) of one engine split the same visible keys differently and their rows differ in the last
# bits (measured: bf16 and fp32, ATen's CPU flash kernel, from 2 nodes). With n a multiple of 64 the
# split of the visible keys is the same for every T, and the keys between two such n are masked:
# exp gives exactly 0 there, which adds nothing. Cost: up to 63 masked keys per call.
KEY_BLOCK = 64


def keys_read(kv_len: int, S: int) -> int:
    """The keys an attention reads when kv_len are filled: what the pass computes in the graph."""
    return min(S, -(-kv_len // KEY_BLOCK) * KEY_BLOCK)


def attend_prefix(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Invariant: every `specc::tree_attention(q, k, v, mask, scale, kv_len)` (except those the C++
    kernel serves, rows_kernel_here: left as they are) becomes SDPA over
    k[:, :, :n], v[:, :, :n] and mask[..., :n] with n = min(S, kv_len rounded up to a multiple of
    KEY_BLOCK) as an integer, asserted in [1, S] (one n per kv_len node, shared by all layers). The
    keys dropped are only keys the mask hides (tree_attention's contract for kv_len), so the values
    equal the op's CPU reference up to the order of the float sums. A decode step's call becomes one
    SDPA call per tree node over that node's G grouped query rows (the shape of the plain step's call):
    a call over all G * T rows lets the library GEMM block the sums by the row count (measured on an
    AMD EPYC from 2 nodes on), while the same G-row call over n and n + KEY_BLOCK keys gives the same
    bits (KEY_BLOCK). Calls without kv_len and the signature are unchanged.

    Plain SDPA calls over a cache just written (a prefill chunk's, which its plan leaves as SDPA for
    every backend) first become the op with kv_len = 1 + the last slot written (`tree_attention`),
    so a chunk attends over the prompt so far, not the whole cache."""
    decode = {n for n in ep.graph.nodes if n.op == "call_function" and n.target is torch.ops.specc.tree_attention.default}
    keep = decode if rows_kernel_here(ep) else set()
    ep = tree_attention(ep)
    g = ep.graph_module.graph
    lengths: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in list(g.nodes):
        if node.op != "call_function" or node.target is not torch.ops.specc.tree_attention.default or node in keep:
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
            nodes = _query_groups(q, mask) if node in decode else None
            if nodes is None:
                out = _sdpa(g, q, ks, vs, mask, scale, n)
            else:  # a decode step: one call per tree node, the plain step's call for its G rows
                G, T, base_mask = nodes
                B, KV, _, D = q.meta["val"].shape
                qg = _fake(g.call_function(aten.view.default, (q, [B, KV, G, T, D])))
                outs = [_sdpa(g, _fake(g.call_function(aten.select.int, (qg, 3, t))), ks, vs,
                              _node_mask(g, base_mask, t, G), scale, n) for t in range(T)]
                out = _fake(g.call_function(aten.stack.default, (outs, 3)))
                out = _fake(g.call_function(aten.view.default, (out, [B, KV, G * T, D])))
            # the op's reference returns a contiguous tensor (the CPU flash kernel's output may not be)
            out = _fake(g.call_function(aten.clone.default, (out,), {"memory_format": torch.contiguous_format}))
        out.meta.update({k_: v_ for k_, v_ in node.meta.items() if k_ != "val"})
        node.replace_all_uses_with(out)
        g.erase_node(node)
    g.lint()
    ep.graph_module.recompile()
    return ep


def _sdpa(g, q, ks, vs, mask, scale, n):
    ms = _fake(g.call_function(aten.slice.Tensor, (mask, 3, None, n))) if mask.meta["val"].shape[3] != 1 else mask
    return _fake(g.call_function(aten.scaled_dot_product_attention.default, (q, ks, vs, ms), {"scale": scale}))


def _query_groups(q: torch.fx.Node, mask: torch.fx.Node):
    """(G, T, the step's [.., T, S] mask) of a decode call whose G*T query rows are T tree nodes of G
    grouped heads each (TargetModule folds a query group into the query length, row g * T + t, and
    repeats the mask G times); None for a one-row-per-node call that needs no split (T = 1)."""
    rows = q.meta["val"].shape[2]
    if mask.op == "call_function" and mask.target is aten.repeat.default and mask.args[1][:2] == [1, 1] \
            and mask.args[1][3] == 1:
        G, base = mask.args[1][2], mask.args[0]
    else:
        G, base = 1, mask
    T = rows // G
    return None if T == 1 or G * T != rows else (G, T, base)


def _node_mask(g, base_mask: torch.fx.Node, t: int, G: int) -> torch.fx.Node:
    """Tree node t's mask row, repeated for its G query rows: what the plain step's call takes."""
    if base_mask.meta["val"].shape[2] == 1:  # one row for every node
        row = base_mask
    else:
        row = _fake(g.call_function(aten.slice.Tensor, (base_mask, 2, t, t + 1)))
    return _fake(g.call_function(aten.repeat.default, (row, [1, 1, G, 1]))) if G > 1 else row


def rows_kernel_here(ep: torch.export.ExportedProgram) -> bool:
    """Whether the decode graph's attention ops run the C++ kernel (tree_attention.rows_kernel), which
    reads only the keys below kv_len itself and sums each row in slot order: those ops stay as they are."""
    from specc.kernels.tree_attention import rows_kernel

    ops = [n for n in ep.graph.nodes if n.op == "call_function" and n.target is torch.ops.specc.tree_attention.default]
    return bool(ops) and all(rows_kernel(n.args[0].meta["val"], n.args[3].meta["val"]) for n in ops)


def _length(g: torch.fx.Graph, kv_len: torch.fx.Node, S: int) -> torch.fx.Node:
    """kv_len rounded up to whole KEY_BLOCKs (at most S) as an unbacked integer, with the asserts
    that bound it (what torch.export writes for `n = t.item(); torch._check(1 <= n <= S)`)."""
    up = _fake(g.call_function(aten.add.Tensor, (kv_len, KEY_BLOCK - 1)))
    up = _fake(g.call_function(aten.div.Tensor_mode, (up, KEY_BLOCK), {"rounding_mode": "floor"}))
    up = _fake(g.call_function(aten.mul.Tensor, (up, KEY_BLOCK)))
    up = _fake(g.call_function(aten.clamp_max.default, (up, S)))
    item = g.call_function(aten.item.default, (up,))
    mode = _fake_mode(kv_len.meta["val"])
    with mode:
        u = aten.item.default(up.meta["val"])
    # the symbol is bound by this node's output: record it as export does, and clear it from the
    # shape environment's pending list (the next trace would otherwise look for it in other outputs)
    mode.shape_env.pending_fresh_unbacked_symbols.clear()
    item.meta["val"], item.meta["unbacked_bindings"] = u, {u.node.expr: ()}
    for op, bound in ((operator.ge, 1), (operator.le, S)):
        check = g.call_function(op, (item, bound))
        check.meta["val"] = op(u, bound)
        g.call_function(aten._assert_scalar.default, (check, f"the keys read must lie in [1, {S}]"))
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
