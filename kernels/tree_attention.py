"""`specc::tree_attention`: the attention of capture.Block over its static KV cache.

Shapes (batch 1). The query group of grouped-query attention is folded into the query length, so
every row of one kv head reads the same K/V and nothing is repeated:

    q        [1, KV, M, D]   M = G * T rows per kv head (row g*T + t is head kv*G + g, token t)
    k_cache  [1, KV, S, D]
    v_cache  [1, KV, S, D]
    mask     additive float mask broadcastable to [1, 1, M, S] (0 = visible, large negative = not)
    out      [1, KV, M, D]   softmax(q k^T * scale + mask) v, contiguous

The reference is exactly the `F.scaled_dot_product_attention` call Block.forward makes, so a graph
whose SDPA nodes were replaced by this op computes the same values on CPU.

The Triton kernel runs one program per (kv head, block of query rows). It walks the cache in blocks
of columns with an online softmax (running row maximum and row sum, fp32), so each K/V block is
loaded once for all query rows of its kv head. D is padded up to a power of two (at least 16, what
tl.dot needs) with masked loads, so any head size works. fp32 inputs use IEEE fp32 products (no
TF32, which would change the logits); bf16/fp16 inputs use the tensor cores with fp32 accumulation,
the probabilities being rounded to the input type before the product with V, as flash-attention
kernels do.

Fully masked rows: with this project's masks (NEG_INF = -1e9, never -inf) every row stays finite
and SDPA's value is reproduced. A row whose mask is -inf everywhere gives NaN here (0/0), where
SDPA may give NaN or 0 depending on its backend; the tree masks never produce one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .triton_support import next_pow2, require_triton, tl, traced, triton, wrap_triton


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
    def _tree_attention_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, scale, M, S, D,
                               sq_h, sq_m, sq_d, sk_h, sk_s, sk_d, sv_h, sv_s, sv_d, sm_m, sm_s,
                               so_h, so_m, so_d,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                               PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
        h = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        row_ok = rows < M
        dim_ok = dims < D
        # Padded rows and dims load zeros: their scores are finite and their outputs are never stored.
        q = tl.load(q_ptr + h * sq_h + rows[:, None] * sq_m + dims[None, :] * sq_d,
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(0, S, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < S
            kv_ok = col_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + h * sk_h + cols[:, None] * sk_s + dims[None, :] * sk_d, mask=kv_ok, other=0.0)
            if DOT_F32:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            bias = tl.load(mask_ptr + rows[:, None] * sm_m + cols[None, :] * sm_s,
                           mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            # Columns past the cache take no weight at all (not merely a large negative one).
            s = tl.where(col_ok[None, :], s + bias.to(tl.float32), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # While a row has seen only -inf, subtract 0 instead of -inf so exp gives 0, not NaN.
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_sub)
            p = tl.exp(s - m_sub[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + h * sv_h + cols[:, None] * sv_s + dims[None, :] * sv_d, mask=kv_ok, other=0.0)
            p_in = p.to(v.dtype)  # rounded to the input type, as the tensor-core product takes it
            if DOT_F32:
                p_in = p_in.to(tl.float32)
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p_in, v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + h * so_h + rows[:, None] * so_m + dims[None, :] * so_d,
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def tree_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor, scale: float,
                          block_m: int | None = None, block_n: int = 64) -> Tensor:
    """Launch the Triton kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    require_triton("tree_attention_triton")
    _check(q, k_cache, v_cache, mask)
    _, KV, M, D = q.shape
    S = k_cache.shape[2]
    if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise ValueError(f"tree_attention: q, k_cache and v_cache must share a dtype, got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    mask = mask.expand(1, 1, M, S)  # broadcast dims get stride 0: no copy
    out = torch.empty((1, KV, M, D), dtype=q.dtype, device=q.device)
    if M == 0:
        return out
    # tl.dot needs every block dimension >= 16; a decode step has few rows, so stay small there.
    block_m = block_m or min(64, max(16, next_pow2(M)))
    block_d = max(16, next_pow2(D))
    # Triton's interpreter (TRITON_INTERPRET=1, the only way to run on CPU tensors) holds bf16 as
    # uint16 bit patterns and its tl.dot multiplies the bits (triton-lang/triton#11584). There the
    # operands go to fp32 first: products of bf16 values are exact in fp32, so this is the GPU's
    # bf16 product with fp32 accumulation, up to the order of the sums.
    dot_f32 = q.dtype == torch.bfloat16 and q.device.type != "cuda"
    precision = "ieee" if q.dtype == torch.float32 or dot_f32 else "tf32"  # tf32 is ignored for 16-bit inputs
    grid = (KV, triton.cdiv(M, block_m))
    wrap_triton(_tree_attention_kernel)[grid](
        q, k_cache, v_cache, mask, out, float(scale), M, S, D,
        q.stride(1), q.stride(2), q.stride(3), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(1), v_cache.stride(2), v_cache.stride(3), mask.stride(2), mask.stride(3),
        out.stride(1), out.stride(2), out.stride(3),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, PRECISION=precision, DOT_F32=dot_f32)
    return out


@torch.library.triton_op("specc::tree_attention", mutates_args=())
def tree_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Attention of the folded query rows over the static cache (see the module docstring).

    A `triton_op`: Inductor and AOTInductor trace into this body instead of calling the op through
    Python. On CUDA they embed the Triton kernel in the compiled graph; on CPU they compile the SDPA
    reference natively."""
    if traced(q):  # shapes are checked once when a graph is traced; eagerly this runs per layer per step
        _check(q, k_cache, v_cache, mask)
    if q.device.type == "cuda" and triton is not None:
        return tree_attention_triton(q, k_cache, v_cache, mask, scale)
    return tree_attention_reference(q, k_cache, v_cache, mask, scale)
