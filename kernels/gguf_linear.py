"""`specc::gguf_linear`: a linear layer whose weight stays in a GGUF file's block quantization.

A GGUF weight [N, K] is stored row by row in blocks of 32 values along K. Each block holds a float16
scale d (and for Q4_1 a float16 minimum m) and 32 codes:

    Q8_0  q int8,  w = d * q                    34 bytes per 32 weights
    Q4_0  q 0..15, w = d * (q - 8)              18 bytes
    Q4_1  q 0..15, w = d * q + m                20 bytes

In a 4-bit block the low nibbles of its 16 code bytes are values 0..15 and the high nibbles values
16..31. Here a weight is three tensors: `qs` [N, nb, 32] int8 (Q8_0) or [N, nb, 16] uint8 (4-bit),
`d` and `m` [N, nb] float16 (m is empty for the formats without one).

The reference computes each weight exactly as gguf-py dequantises it (float32 d * q (+ m)), the
values transformers loads a GGUF model with, so a `--quant gguf` engine computes the float model
that a plain load of the same file gives, up to the order of the float sums. For a few rows it is a
reduction over (block, value) whose loads are all affine in the two loop indices: Inductor compiles
it for CPU into one vectorised loop that reads the packed codes and converts them in registers (one
16-lane vector is one half-block), for every row at once; that loop converts each code on its own
and is compute-bound, so on CPU the op runs gguf_cpu.cpp's product instead where it builds (same
weights, ~2x faster). For more rows (prefill chunks) it dequantises the weight and calls the GEMM. The Triton kernel (CUDA; CPU tests under
TRITON_INTERPRET=1) has one program per (row, block of outputs) and walks the blocks of K.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .cpu_kernels import load_cpu_kernel
from .triton_support import launch, require_triton, tl, triton

FORMATS = ("Q8_0", "Q4_0", "Q4_1")
BLOCK = 32
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
MAX_ROWS = 16  # as passes/matvec.py: more rows than this dequantise once and use the GEMM


def split_blocks(raw: Tensor, fmt: str) -> tuple[Tensor, Tensor, Tensor]:
    """A GGUF tensor's bytes [N, nb * block bytes] (uint8, as gguf-py reads them) -> (qs, d, m)."""
    if fmt not in FORMATS:
        raise ValueError(f"gguf_linear: unsupported block format {fmt}")
    N = raw.shape[0]
    blocks = raw.reshape(N, -1, BLOCK_BYTES[fmt])
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    if fmt == "Q4_1":
        m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
        qs = blocks[..., 4:].contiguous()
    elif fmt == "Q4_0":
        m, qs = torch.empty(0, dtype=torch.float16), blocks[..., 2:].contiguous()
    else:
        m, qs = torch.empty(0, dtype=torch.float16), blocks[..., 2:].contiguous().view(torch.int8)
    return qs, d.contiguous(), m.contiguous()


def _codes(qs: Tensor, fmt: str) -> tuple[Tensor, ...]:
    """The float codes of each block's value groups: (all 32) for Q8_0, (low 16, high 16) for 4-bit."""
    if fmt == "Q8_0":
        return (qs.to(torch.float32),)
    lo, hi = (qs & 15).to(torch.float32), (qs >> 4).to(torch.float32)
    return (lo - 8, hi - 8) if fmt == "Q4_0" else (lo, hi)


def _weights(qs: Tensor, d: Tensor, m: Tensor, fmt: str) -> tuple[Tensor, ...]:
    """Each value group's weights [N, nb, 16 or 32], as gguf-py computes them (float32)."""
    d32 = d.to(torch.float32)[..., None]
    if fmt == "Q4_1":
        m32 = m.to(torch.float32)[..., None]
        return tuple(d32 * c + m32 for c in _codes(qs, fmt))
    return tuple(c * d32 if fmt == "Q8_0" else d32 * c for c in _codes(qs, fmt))


def dequantize(qs: Tensor, d: Tensor, m: Tensor, fmt: str) -> Tensor:
    """The float32 weight [N, K]."""
    groups = _weights(qs, d, m, fmt)
    return torch.cat(groups, dim=-1).reshape(qs.shape[0], -1)


