"""`specc::rows_linear(x, w)`: x @ w.T for a few rows of x and a weight the graph holds as it is
(float, or int8 cast to x's dtype: `--quant int8`'s weights, their scale applied after the product).

The `matvec` pass (passes/matvec.py) puts it in place of a few-row `linear` whose weight is a
parameter. Its body is what Inductor compiles: on CPU, for int8 weights and for float32 ones at 1 row
or from KERNEL_MIN_ROWS rows on a CPU with AVX-512, the hand-written product `specc_cpu::dense_matvec` (dense_cpu.cpp) where
it builds (or as `specc compile` timed the two on the machine: kernel_choice, specc/products.py);
everywhere else the reference below, one multiply and row sum per input row over the
weight, which Inductor fuses into one streaming reduction loop (the pass's form for every weight
before this op existed; still its form for other weights computed in the graph).
"""
from __future__ import annotations

import contextlib

import torch
import torch._inductor.inductor_prims  # noqa: F401 -- registers prims.inductor_force_stride_order
from torch import Tensor

from .cpu_kernels import load_cpu_kernel

# Whole step graphs of SmolLM2 on the AVX-512 EPYC, 2026-12-04 (BENCHMARKS.md "Cost curve of the step
# graphs, 2026-12-04"): the C++ product wins at 1 row (plain step 12.9 ms, 16.2 with the reduction) and
# from 5 (8 rows: 17.3 against 29.3), the reduction at 2-4 rows (2 rows: 13.4-13.9 against 14.7-15.3
# with the C++ product). int8 weights take the C++ product at every row count: it wins from 4 rows
# (8 rows: 6.6 against 10.2 ms for the products alone, "Decode-step products alone"), is within 10%
# at 1-2, and one product keeps plain and step graphs computing each row alike.
KERNEL_MIN_ROWS = 5
# Without AVX-512, float32 takes the reduction. On an AVX2 EPYC (2026-12-05) the portable loop lost to
# it at every row count (products alone, 1 row: 27.5 against 15.5 ms; 8 rows: 63.2 against 28.6); the
# AVX2 tiles that replaced it tie with it in whole step graphs (examples/time_family.py, two runs of
# the chain:8 family each way: within +-8% at every node count, neither side ahead in both runs), so
# nothing is gained by the call out of the graph. int8 keeps the C++ product there (products alone:
# 8.6 against 66.1 ms at 1 row, "Decode-step products alone 2"). None: read the CPU.
FLOAT32_KERNEL: bool | None = None
# For a target large enough to tell them apart the float32 products are measured, not ruled:
# `specc compile` lowers the plain graph (one row) and the whole tree's step graph (KERNEL_MIN_ROWS
# rows or more) both ways, times each pair and keeps the faster (specc/products.py). On a Zen 4 EPYC
# (2026-12-06) the C++ product that won at one row on an earlier AVX-512 EPYC lost there: plain 23.4
# ms, slower than the reduction's 2-node step (20.8 ms).
# None: the rule above (float32_kernel()); True / False: what kernel_choice() set while lowering.
ONE_ROW_KERNEL: bool | None = None
MANY_ROWS_KERNEL: bool | None = None


@contextlib.contextmanager
def kernel_choice(one_row: bool | None = None, many_rows: bool | None = None):
    """Lower graphs under these choices for float32 products of one row and of KERNEL_MIN_ROWS rows or
    more (True: the C++ product, False: the reduction, None: the rule)."""
    global ONE_ROW_KERNEL, MANY_ROWS_KERNEL
    saved, (ONE_ROW_KERNEL, MANY_ROWS_KERNEL) = (ONE_ROW_KERNEL, MANY_ROWS_KERNEL), (one_row, many_rows)
    try:
        yield
    finally:
        ONE_ROW_KERNEL, MANY_ROWS_KERNEL = saved


def choice_key() -> str:
    """What decides rows_linear's body besides its source: part of the compile cache's key."""
    return (f"float32_kernel={float32_kernel()},one_row={ONE_ROW_KERNEL},many_rows={MANY_ROWS_KERNEL},"
            f"min_rows={KERNEL_MIN_ROWS}")


def float32_kernel() -> bool:
    global FLOAT32_KERNEL
    if FLOAT32_KERNEL is None:
        FLOAT32_KERNEL = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    return FLOAT32_KERNEL


def rows_linear_reference(x: Tensor, w: Tensor) -> Tensor:
    """One [out, in] reduction per row, all over the same weight, the rows stored once (Inductor
    would otherwise recompute their pointwise producer inside the reduction for every weight row)."""
    shape, K = list(x.shape[:-1]), x.shape[-1]
    rows = torch.ops.prims.inductor_force_stride_order(x.reshape(-1, K), [K, 1])
    sums = [(w * rows[r]).sum(-1) for r in range(rows.shape[0])]
    return torch.stack(sums, 0).view(shape + [w.shape[0]])


@torch.library.triton_op("specc::rows_linear", mutates_args=())
def rows_linear(x: Tensor, w: Tensor) -> Tensor:
    """x @ w.T, for the few rows of a decode step. A `triton_op`: export keeps it as one node and
    Inductor traces into this body, which picks the C++ product on CPU float32, at the row counts where
    it was measured faster, when it builds."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and kernel_rows(x.numel() // x.shape[-1], w.dtype) \
            and load_cpu_kernel():
        return torch.ops.specc_cpu.dense_matvec(x, w)
    return rows_linear_reference(x, w)


def kernel_rows(rows: int, dtype: torch.dtype) -> bool:
    """Whether the C++ product computes `rows` rows over a weight of `dtype` (where it was measured faster)."""
    if dtype == torch.int8:
        return True
    if dtype == torch.float32 and rows == 1 and ONE_ROW_KERNEL is not None:
        return ONE_ROW_KERNEL
    if dtype == torch.float32 and rows >= KERNEL_MIN_ROWS and MANY_ROWS_KERNEL is not None:
        return MANY_ROWS_KERNEL
    return dtype == torch.float32 and float32_kernel() and (rows == 1 or rows >= KERNEL_MIN_ROWS)
