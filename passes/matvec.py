"""Pass `matvec`: a linear layer applied to a few rows becomes a multiply and a row sum.

Why: on this CPU, MKL's sgemv streams a weight at 16-22 GB/s, while Inductor compiles
`(x[..., None, :] * w).sum(-1)` over a contiguous [out, in] weight into one vectorised reduction
loop that reads it at the speed of a plain sum (about 43 GB/s; BENCHMARKS.md, "matvec"). The
loop reads the weight once per row, so it only pays for a handful of rows: larger products stay
GEMMs. The eager backend keeps `linear`, since there the product would be materialised.
"""
from __future__ import annotations

import math

import torch

aten = torch.ops.aten

MAX_ROWS = 5  # measured: the reduction beats sgemm up to 5 rows of SmolLM2's shapes, loses from 8


def matvec(ep: torch.export.ExportedProgram, max_rows: int = MAX_ROWS) -> torch.export.ExportedProgram:
    """Invariant: every `aten.linear` whose input has at most `max_rows` rows is replaced by
    unsqueeze -> mul -> sum(-1) (+ bias); values are equal up to the order of the float sum.
    Nothing else in the graph changes, nor the signature."""
    g = ep.graph_module.graph
    for node in list(g.nodes):
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        x, w = node.args[0], node.args[1]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        x_val = x.meta["val"]
        if math.prod(x_val.shape[:-1]) > max_rows:
            continue
        with g.inserting_before(node):
            xu = g.call_function(aten.unsqueeze.default, (x, -2))
            prod = g.call_function(aten.mul.Tensor, (xu, w))
            out = g.call_function(aten.sum.dim_IntList, (prod, [-1]))
            if b is not None:
                out = g.call_function(aten.add.Tensor, (out, b))
        _propagate_meta([xu, prod, out] if b is None else [xu, prod, out.args[0], out])
        node.replace_all_uses_with(out)
        g.erase_node(node)
    g.lint()
    ep.graph_module.recompile()
    return ep


def _propagate_meta(nodes) -> None:
    """Fill `meta["val"]` of new nodes by running them on the fake tensors of their inputs."""
    for n in nodes:
        args = torch.fx.node.map_arg(n.args, lambda a: a.meta["val"])
        with torch._guards.detect_fake_mode(torch.utils._pytree.tree_leaves(args)):
            n.meta["val"] = n.target(*args)
