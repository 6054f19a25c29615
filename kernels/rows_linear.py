"""`specc::rows_linear(x, w)`: x @ w.T for a few rows of x and a weight the graph holds as it is
(float, or int8 cast to x's dtype: `--quant int8`'s weights, their scale applied after the product).

The `matvec` pass (passes/matvec.py) puts it in place of a few-row `linear` whose weight is a
parameter. Its body is what Inductor compiles: on CPU, for int8 weights and for float32 ones at 1 row
or at more rows than the reduction holds in cache (many_rows) on a CPU with AVX-512, the hand-written
product `specc_cpu::dense_matvec` (dense_cpu.cpp) where it builds (or as `specc compile` timed the two
on the machine: kernel_choice, specc/products.py);
everywhere else on CPU the reference below, one multiply and row sum per input row over the
weight, which Inductor fuses into one streaming reduction loop (the pass's form for every weight
before this op existed; still its form for other weights computed in the graph). On CUDA a Triton
kernel on the tensor cores with one tile shape at every row count (rows_linear_triton).

Why not cuBLAS on CUDA: a library GEMM picks its kernel, and with it the blocking and split of each
output's sum, by the problem's shape, so a row of a T-row verify would not get the bits of the 1-row
plain step (measured on CPU with MKL: 1129 of 1536 outputs differ between 1 and 8 rows), and greedy
speculative output would leave plain decoding at near-ties in bf16. The Triton product keeps one tile
shape (PRODUCT_ROWS rows, a BLOCK_K fixed by dtype) and never splits K, so each output's sum has one
order; it reads the weight once per 16 rows, as a GEMM would. Its speed against cuBLAS awaits a GPU.

Every body gives a row the same bits whatever the number of rows in the call, and the two CPU bodies
give the same bits as each other (same_order): what makes a T-node verify compute each row as the
plain step does (tests/test_row_invariance.py).
"""
from __future__ import annotations

import contextlib

import torch
import torch._inductor.inductor_prims  # noqa: F401 -- registers prims.inductor_force_stride_order
from torch import Tensor

from .cpu_kernels import load_cpu_kernel
from .triton_support import launch, require_triton, rowwise_dot, tl, traced, triton

# Whole step graphs of SmolLM2 on the AVX-512 EPYC, 2026-12-04 (BENCHMARKS.md "Cost curve of the step
# graphs, 2026-12-04"): the C++ product won at 1 row (plain step 12.9 ms, 16.2 with the reduction) and
# at 8 rows (17.3 against 29.3), the reduction at 2-4 rows (measured then at those row counts only).
# int8 weights take the C++ product at every row count: it wins from 4 rows (8 rows: 6.6 against 10.2
# ms for the products alone, "Decode-step products alone"), is within 10% at 1-2, and one product
# keeps plain and step graphs computing each row alike.
#
# Which float32 rows are "many" depends on the weight's width, not on the row count alone: Inductor's
# reduction reads every input row from L1 once per weight row, and it streams the weight at the
# memory's speed only while those rows stay there beside it. On a Zen 4 EPYC (32 KB L1d, 2026-12-06;
# products alone, all of SmolLM2's weights of one width, interleaved with the C++ product, whose tiles
# load each input vector once per 4 weight rows): 576 inputs, 6 rows (13.5 KB) 8.5 ms against 9.4, 7
# rows (15.8 KB) 11.8 against 10.3; 1536 inputs, 2 rows (12 KB) 3.6 against 3.9, 3 rows (18 KB) 5.0
# against 4.0 in one run and 4.9 against 5.1 in another (examples/bench_products.py --by-width: 3.7
# against 4.6; at 1536 inputs the two are within the machine's spread from 3 rows, and the 576-wide
# weights, 80% of the bytes, set the budget). Whole step graphs of the chain:8 family moved with it
# (examples/time_family.py, 5 rounds, against the same family under the rule of 5+ rows at every
# width): 5 nodes 26.0 -> 20.7 ms, 6 nodes 26.7 -> 22.5, the rest within 0.6 ms (BENCHMARKS.md
# "Products by weight width, 2026-12-06").
REDUCTION_ROWS_BYTES = 14 << 10
# Without AVX-512, float32 takes the reduction. On an AVX2 EPYC (2026-12-05) the portable loop lost to
# it at every row count (products alone, 1 row: 27.5 against 15.5 ms; 8 rows: 63.2 against 28.6); the
# AVX2 tiles that replaced it tie with it in whole step graphs (examples/time_family.py, two runs of
# the chain:8 family each way: within +-8% at every node count, neither side ahead in both runs), so
# nothing is gained by the call out of the graph. int8 keeps the C++ product there (products alone:
# 8.6 against 66.1 ms at 1 row, "Decode-step products alone 2"). None: read the CPU.
FLOAT32_KERNEL: bool | None = None
# For a target large enough to tell them apart the float32 products are measured, not ruled:
# `specc compile` lowers the plain graph (one row) and the whole tree's step graph (many rows) both
# ways, times each pair and keeps the faster (specc/products.py). On a Zen 4 EPYC (2026-12-06) the
# C++ product that won at one row on an earlier AVX-512 EPYC lost there: plain 23.4 ms, slower than
# the reduction's 2-node step (20.8 ms).
# None: the rule above (float32_kernel()); True / False: what kernel_choice() set while lowering.
ONE_ROW_KERNEL: bool | None = None
MANY_ROWS_KERNEL: bool | None = None


