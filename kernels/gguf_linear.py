"""`specc::gguf_linear`: a linear layer whose weight stays in a GGUF file's block quantization.

A GGUF weight [N, K] is stored row by row in blocks along K. The basic formats have blocks of 32
values, each with a float16 scale d (and for Q4_1 a float16 minimum m) and 32 codes:

    Q8_0  q int8,  w = d * q                    34 bytes per 32 weights
    Q4_0  q 0..15, w = d * (q - 8)              18 bytes
    Q4_1  q 0..15, w = d * q + m                20 bytes
    Q5_0  q 0..31, w = d * (q - 16)             22 bytes
    Q5_1  q 0..31, w = d * q + m                24 bytes

In a 4-bit block the low nibbles of its 16 code bytes are values 0..15 and the high nibbles values
16..31; a 5-bit block adds a 32-bit word qh whose bit j is value j's fifth bit. Here such a weight is
three tensors: `qs` [N, nb, 32] int8 (Q8_0), [N, nb, 16] uint8 (4-bit) or [N, nb, 20] uint8 (5-bit:
qh's 4 bytes, then the 16 code bytes, as the file has them), `d` and `m` [N, nb] float16 (m is empty
for the formats without one). Q5_0 / Q5_1 are also what llama.cpp writes into a Q4_K_M / Q5_K_M
file for the tensors whose rows are not whole 256-value super-blocks (SmolLM2's 576-wide ones).

The K-quants (what Q4_K_M / Q5_K_M / Q6_K files hold) have super-blocks of 256 values, whose
sub-blocks carry small integer scales relative to the super-block's float16 ones:

    Q4_K  8 sub-blocks of 32, a 6-bit scale sc and min mn each, q 0..15:
          w = (d * sc) * q - dmin * mn                                      144 bytes per 256 weights
          bytes: d, dmin (float16), 12 bytes of packed scales and mins, 128 bytes of codes (byte l
          of the i-th 32 bytes: value l of sub-block 2i in its low nibble, of 2i + 1 in its high one)
    Q5_K  as Q4_K with q 0..31: d, dmin, the 12 scale bytes, 32 bytes qh (bit j of byte l: the high
          bit of value l of sub-block j), then Q4_K's 128 bytes of low 4 bits  176 bytes
    Q6_K  16 sub-blocks of 16, an int8 scale sc each, q -32..31: w = (d * sc) * q
          bytes: 128 bytes of low 4 bits, 64 bytes of high 2 bits, the 16 scales, d   210 bytes

A K-quant weight is its super-blocks' bytes as the file has them, `qs` [N, n_super, 144 / 176 / 210]
uint8, with `d` and `m` empty: each kernel decodes a super-block's scales itself, as llama.cpp's
do. Unpacking them once at load would save each kernel a few integer operations per 32 weights, but
a decode step's time is the weight bytes, and unpacked scales take bytes (float32 sub-block scales
and mins: 192 bytes per Q4_K super-block instead of 144, or 148 as integers beside the float16
pair); kept as they are, the engine reads what llama.cpp reads, and its copy of the blocks is the
file's.

The reference computes each weight exactly as gguf-py dequantises it (float32 d * q (+ m); for the
K-quants d * sc, then times q, minus dmin * mn), the values transformers loads a GGUF model with,
so a `--quant gguf` engine computes the float model that a plain load of the same file gives, up to
the order of the float sums. In the K-quants d * sc and dmin * mn are exact in float32 (an 11-bit
float16 significand times an integer of at most 8 bits), and so is (d * sc) * q (at most 23 bits):
a Q6_K weight is exact, a Q4_K / Q5_K weight has one rounding, the subtraction, so the kernels
may make it with one fused multiply-add and get the reference's bits.

For a few rows the reference is a reduction over (block, value) whose loads are all affine in the
loop indices: Inductor compiles it for CPU into one vectorised loop that reads the packed codes and
converts them in registers (for a 32-block format one 16-lane vector is one half-block), for every
row at once; that loop converts each code on its own and is compute-bound, so on CPU the op runs
the C++ products instead where they build (gguf_cpu.cpp for the 32-blocks, gguf_kquants_cpu.cpp for
the K-quants; same weights, faster). For more rows (prefill chunks) it dequantises the weight and
calls the GEMM. The Triton kernels (CUDA; CPU tests under TRITON_INTERPRET=1) have one program per
(row, block of outputs) and walk the blocks of K, a row's sums in one fixed order whatever the
other rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .cpu_kernels import load_cpu_kernel
from .triton_support import launch, require_triton, tl, triton

K_FORMATS = ("Q4_K", "Q5_K", "Q6_K")
# The index is the format's code in the C++ products (gguf_cpu.cpp: the first three; gguf_kquants_cpu.cpp).
FORMATS = ("Q8_0", "Q4_0", "Q4_1", *K_FORMATS, "Q5_0", "Q5_1")
BLOCK = 32
SUPER_BLOCK = 256
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q5_0": 22, "Q5_1": 24}
MAX_ROWS = 16  # as passes/matvec.py: more rows than this dequantise once and use the GEMM


def block_size(fmt: str) -> int:
    """Weights per block of `fmt` along K: 32, or 256 for a K-quant super-block."""
    return SUPER_BLOCK if fmt in K_FORMATS else BLOCK


def weight_shape(qs: Tensor, fmt: str) -> tuple[int, int]:
    """[N, K] of the weight whose blocks are `qs`."""
    return qs.shape[0], qs.shape[1] * block_size(fmt)


def split_blocks(raw: Tensor, fmt: str) -> tuple[Tensor, Tensor, Tensor]:
    """A GGUF tensor's bytes [N, nb * block bytes] (uint8, as gguf-py reads them) -> (qs, d, m)."""
    if fmt not in FORMATS:
        raise ValueError(f"gguf_linear: unsupported block format {fmt}")
    if raw.shape[-1] % BLOCK_BYTES[fmt]:
        raise ValueError(f"gguf_linear: {raw.shape[-1]} bytes a row are not whole {fmt} blocks")
    N = raw.shape[0]
    blocks = raw.reshape(N, -1, BLOCK_BYTES[fmt])
    none = torch.empty(0, dtype=torch.float16)
    if fmt in K_FORMATS:  # the super-blocks as they are (see the module docstring)
        return blocks.contiguous(), none, none
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    if fmt in ("Q4_1", "Q5_1"):
        m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
        qs = blocks[..., 4:].contiguous()
    elif fmt in ("Q4_0", "Q5_0"):
        m, qs = none, blocks[..., 2:].contiguous()
    else:
        m, qs = none, blocks[..., 2:].contiguous().view(torch.int8)
    return qs, d.contiguous(), m.contiguous()


