"""`specc::tree_attention`: the attention of capture.Block over its static KV cache.

Shapes (batch 1). The query group of grouped-query attention is folded into the query length, so
every row of one kv head reads the same K/V and nothing is repeated:

    q        [1, KV, M, D]   M = G * T rows per kv head (row g*T + t is head kv*G + g, token t)
    k_cache  [1, KV, S, D]
    v_cache  [1, KV, S, D]
    mask     additive float mask broadcastable to [1, 1, M, S] (0 = visible, large negative = not)
    kv_len   optional 0-d integer tensor: the mask hides every key at or past it
    out      [1, KV, M, D]   softmax(q k^T * scale + mask) v, contiguous

The reference is exactly the `F.scaled_dot_product_attention` call Block.forward makes, so a graph
whose SDPA nodes were replaced by this op computes the same values on CPU.

The Triton kernel splits the work flash-decoding style: one program per (kv head, block of query
rows, split of the key range), so that a decode step's few rows still spread over many programs.
Each program walks its split in blocks of columns with an online softmax (running row maximum and
row sum, fp32) and writes its partial maximum, sum and unnormalised output; a second kernel then
rescales each row's splits to its global maximum and normalises (combine_splits is its reference).
Row blocks have a fixed size (ROW_BLOCK) and the splits follow the cache length alone, so a row's
arithmetic does not depend on how many rows share the call. Given `kv_len` (the tree_attention pass
passes 1 + the last slot the step writes, i.e. base_len + T), no program reads a key at or past
it: a split that starts there stores an empty partial at once, so the work follows the context
length, not the static cache length. D is padded up to a power of two (at least 16, what tl.dot
needs) with masked loads, so any head size works. fp32 inputs use IEEE fp32 products (no TF32,
which would change the logits); bf16/fp16 inputs use the tensor cores with fp32 accumulation, the
probabilities being rounded to the input type before the product with V, as flash-attention
kernels do.

Fully masked rows: with this project's masks (NEG_INF = -1e9, never -inf) every row stays finite
and SDPA's value is reproduced. A row whose mask is -inf everywhere gives NaN here (0/0), where
SDPA may give NaN or 0 depending on its backend; the tree masks never produce one.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .cpu_kernels import load_cpu_kernel
from .triton_support import launch, next_pow2, require_triton, rowwise_dot, tl, traced, triton


def _check(q: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor) -> None:
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"tree_attention: q must be [1, KV, M, D], got {tuple(q.shape)}")
    if tuple(k_cache.shape) != tuple(v_cache.shape) or k_cache.dim() != 4 or k_cache.shape[0] != 1:
        raise ValueError(f"tree_attention: k_cache and v_cache must both be [1, KV, S, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.shape[1] != q.shape[1] or k_cache.shape[3] != q.shape[3]:
        raise ValueError(f"tree_attention: q {tuple(q.shape)} and the cache {tuple(k_cache.shape)} disagree on "
                         f"kv heads or head size (fold the query group into the rows first)")
    M, S = q.shape[2], k_cache.shape[2]
    if not mask.is_floating_point():
        raise ValueError(f"tree_attention: the mask must be an additive float mask, got {mask.dtype}")
    if mask.dim() != 4 or tuple(mask.shape[:2]) != (1, 1) or mask.shape[2] not in (1, M) or mask.shape[3] not in (1, S):
        raise ValueError(f"tree_attention: the mask {tuple(mask.shape)} does not broadcast to [1, 1, {M}, {S}]")


def tree_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor, scale: float) -> Tensor:
    """The SDPA call of capture.Block.forward. `.contiguous()`: the CPU flash kernel returns a
    transposed view, and the op promises the layout its fake implementation reports."""
    return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, scale=scale).contiguous()


if triton is not None:
    @triton.jit
    def _tree_attention_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, len_ptr, m_out, l_out, acc_out, scale, M, S, D, CHUNK,
                               sq_h, sq_m, sq_d, sk_h, sk_s, sk_d, sv_h, sv_s, sv_d, sm_m, sm_s,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                               SPLITS: tl.constexpr, HAS_LEN: tl.constexpr, PRECISION: tl.constexpr,
                               INTERPRETED: tl.constexpr):
        """One (kv head, block of query rows, split of the key range): the split's running maximum,
        sum and unnormalised output, fp32, into the partial buffers [KV, M, SPLITS(, BLOCK_D)]."""
        h = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        split = tl.program_id(2)
        dims = tl.arange(0, BLOCK_D)
        row_ok = rows < M
        dim_ok = dims < D
        hi = S
        if HAS_LEN:  # keys at or past kv_len are masked anyway: never read them
            hi = tl.minimum(hi, tl.load(len_ptr).to(tl.int32))
        lo = split * CHUNK
        hi = tl.minimum(hi, lo + CHUNK)
        # Padded rows and dims load zeros: their scores are finite and their outputs are never stored.
        q = tl.load(q_ptr + h * sq_h + rows[:, None] * sq_m + dims[None, :] * sq_d,
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        if INTERPRETED:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < hi
            kv_ok = col_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + h * sk_h + cols[:, None] * sk_s + dims[None, :] * sk_d, mask=kv_ok, other=0.0)
            if INTERPRETED:
                s = rowwise_dot(q, tl.trans(k.to(tl.float32))) * scale
            else:
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            bias = tl.load(mask_ptr + rows[:, None] * sm_m + cols[None, :] * sm_s,
                           mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            # Columns past the range take no weight at all (not merely a large negative one).
            s = tl.where(col_ok[None, :], s + bias.to(tl.float32), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # While a row has seen only -inf, subtract 0 instead of -inf so exp gives 0, not NaN.
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_sub)
            p = tl.exp(s - m_sub[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + h * sv_h + cols[:, None] * sv_s + dims[None, :] * sv_d, mask=kv_ok, other=0.0)
            p_in = p.to(v.dtype)  # rounded to the input type, as the tensor-core product takes it
            if INTERPRETED:
                acc = acc * alpha[:, None] + rowwise_dot(p_in.to(tl.float32), v.to(tl.float32))
            else:
                acc = acc * alpha[:, None] + tl.dot(p_in, v, input_precision=PRECISION)
            m_i = m_new
        at = (h * M + rows) * SPLITS + split
        tl.store(m_out + at, m_i, mask=row_ok)
        tl.store(l_out + at, l_i, mask=row_ok)
        tl.store(acc_out + at[:, None] * BLOCK_D + dims[None, :], acc, mask=row_ok[:, None])


if triton is not None:
    @triton.jit
    def _combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                        BLOCK_D: tl.constexpr):
        """One query row: its splits' partial softmaxes rescaled to the row's maximum and summed (combine_splits),
        as one program whose shapes are the same for every row of every call, so a row's sums run in
        one order whatever the number of rows (a compiled torch reduction over the splits would pick
        its blocking by the number of rows)."""
        row = tl.program_id(0)
        splits = tl.arange(0, BLOCK_S)
        ok = splits < SPLITS
        m = tl.load(m_ptr + row * SPLITS + splits, mask=ok, other=float("-inf"))
        l = tl.load(l_ptr + row * SPLITS + splits, mask=ok, other=0.0)
        top = tl.max(m, 0)
        w = tl.where(ok & (m > float("-inf")), tl.exp(m - tl.where(top == float("-inf"), 0.0, top)), 0.0)
        dims = tl.arange(0, BLOCK_D)
        acc = tl.load(acc_ptr + (row * SPLITS + splits[:, None]) * BLOCK_D + dims[None, :], mask=ok[:, None], other=0.0)
        tl.store(out_ptr + row * BLOCK_D + dims, tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0))


def combine_splits(m: Tensor, l: Tensor, acc: Tensor) -> Tensor:
    """The splits' partial softmaxes [.., SPLITS], [.., SPLITS], [.., SPLITS, D] -> the attention output
    [.., D], fp32: each split rescaled to the global row maximum (an empty split, m = -inf, weighs 0)."""
    top = m.amax(-1, keepdim=True)
    w = torch.exp(m - torch.where(top == float("-inf"), 0.0, top))
    return (acc * w.unsqueeze(-1)).sum(-2) / (l * w).sum(-1, keepdim=True)


def split_size(S: int, block_n: int) -> int:
    """Keys per split: at least two blocks per program, and at most 32 splits, so that even one kv
    head with one block of rows spreads over many programs (a decode step has few rows)."""
    return max(2 * block_n, next_pow2(triton.cdiv(S, 32)))


# Query rows per program, the same for every call: a row's products (tl.dot) and sums then take one
# instruction shape and one order whatever the number of rows, so a T-node verify gives each row of a
# chain the bits the 1-row plain step gives (a row block sized by the row count would switch between
# mma.sync and wgmma shapes). Not yet measured on a GPU: a prefill chunk's many rows may run slower
# than with 64-row blocks.
ROW_BLOCK = 16


def attention_config(dtype: torch.dtype) -> dict:
    """Keys per block, warps and pipeline stages of the attention kernel, by input type (never by row
    count). From the sm_90a build (kernels/hopper_build.py, BENCHMARKS.md "sm_90a build"), not yet from
    a GPU: 16-bit inputs, 64 keys per block on the tensor cores, 2 stages: 78-96 registers and 20-39 KB
    of shared memory, 5-6 blocks per SM at head_dim 64-128 (3 stages held 3 blocks at head_dim 128).
    float32 (IEEE products on the FMA units, twice the bytes per key): 32 keys per block over 8 warps,
    2 stages: 62-66 registers, 25-45 KB, 3-4 blocks per SM; 64 keys over 4 warps with 3 stages took
    151 KB of shared memory at head_dim 128 (1 block per SM), and 32-64-row blocks spilled."""
    if dtype == torch.float32:
        return dict(block_n=32, num_warps=8, num_stages=2)
    return dict(block_n=64, num_warps=4, num_stages=2)


def tree_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor, scale: float,
                          kv_len: Tensor | None = None, block_m: int = ROW_BLOCK, block_n: int | None = None) -> Tensor:
    """Launch the Triton kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1), then
    combine its splits (_combine_kernel). `kv_len` (0-d integer tensor, on the device): read only keys
    below it. The key splits depend on the cache length alone, and every program has the same shapes,
    so each row is computed alike at any row count."""
    require_triton("tree_attention_triton")
    _check(q, k_cache, v_cache, mask)
    _, KV, M, D = q.shape
    S = k_cache.shape[2]
    if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise ValueError(f"tree_attention: q, k_cache and v_cache must share a dtype, got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    mask = mask.expand(1, 1, M, S)  # broadcast dims get stride 0: no copy
    if M == 0:
        return torch.empty((1, KV, M, D), dtype=q.dtype, device=q.device)
    config = attention_config(q.dtype)
    block_n = block_n or config["block_n"]
    block_d = max(16, next_pow2(D))  # tl.dot needs every block dimension >= 16
    chunk = split_size(S, block_n)
    splits = triton.cdiv(S, chunk)
    part_m = torch.empty((KV, M, splits), dtype=torch.float32, device=q.device)
    part_l = torch.empty((KV, M, splits), dtype=torch.float32, device=q.device)
    part_acc = torch.empty((KV, M, splits, block_d), dtype=torch.float32, device=q.device)
    # Triton's interpreter (TRITON_INTERPRET=1, the only way to run on CPU tensors) holds bf16 as
    # uint16 bit patterns and its tl.dot multiplies the bits (triton-lang/triton#11584), and its
    # matmul may sum a row by the row's place in the tile. There the operands go to fp32 first
    # (products of 16-bit values are exact in fp32: the GPU's 16-bit product with fp32 accumulation,
    # up to the order of the sums) and each output is summed on its own (triton_support.rowwise_dot).
    interpreted = q.device.type == "cpu"
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    grid = (KV, triton.cdiv(M, block_m), splits)
    launch(_tree_attention_kernel, grid,
        q, k_cache, v_cache, mask, kv_len if kv_len is not None else part_m, part_m, part_l, part_acc,
        float(scale), M, S, D, chunk,
        q.stride(1), q.stride(2), q.stride(3), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(1), v_cache.stride(2), v_cache.stride(3), mask.stride(2), mask.stride(3),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, SPLITS=splits, HAS_LEN=kv_len is not None,
        PRECISION=precision, INTERPRETED=interpreted, num_warps=config["num_warps"], num_stages=config["num_stages"])
    out = torch.empty((KV, M, block_d), dtype=torch.float32, device=q.device)
    launch(_combine_kernel, (KV * M,), part_m, part_l, part_acc, out, SPLITS=splits, BLOCK_S=max(2, next_pow2(splits)),
           BLOCK_D=block_d)
    return out[..., :D].to(q.dtype).unsqueeze(0).contiguous()


@torch.library.triton_op("specc::tree_attention", mutates_args=())
def tree_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor, scale: float,
                   kv_len: Optional[Tensor] = None) -> Tensor:
    """Attention of the folded query rows over the static cache (see the module docstring).

    `kv_len` (optional, 0-d integer tensor): the mask hides every key at or past it, so the kernel
    reads none of them; the reference, which relies on the mask alone, ignores it.

    A `triton_op`: Inductor and AOTInductor trace into this body instead of calling the op through
    Python. On CUDA they embed the Triton kernel in the compiled graph; on CPU the graph calls the C++
    kernel of rows_kernel() where it builds (reading keys below kv_len only), else it compiles the
    SDPA reference natively."""
    if traced(q):  # shapes are checked once when a graph is traced; eagerly this runs per layer per step
        _check(q, k_cache, v_cache, mask)
    if q.device.type == "cuda" and triton is not None:
        return tree_attention_triton(q, k_cache, v_cache, mask, scale, kv_len)
    if rows_kernel(q, mask):
        return torch.ops.specc_cpu.rows_attention(q, k_cache, v_cache, mask, scale, kv_len)
    return tree_attention_reference(q, k_cache, v_cache, mask, scale)


def rows_kernel(q: Tensor, mask: Tensor) -> bool:
    """Whether the op runs the C++ kernel specc_cpu::rows_attention (attention_cpu.cpp): on CPU, for
    float32, bf16 and fp16 with a mask of the query's dtype, where it builds. Each row is summed over the
    keys in slot order, so a tree node's row gets the bits the plain step gets for the same token at the
    same position, whatever the number of rows and wherever the tree's masked slots sit (SDPA's sums
    follow vector lanes and GEMM blocks by key position and row count)."""
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and mask.dtype == q.dtype and load_cpu_kernel())