def gguf_linear_reference(x: Tensor, qs: Tensor, d: Tensor, m: Tensor, fmt: str) -> Tensor:
    """x [..., K] float32 -> x @ W^T [..., N] float32."""
    shape, K = x.shape[:-1], x.shape[-1]
    N, nb = qs.shape[0], qs.shape[1]
    rows = x.reshape(-1, K)
    if rows.shape[0] > MAX_ROWS:
        return F.linear(rows, dequantize(qs, d, m, fmt)).reshape(*shape, N)
    groups = _weights(qs, d, m, fmt)
    width = BLOCK // len(groups)
    xb = rows.reshape(rows.shape[0], nb, len(groups), width)  # x's values of each block, by value group
    out = []
    for r in range(rows.shape[0]):
        # one reduction per row and group over (block, value), all over the same codes: Inductor fuses
        # them into one loop that reads the weight once
        parts = [(w * xb[r, :, g]).sum((-2, -1)) for g, w in enumerate(groups)]
        out.append(parts[0] if len(parts) == 1 else parts[0] + parts[1])
    return torch.stack(out).reshape(*shape, N)


if triton is not None:
    @triton.jit
    def _gguf_linear_kernel(x_ptr, qs_ptr, d_ptr, m_ptr, out_ptr, N, K, NB, FMT: tl.constexpr,
                            BLOCK_N: tl.constexpr):
        row = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        j16 = tl.arange(0, 16)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for b in range(0, NB):
            d = tl.load(d_ptr + offs_n * NB + b, mask=n_ok, other=0.0).to(tl.float32)
            x_lo = tl.load(x_ptr + row * K + b * 32 + j16).to(tl.float32)
            x_hi = tl.load(x_ptr + row * K + b * 32 + 16 + j16).to(tl.float32)
            if FMT == 0:  # Q8_0: 32 int8 codes per block
                base = qs_ptr + (offs_n[:, None] * NB + b) * 32 + j16[None, :]
                c_lo = tl.load(base, mask=n_ok[:, None], other=0).to(tl.float32)
                c_hi = tl.load(base + 16, mask=n_ok[:, None], other=0).to(tl.float32)
                w_lo, w_hi = c_lo * d[:, None], c_hi * d[:, None]
            else:
                byte = tl.load(qs_ptr + (offs_n[:, None] * NB + b) * 16 + j16[None, :], mask=n_ok[:, None],
                               other=0).to(tl.int32)
                c_lo, c_hi = (byte & 15).to(tl.float32), (byte >> 4).to(tl.float32)
                if FMT == 1:  # Q4_0
                    w_lo, w_hi = d[:, None] * (c_lo - 8.0), d[:, None] * (c_hi - 8.0)
                else:  # Q4_1
                    mm = tl.load(m_ptr + offs_n * NB + b, mask=n_ok, other=0.0).to(tl.float32)
                    w_lo, w_hi = d[:, None] * c_lo + mm[:, None], d[:, None] * c_hi + mm[:, None]
            acc += tl.sum(w_lo * x_lo[None, :], axis=1) + tl.sum(w_hi * x_hi[None, :], axis=1)
        tl.store(out_ptr + row * N + offs_n, acc, mask=n_ok)


def gguf_linear_triton(x: Tensor, qs: Tensor, d: Tensor, m: Tensor, fmt: str, block_n: int = 64) -> Tensor:
    """Launch the Triton kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    require_triton("gguf_linear_triton")
    shape, K = x.shape[:-1], x.shape[-1]
    N, nb = qs.shape[0], qs.shape[1]
    rows = x.reshape(-1, K).to(torch.float32).contiguous()
    out = torch.empty(rows.shape[0], N, dtype=torch.float32, device=x.device)
    grid = (rows.shape[0], triton.cdiv(N, block_n))
    launch(_gguf_linear_kernel, grid, rows, qs.contiguous(), d.contiguous(), m.contiguous(), out, N, K, nb,
           FMT=FORMATS.index(fmt), BLOCK_N=block_n)
    return out.reshape(*shape, N)


@torch.library.triton_op("specc::gguf_linear", mutates_args=())
def gguf_linear(x: Tensor, qs: Tensor, d: Tensor, m: Tensor, fmt: str) -> Tensor:
    """x @ W^T for a GGUF block-quantized W (qs, d, m; see the module docstring). A `triton_op`:
    export keeps it as one node; Inductor traces into this body (the Triton kernel on CUDA; on CPU the
    hand-written product of gguf_cpu.cpp for a few rows where it builds, else the reference compiled
    natively)."""
    few = x.reshape(-1, x.shape[-1]).shape[0] <= MAX_ROWS
    if x.device.type == "cuda" and triton is not None and few:
        return gguf_linear_triton(x, qs, d, m, fmt)
    if x.device.type == "cpu" and x.dtype == torch.float32 and few and load_cpu_kernel():
        return torch.ops.specc_cpu.gguf_matvec(x, qs, d, m, FORMATS.index(fmt))
    return gguf_linear_reference(x, qs, d, m, fmt)