def _codes(qs: Tensor, fmt: str) -> tuple[Tensor, ...]:
    """The float codes of each block's value groups: (all 32) for Q8_0, (low 16, high 16) for 4- and
    5-bit blocks."""
    if fmt == "Q8_0":
        return (qs.to(torch.float32),)
    if fmt in ("Q5_0", "Q5_1"):  # qh's bit j on top of value j's 4 bits
        qh = qs[..., :4].to(torch.int32)
        word = qh[..., 0] | (qh[..., 1] << 8) | (qh[..., 2] << 16) | (qh[..., 3] << 24)
        bits = (word[..., None] >> torch.arange(32, dtype=torch.int32)) & 1
        codes = qs[..., 4:].to(torch.int32)
        lo, hi = (codes & 15) | (bits[..., :16] << 4), (codes >> 4) | (bits[..., 16:] << 4)
        lo, hi = lo.to(torch.float32), hi.to(torch.float32)
        return (lo - 16, hi - 16) if fmt == "Q5_0" else (lo, hi)
    lo, hi = (qs & 15).to(torch.float32), (qs >> 4).to(torch.float32)
    return (lo - 8, hi - 8) if fmt == "Q4_0" else (lo, hi)


def _weights(qs: Tensor, d: Tensor, m: Tensor, fmt: str) -> tuple[Tensor, ...]:
    """Each value group's weights [N, nb, 16 or 32], as gguf-py computes them (float32)."""
    d32 = d.to(torch.float32)[..., None]
    if fmt in ("Q4_1", "Q5_1"):
        m32 = m.to(torch.float32)[..., None]
        return tuple(d32 * c + m32 for c in _codes(qs, fmt))
    return tuple(c * d32 if fmt == "Q8_0" else d32 * c for c in _codes(qs, fmt))