@contextlib.contextmanager
def kernel_choice(one_row: bool | None = None, many_rows: bool | None = None):
    """Lower graphs under these choices for float32 products of one row and of many rows (many_rows;
    True: the C++ product, False: the reduction, None: the rule)."""
    global ONE_ROW_KERNEL, MANY_ROWS_KERNEL
    saved, (ONE_ROW_KERNEL, MANY_ROWS_KERNEL) = (ONE_ROW_KERNEL, MANY_ROWS_KERNEL), (one_row, many_rows)
    try:
        yield
    finally:
        ONE_ROW_KERNEL, MANY_ROWS_KERNEL = saved


def choice_key() -> str:
    """What decides rows_linear's body besides its source: part of the compile cache's key."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    # the vector Inductor compiles for: the order of its sums, and of the C++ product's (same_order)
    return (f"float32_kernel={float32_kernel()},one_row={ONE_ROW_KERNEL},many_rows={MANY_ROWS_KERNEL},"
            f"reduction_rows_bytes={REDUCTION_ROWS_BYTES},isa={pick_vec_isa()}")


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


def rows_linear_each(x: Tensor, w: Tensor) -> Tensor:
    """x @ w.T one row at a time, each through the very call a one-row product makes: what an eager
    graph runs where the C++ product does not apply. A library GEMM picks its kernel and its blocking
    of the sums by the number of rows (measured on CPU float32: a row of an 8-row product differs from
    the 1-row product in 1129 of 1536 outputs), so a T-row verify would not give a row the bits of the
    plain step; row by row it does, at the cost of reading the weight once per row."""
    shape, K = list(x.shape[:-1]), x.shape[-1]
    w = w if w.dtype == x.dtype else w.to(x.dtype)
    rows = x.reshape(-1, K)
    return torch.cat([torch.nn.functional.linear(rows[r: r + 1], w) for r in range(rows.shape[0])]).view(
        shape + [w.shape[0]])


if triton is not None:
    @triton.jit
    def _rows_linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, sx_m, sw_n, so_m, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                            INTERPRETED: tl.constexpr):
        """A [BLOCK_M, BLOCK_N] tile of x @ w.T: the blocks of K one after the other, each one tl.dot
        accumulating into the tile (the tensor cores for 16-bit inputs, IEEE fp32 products for float32).
        Every program has the same tile shapes whatever M is, and a row's outputs depend only on that
        row and the weight, so a row gets the same bits at any row count; the weight tile is read once
        for all the rows of a block."""
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        r_ok = rows < M
        n_ok = cols < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(x_ptr + rows[:, None] * sx_m + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + cols[:, None] * sw_n + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            w = w.to(x.dtype)  # int8 codes are exact in every float type
            if INTERPRETED:  # Triton's interpreter on CPU tensors (see rows_linear_triton)
                acc += rowwise_dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
            else:
                acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        tl.store(out_ptr + rows[:, None] * so_m + cols[None, :], acc, mask=r_ok[:, None] & n_ok[None, :])


# Rows per program, the same at every row count (the tile shape decides the MMA instruction and with
# it each output's order of sums: a block sized by the row count would switch between instruction
# shapes). 16 is the tensor cores' smallest M; a decode step has few rows.
PRODUCT_ROWS = 16


def product_blocks(N: int, K: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of the product: neither depends on the row count. A decode step's product is
    a read of the weight, so BLOCK_N is small enough that even a 576-wide output spreads over dozens
    of programs; float32 (no tensor cores: each product an FMA) takes a shorter K block to keep its
    tiles in registers."""
    block_n = 32 if N >= 2048 else 16
    return block_n, 64 if dtype == torch.float32 else 128


