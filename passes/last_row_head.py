"""Pass `last_row_head`: a prefill chunk's LM head runs on the one row whose token it returns.

Why: `sample_last` reads the logits of the chunk's last valid row only, but the captured target
computes the head for all C rows first: at C = 32 on this CPU that is 26 ms of a 140 ms fp32 chunk
(SmolLM2's 49152 x 576 head), and 65 ms with int8 weights, whose GEMM path casts the whole head per
call. Selecting the row before the head leaves a one-row product, which `matvec` then streams.
"""
from __future__ import annotations

import torch
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

aten = torch.ops.aten

# What may lie between the head's product and the row selection: ops that act on each row alone.
ROW_WISE = {aten.to.dtype, aten._to_copy.default, aten.mul.Tensor, aten.add.Tensor, aten.div.Tensor,
            aten.clone.default, aten.alias.default}


def _products():
    ops = {aten.linear.default}
    gguf = getattr(getattr(torch.ops, "specc", None), "gguf_linear", None)
    return ops | ({gguf.default} if gguf is not None else set())


def _uses(node) -> int:
    """node's users, not counting export's dtype/device assertions (which hold for any rows)."""
    return sum(1 for u in node.users if u.target is not aten._assert_tensor_metadata.default)


def _row_wise(node) -> bool:
    """`node` maps each row of its first operand to the same row of its output: its other operands
    are scalars or vectors (which broadcast along the last dimension)."""
    if node.op != "call_function" or node.target not in ROW_WISE or not isinstance(node.args[0], torch.fx.Node):
        return False
    others = [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, torch.fx.Node)]
    return all(a.meta["val"].dim() <= 1 for a in others)


def last_row_head(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Invariant: where the graph's row selection `index_select(select(p, 0, 0), 0, idx)` of a
    product p = linear(x [1, C, in], w) (or specc::gguf_linear), through row-wise ops only, is
    p's sole use, the product runs on `index_select(x, 1, idx)` instead and the selection goes:
    the same values (each output row of a product depends on its input row alone), computed for
    one row. Other graphs are left as they are; shapes in the graph's metadata are recomputed."""
    g = ep.graph_module.graph
    products = _products()
    changed = False
    for sel in list(g.nodes):
        if sel.op != "call_function" or sel.target is not aten.index_select.default or sel.args[1] != 0:
            continue
        batch = sel.args[0]
        if not (isinstance(batch, torch.fx.Node) and batch.target is aten.select.int
                and tuple(batch.args[1:]) == (0, 0) and _uses(batch) == 1):
            continue
        node = batch.args[0]
        while node.target not in products and _uses(node) == 1 and _row_wise(node):
            node = node.args[0]
        if node.op != "call_function" or node.target not in products or _uses(node) != 1:
            continue
        x, idx = node.args[0], sel.args[2]
        shape = x.meta["val"].shape
        if len(shape) != 3 or shape[0] != 1 or idx.meta["val"].shape != (1,):
            continue
        _hoist(idx, before=node)
        with g.inserting_before(node):
            row = g.call_function(aten.index_select.default, (x, 1, idx))
        node.replace_input_with(x, row)
        sel.replace_all_uses_with(batch)  # batch now holds the one selected row
        g.erase_node(sel)
        changed = True
    if changed:
        g.lint()
        ep.graph_module.recompile()
        _refresh_shapes(ep)
    return ep


def _hoist(node, before) -> None:
    """Move `node` and whatever it depends on ahead of `before` (keeping their order)."""
    order = {n: i for i, n in enumerate(before.graph.nodes)}
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function" or order[n] < order[before]:
            continue
        seen.add(n)
        todo.extend(a for a in n.all_input_nodes)
    for n in sorted(seen, key=order.get):
        before.prepend(n)


def _refresh_shapes(ep: torch.export.ExportedProgram) -> None:
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    fake_mode = next(n.meta["val"].fake_mode for n in placeholders if hasattr(n.meta.get("val"), "fake_mode"))
    with fake_mode:
        FakeTensorProp(ep.graph_module, fake_mode).propagate_dont_convert_inputs(
            *[n.meta["val"] for n in placeholders])
