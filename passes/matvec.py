"""Pass `matvec`: a linear layer applied to a few rows becomes a product made for few rows.

Why: on this CPU, MKL's sgemv streams a weight at 16-22 GB/s, while Inductor compiles
`(x_r * w).sum(-1)` over a contiguous [out, in] weight into one vectorised reduction loop that
reads it at the speed of a plain sum (about 43 GB/s; BENCHMARKS.md, "matvec"). The multiply-adds
grow with the rows while the weight traffic does not; with the rows stored once (below) the
reduction still beats the GEMM at 16 and 32 rows on these CPUs, so a tree of up to 16 nodes
verifies in far fewer plain steps' time than through GEMMs. Larger products (prefill chunks) stay GEMMs.
The eager backend keeps `linear`, since there the product would be materialised.

A weight the graph holds as a parameter goes to `specc::rows_linear` (kernels/rows_linear.py), whose
body is that reduction, or on CPU float32 at 1 row and at many rows (more input rows than the
reduction keeps in cache: rows_linear.many_rows) a hand-written C++ product that stays near the
memory's speed where the reduction falls behind (BENCHMARKS.md, "Cost curve of the step graphs,
2026-12-04" and "Products by weight width, 2026-12-06"), where compile timed it faster on the
machine (specc/products.py).
An int8 weight cast to float in the graph (`--quant int8`) goes to it as the int8 tensor, the cast
now rows_linear's; any other weight computed in the graph keeps the reduction written out in the
graph, where Inductor fuses its producer into the loop.
"""
from __future__ import annotations

import math

import torch
import torch._inductor.inductor_prims  # noqa: F401 -- registers prims.inductor_force_stride_order

import specc.kernels  # noqa: F401  (registers torch.ops.specc.rows_linear)

aten = torch.ops.aten

# Measured on CPU: the reduction with the rows stored beats MKL's GEMM up to 32 rows (LM head: 12.8 vs
# 30.2 ms at 16 rows), and with the C++ product from 5 rows (the rule then) a step verifying 8 nodes
# costs 1.35 plain steps (17.3 ms; 29.3 with the reductions alone, 106 with GEMMs), 16 nodes 1.82
# (23.5 ms). Not yet
# measured on CUDA against cuBLAS (the graphs are captured on the CPU, so a per-device limit would
# have to come from the compile config).
MAX_ROWS = 16


def matvec(ep: torch.export.ExportedProgram, max_rows: int = MAX_ROWS, stored_only: bool = False
           ) -> torch.export.ExportedProgram:
    """Invariant: every `aten.linear` whose input has at most `max_rows` rows is replaced by
    `specc::rows_linear` where its weight is a placeholder or an int8 placeholder cast to the input's
    dtype (the cast, left unused, goes too), else by one multiply and sum over the last dimension per
    row, stacked (+ bias); values are equal up to the order of the float sum. Nothing else in the
    graph changes, nor the signature.

    One [out, in] reduction per row, all over the same weight: Inductor fuses reductions with equal
    loop ranges into one loop over weight rows (in parallel) and the input dimension (vectorised),
    and loads each weight element once for all of them. A single [rows, out, in] product instead
    streams the weight once per row and splits the threads over the rows.

    The rows are a stored buffer: left alone, Inductor inlines their pointwise producer (the residual
    add and RMSNorm before the q/k/v, gate/up and LM-head products) into the reduction and recomputes
    it for every weight row and token row, which makes a 3-row step compute-bound (measured: the
    LM-head kernel 5.4 ms at 1 row, 22.4 at 3; 7.2 at 3 once stored).

    `stored_only` (the eager backend): only the products over stored weights change, to the op, whose
    eager body gives each row the bits of a one-row product (rows_linear.rows_linear_each); a
    product over a weight computed in the graph stays `linear` (its sums would be materialised)."""
    g = ep.graph_module.graph
    for node in list(g.nodes):
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        x, w = node.args[0], node.args[1]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        shape = list(x.meta["val"].shape)
        rows, n = math.prod(shape[:-1]), w.meta["val"].shape[0]
        if rows > max_rows:
            continue
        stored = _stored_weight(w, x.meta["val"].dtype)
        if stored is None and stored_only:
            continue
        with g.inserting_before(node):
            if stored is not None:
                new = [g.call_function(torch.ops.specc.rows_linear.default, (x, stored))]
            else:
                new = _row_sums(g, x, w, rows, shape, n)
            if b is not None:
                new.append(g.call_function(aten.add.Tensor, (new[-1], b)))
        _propagate_meta(new)
        node.replace_all_uses_with(new[-1])
        g.erase_node(node)
        if w is not stored and stored is not None and not w.users:  # the cast rows_linear does in registers
            g.erase_node(w)
    g.lint()
    ep.graph_module.recompile()
    return ep


# On CUDA rows_linear is a tensor-core tile kernel with one tile shape at any row count
# (kernels/rows_linear.py), so it serves a verify of any tree size: trees of more than MAX_ROWS nodes
# too, which would otherwise reach cuBLAS, whose kernel choice by shape gives a verify row other bits
# than the plain step's.
CUDA_DECODE_ROWS = 64


def decode_products(ep: torch.export.ExportedProgram, max_rows: int = CUDA_DECODE_ROWS) -> torch.export.ExportedProgram:
    """Invariant: in a decode graph (one that calls specc::tree_attention), every `aten.linear` over a
    stored weight with at most `max_rows` rows becomes `specc::rows_linear` (matvec, stored_only);
    other graphs (prefill chunks, drafters' graphs) are returned unchanged. A lowering pass for CUDA."""
    if not any(n.op == "call_function" and n.target is torch.ops.specc.tree_attention.default for n in ep.graph.nodes):
        return ep
    return matvec(ep, max_rows=max_rows, stored_only=True)


CASTS = (aten.to.dtype, aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def _stored_weight(w, dtype):
    """The placeholder rows_linear can read the weight from: the weight itself, or the int8 tensor an
    int8 weight is cast from (the cast becomes rows_linear's, done in registers); None for any other
    weight computed in the graph."""
    if w.op == "placeholder":
        return w
    if (w.op == "call_function" and w.target in CASTS and w.args[0].op == "placeholder"
            and w.args[0].meta["val"].dtype == torch.int8 and w.meta["val"].dtype == dtype):
        return w.args[0]
    return None


def _row_sums(g, x, w, rows: int, shape: list, n: int) -> list:
    """rows_linear_reference written out in the graph (nodes in order, the result last)."""
    new = [g.call_function(aten.view.default, (x, [rows, shape[-1]]))]
    new.append(g.call_function(torch.ops.prims.inductor_force_stride_order.default, (new[0], [shape[-1], 1])))
    sums = []
    for r in range(rows):
        new.append(g.call_function(aten.select.int, (new[1], 0, r)))
        new.append(g.call_function(aten.mul.Tensor, (w, new[-1])))
        new.append(g.call_function(aten.sum.dim_IntList, (new[-1], [-1])))
        sums.append(new[-1])
    new.append(g.call_function(aten.stack.default, (sums, 0)))
    new.append(g.call_function(aten.view.default, (new[-1], shape[:-1] + [n])))
    return new


def _propagate_meta(nodes) -> None:
    """Fill `meta["val"]` of new nodes by running them on the fake tensors of their inputs."""
    for n in nodes:
        args = torch.fx.node.map_arg(n.args, lambda a: a.meta["val"])
        with torch._guards.detect_fake_mode(torch.utils._pytree.tree_leaves(args)):
            n.meta["val"] = n.target(*args)