def rows_linear_triton(x: Tensor, w: Tensor) -> Tensor:
    """x @ w.T on CUDA (or on CPU tensors under TRITON_INTERPRET=1), each row with a fixed order of its
    sums (_rows_linear_kernel): the products of a decode step without a library GEMM, whose kernel and
    split of the sums change with the number of rows. Summed in float32, rounded once to x's dtype.
    Not yet run on a GPU."""
    require_triton("rows_linear_triton")
    shape, K, N = list(x.shape[:-1]), x.shape[-1], w.shape[0]
    rows = x.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    wc = w if w.stride(-1) == 1 else w.contiguous()
    out = torch.empty((rows.shape[0], N), dtype=torch.float32, device=x.device)
    # CPU tensors run under Triton's interpreter, whose tl.dot multiplies bf16 bit patterns and sums a
    # row by its place in the tile: there the products are fp32 (exact for 16-bit inputs) and summed
    # per output (triton_support.rowwise_dot).
    interpreted = x.device.type == "cpu"
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    block_n, block_k = product_blocks(N, K, x.dtype)
    launch(_rows_linear_kernel, (triton.cdiv(N, block_n), triton.cdiv(rows.shape[0], PRODUCT_ROWS)),
           rows, wc, out, rows.shape[0], N, K, rows.stride(0), wc.stride(0), out.stride(0), BLOCK_M=PRODUCT_ROWS,
           BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, INTERPRETED=interpreted)
    return out.to(x.dtype).view(shape + [N])


@torch.library.triton_op("specc::rows_linear", mutates_args=())
def rows_linear(x: Tensor, w: Tensor) -> Tensor:
    """x @ w.T, for the few rows of a decode step, each row's bits independent of the number of rows.
    A `triton_op`: export keeps it as one node and Inductor traces into this body, which picks the
    C++ product on CPU float32, at the row counts where it was measured faster, when it builds and
    sums in Inductor's order (same_order), else the reduction. Run eagerly (an eager engine's graph), it
    takes the C++ product for float32 on CPU where that builds, else rows_linear_each. On CUDA, the
    Triton kernel (rows_linear_triton) in both."""
    K = x.shape[-1]
    if x.device.type == "cuda" and triton is not None:
        return rows_linear_triton(x, w)
    if not traced(x):
        if x.device.type == "cpu" and x.dtype == torch.float32 and load_cpu_kernel():
            return torch.ops.specc_cpu.dense_matvec(x, w)
        return rows_linear_each(x, w)
    if x.device.type == "cpu" and x.dtype == torch.float32 and kernel_rows(x.numel() // K, K, w.dtype) \
            and load_cpu_kernel() and (w.dtype == torch.int8 or same_order()):
        return torch.ops.specc_cpu.dense_matvec(x, w)
    return rows_linear_reference(x, w)


def same_order() -> bool:
    """Whether the C++ product sums each output in the order of Inductor's reduction here: its
    vector has as many float lanes as the one Inductor compiles for on this CPU (dense_cpu.cpp). A
    graph family then gives each row the same bits whichever of the two computes it, at every row
    count; where the widths differ (a build for another instruction set, or the portable loop), a
    float32 weight keeps the reduction at every row count. int8 weights take the C++ product at
    every row count, so they need no such check."""
    if "same_order" not in _ORDER:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        isa = pick_vec_isa()
        lanes = isa.nelements(torch.float32) if isa else 1
        _ORDER["same_order"] = load_cpu_kernel() and torch.ops.specc_cpu.dense_lanes() == lanes
    return _ORDER["same_order"]


_ORDER: dict[str, bool] = {}


def many_rows(rows: int, inputs: int) -> bool:
    """Whether `rows` float32 input rows of `inputs` values each are more than the reduction holds in
    cache (REDUCTION_ROWS_BYTES): from there the C++ product, where it is used, computes them."""
    return rows > 1 and rows * inputs * 4 > REDUCTION_ROWS_BYTES


def kernel_rows(rows: int, inputs: int, dtype: torch.dtype) -> bool:
    """Whether the C++ product computes `rows` rows of `inputs` values over a weight of `dtype` (where it
    was measured faster)."""
    if dtype == torch.int8:
        return True
    if dtype != torch.float32 or not (rows == 1 or many_rows(rows, inputs)):
        return False
    chosen = ONE_ROW_KERNEL if rows == 1 else MANY_ROWS_KERNEL
    return float32_kernel() if chosen is None else chosen