def _half(blocks: Tensor, at: int) -> Tensor:
    """The float16 at byte `at` of each super-block [..., bytes], as float32 [..., 1]."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16).to(torch.float32)


def _scales_mins(packed: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K / Q5_K: a super-block's 12 packed bytes [..., 12] -> its sub-blocks' 6-bit scales and mins
    [..., 8] (float32). Bytes 0-3 hold sub-blocks 0-3's scales in their low 6 bits and 4-7 their mins;
    sub-blocks 4-7 take their low 4 bits from bytes 8-11 (scale: low nibble, min: high nibble) and
    their top 2 bits from the top 2 bits of bytes 0-3 (scale) and 4-7 (min)."""
    s = packed.to(torch.int32)
    sc_lo, mn_lo, rest = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([sc_lo & 63, (rest & 15) | ((sc_lo >> 6) << 4)], dim=-1)
    mn = torch.cat([mn_lo & 63, (rest >> 4) | ((mn_lo >> 6) << 4)], dim=-1)
    return sc.to(torch.float32), mn.to(torch.float32)


def _kquant_weights(qs: Tensor, fmt: str) -> Tensor:
    """The weights of each sub-block, [N, n_super, 8, 32] (Q4_K, Q5_K) or [N, n_super, 16, 16] (Q6_K),
    float32, with gguf-py's operations in gguf-py's order."""
    N, ns = qs.shape[0], qs.shape[1]
    if fmt == "Q6_K":
        ql = qs[..., :128].reshape(N, ns, 2, 64)  # each half of 128 values: 64 bytes of low 4 bits
        low = torch.stack([ql & 15, ql >> 4], dim=3)  # [.., half, nibble, 64]: value 128 h + 64 nibble + l
        qh = qs[..., 128:192].reshape(N, ns, 2, 32)  # each half: 32 bytes of four 2-bit fields
        high = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=3)  # value 128 h + 32 field + l
        q = (low.reshape(N, ns, 256) | (high.reshape(N, ns, 256) << 4)).to(torch.int16) - 32
        scale = _half(qs, 208) * qs[..., 192:208].view(torch.int8).to(torch.float32)  # d * sc [N, ns, 16]
        return scale[..., None] * q.reshape(N, ns, 16, 16).to(torch.float32)
    d, dmin = _half(qs, 0), _half(qs, 2)
    sc, mn = _scales_mins(qs[..., 4:16])
    codes = qs[..., -128:].reshape(N, ns, 4, 32)
    q = torch.stack([codes & 15, codes >> 4], dim=3).reshape(N, ns, 8, 32)  # sub-block 2i + nibble
    if fmt == "Q5_K":
        qh = qs[..., 16:48]
        q = q | (torch.stack([(qh >> j) & 1 for j in range(8)], dim=2) << 4)  # bit j: sub-block j's
    return (d * sc)[..., None] * q.to(torch.float32) - (dmin * mn)[..., None]


def dequantize(qs: Tensor, d: Tensor, m: Tensor, fmt: str) -> Tensor:
    """The float32 weight [N, K]."""
    if fmt in K_FORMATS:
        return _kquant_weights(qs, fmt).reshape(qs.shape[0], -1)
    groups = _weights(qs, d, m, fmt)
    return torch.cat(groups, dim=-1).reshape(qs.shape[0], -1)


def gguf_linear_reference(x: Tensor, qs: Tensor, d: Tensor, m: Tensor, fmt: str) -> Tensor:
    """x [..., K] float32 -> x @ W^T [..., N] float32."""
    shape, K = x.shape[:-1], x.shape[-1]
    N, nb = qs.shape[0], qs.shape[1]
    rows = x.reshape(-1, K)
    if rows.shape[0] > MAX_ROWS:
        return F.linear(rows, dequantize(qs, d, m, fmt)).reshape(*shape, N)
    if fmt in K_FORMATS:  # one reduction per row over (super-block, sub-block, value)
        w = _kquant_weights(qs, fmt)
        xb = rows.reshape(rows.shape[0], nb, *w.shape[2:])
        return torch.stack([(w * xb[r]).sum((-3, -2, -1)) for r in range(rows.shape[0])]).reshape(*shape, N)
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
            elif FMT == 6 or FMT == 7:  # Q5_0 / Q5_1: qh's 4 bytes, then 16 code bytes
                blk = qs_ptr + (offs_n[:, None] * NB + b) * 20
                byte = tl.load(blk + 4 + j16[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
                qh = tl.load(blk + 0, mask=n_ok[:, None], other=0).to(tl.int32)
                for i in tl.static_range(1, 4):
                    qh = qh | (tl.load(blk + i, mask=n_ok[:, None], other=0).to(tl.int32) << (8 * i))
                c_lo = ((byte & 15) | (((qh >> j16[None, :]) & 1) << 4)).to(tl.float32)
                c_hi = ((byte >> 4) | (((qh >> (16 + j16[None, :])) & 1) << 4)).to(tl.float32)
                if FMT == 6:
                    w_lo, w_hi = d[:, None] * (c_lo - 16.0), d[:, None] * (c_hi - 16.0)
                else:
                    mm = tl.load(m_ptr + offs_n * NB + b, mask=n_ok, other=0.0).to(tl.float32)
                    w_lo, w_hi = d[:, None] * c_lo + mm[:, None], d[:, None] * c_hi + mm[:, None]
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

    @triton.jit
    def _half_at(ptr, mask):
        """The little-endian float16 at byte pointers `ptr`, as float32 (K-quant blocks keep theirs
        at byte offsets that a float16 pointer could not index)."""
        lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
        hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _scale_min(s_ptr, j: tl.constexpr, mask):
        """Q4_K / Q5_K: sub-block j's 6-bit scale and min (s_ptr: the 12 packed bytes), as float32."""
        if j < 4:
            sc = tl.load(s_ptr + j, mask=mask, other=0).to(tl.int32) & 63
            mn = tl.load(s_ptr + j + 4, mask=mask, other=0).to(tl.int32) & 63
        else:
            rest = tl.load(s_ptr + j + 4, mask=mask, other=0).to(tl.int32)
            sc = (rest & 15) | ((tl.load(s_ptr + j - 4, mask=mask, other=0).to(tl.int32) >> 6) << 4)
            mn = (rest >> 4) | ((tl.load(s_ptr + j, mask=mask, other=0).to(tl.int32) >> 6) << 4)
        return sc.to(tl.float32), mn.to(tl.float32)

    @triton.jit
    def _gguf_kquant_kernel(x_ptr, qs_ptr, out_ptr, N, K, NB, FMT: tl.constexpr, BYTES: tl.constexpr,
                            BLOCK_N: tl.constexpr):
        """FMT: the index in K_FORMATS (0 Q4_K, 1 Q5_K, 2 Q6_K); qs_ptr: the super-blocks [N, NB, BYTES].
        Each super-block in 8 steps of 32 values, one [BLOCK_N, 32] tile of weights a step."""
        row = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        l32 = tl.arange(0, 32)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for b in range(0, NB):
            blk = qs_ptr + (offs_n * NB + b) * BYTES  # each output's super-block b
            run = blk[:, None] + l32[None, :]  # 32 bytes from its start: offset it to a step's code bytes
            if FMT == 2:
                d = _half_at(blk + 208, n_ok)
            else:
                d = _half_at(blk, n_ok)
                dmin = _half_at(blk + 2, n_ok)
            for j in tl.static_range(8):
                x = tl.load(x_ptr + row * K + b * 256 + j * 32 + l32).to(tl.float32)
                if FMT == 2:  # Q6_K: values 32j.. of the half j // 4; sub-blocks 2j and 2j + 1
                    low = tl.load(run + (64 * (j // 4) + 32 * (j % 2)), mask=n_ok[:, None], other=0).to(tl.int32)
                    high = tl.load(run + (128 + 32 * (j // 4)), mask=n_ok[:, None], other=0).to(tl.int32)
                    q = ((low >> (4 * ((j % 4) // 2))) & 15) | (((high >> (2 * (j % 4))) & 3) << 4)
                    sc0 = tl.load(blk + (192 + 2 * j), mask=n_ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
                    sc1 = tl.load(blk + (193 + 2 * j), mask=n_ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
                    scale = tl.where(l32[None, :] < 16, (d * sc0)[:, None], (d * sc1)[:, None])
                    w = scale * (q - 32).to(tl.float32)
                else:  # Q4_K / Q5_K: sub-block j, the low or high nibbles of the (j // 2)-th 32 code bytes
                    sc, mn = _scale_min(blk + 4, j, n_ok)
                    codes = tl.load(run + (16 + 32 * FMT + 32 * (j // 2)), mask=n_ok[:, None], other=0).to(tl.int32)
                    q = (codes >> (4 * (j % 2))) & 15
                    if FMT == 1:
                        qh = tl.load(run + 16, mask=n_ok[:, None], other=0).to(tl.int32)
                        q = q | (((qh >> j) & 1) << 4)
                    w = (d * sc)[:, None] * q.to(tl.float32) - (dmin * mn)[:, None]
                acc += tl.sum(w * x[None, :], axis=1)
        tl.store(out_ptr + row * N + offs_n, acc, mask=n_ok)


def gguf_linear_triton(x: Tensor, qs: Tensor, d: Tensor, m: Tensor, fmt: str, block_n: int = 64) -> Tensor:
    """Launch the Triton kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    require_triton("gguf_linear_triton")
    shape, K = x.shape[:-1], x.shape[-1]
    N, nb = qs.shape[0], qs.shape[1]
    rows = x.reshape(-1, K).to(torch.float32).contiguous()
    out = torch.empty(rows.shape[0], N, dtype=torch.float32, device=x.device)
    grid = (rows.shape[0], triton.cdiv(N, block_n))
    if fmt in K_FORMATS:
        launch(_gguf_kquant_kernel, grid, rows, qs.contiguous(), out, N, K, nb, FMT=K_FORMATS.index(fmt),
               BYTES=BLOCK_BYTES[fmt], BLOCK_N=block_n)
    else:
        launch(_gguf_linear_kernel, grid, rows, qs.contiguous(), d.contiguous(), m.contiguous(), out, N, K, nb,
               FMT=FORMATS.index(fmt), BLOCK_N=block_n)
    return out.reshape(*shape, N)


@torch.library.triton_op("specc::gguf_linear", mutates_args=())
def gguf_linear(x: Tensor, qs: Tensor, d: Tensor, m: Tensor, fmt: str) -> Tensor:
    """x @ W^T for a GGUF block-quantized W (qs, d, m; see the module docstring). A `triton_op`:
    export keeps it as one node; Inductor traces into this body (the Triton kernels on CUDA; on CPU
    the hand-written products of gguf_cpu.cpp / gguf_kquants_cpu.cpp for a few rows where they build,
    else the reference compiled natively)."""
    few = x.reshape(-1, x.shape[-1]).shape[0] <= MAX_ROWS
    if x.device.type == "cuda" and triton is not None and few:
        return gguf_linear_triton(x, qs, d, m, fmt)
    if x.device.type == "cpu" and x.dtype == torch.float32 and few and load_cpu_kernel():
        if fmt in K_FORMATS:
            return torch.ops.specc_cpu.gguf_kquant_matvec(x, qs, FORMATS.index(fmt))
        return torch.ops.specc_cpu.gguf_matvec(x, qs, d, m, FORMATS.index(fmt))
    return gguf_linear_reference(x, qs, d, m, fmt)
