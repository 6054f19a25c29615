"""`specc::compact_kv_`: move the accepted path's K/V rows to consecutive cache slots, in place.

    compact_kv_(cache [1, KV, S, D], src_slots [n] int64, dst_start [] int64) -> None
    for i in 0 .. n-1, in order:   cache[:, :, dst_start + i] = cache[:, :, src_slots[i]]

Precondition: no step reads a slot that an earlier step of the same call changed, i.e. for i < j,
src_slots[j] == dst_start + i only if src_slots[i] == dst_start + i. Under it the sequential
definition equals "gather every source row, then write every destination row", which is what
the reference does (index_select + index_copy_). The compact_kv pass calls it with
src_slots = base_len + path and dst_start = base_len, which satisfies it: an accepted node's
index is at least its depth (src_slots[i] >= dst_start + i), and the padding that repeats the last
accepted node a_n reads slot base_len + a_n, whose own step, if any, copies it onto itself.
Outside the precondition the result is unspecified (CPU gathers first; the Triton kernel follows
the sequential definition).

The Triton kernel is race-free by construction: its programs split the cache over kv heads and
blocks of D, so no two programs touch the same element, and each program walks i in order with a
barrier after each write so the threads of a program see each other's earlier writes.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .triton_support import launch, next_pow2, require_triton, tl, traced, triton


def _check(cache: Tensor, src_slots: Tensor, dst_start: Tensor) -> None:
    if cache.dim() != 4 or cache.shape[0] != 1:
        raise ValueError(f"compact_kv_: cache must be [1, KV, S, D], got {tuple(cache.shape)}")
    if src_slots.dim() != 1 or src_slots.dtype != torch.int64:
        raise ValueError(f"compact_kv_: src_slots must be a 1-d int64 tensor, got {tuple(src_slots.shape)} "
                         f"{src_slots.dtype}")
    if dst_start.dim() != 0 or dst_start.dtype != torch.int64:
        raise ValueError(f"compact_kv_: dst_start must be a 0-d int64 tensor, got {tuple(dst_start.shape)} "
                         f"{dst_start.dtype}")


def compact_kv_reference(cache: Tensor, src_slots: Tensor, dst_start: Tensor) -> None:
    dst = dst_start + torch.arange(src_slots.shape[0], device=cache.device)
    cache.index_copy_(2, dst, cache.index_select(2, src_slots))


if triton is not None:
    @triton.jit
    def _compact_kv_kernel(cache_ptr, src_ptr, dst_ptr, n, D, s_h, s_s, s_d, BLOCK_D: tl.constexpr):
        dims = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        ok = dims < D
        base = cache_ptr + tl.program_id(0).to(tl.int64) * s_h + dims * s_d
        dst = tl.load(dst_ptr)
        for i in range(n):
            src = tl.load(src_ptr + i)
            row = tl.load(base + src * s_s, mask=ok)
            tl.store(base + (dst + i) * s_s, row, mask=ok)
            tl.debug_barrier()


def compact_kv_triton(cache: Tensor, src_slots: Tensor, dst_start: Tensor, block_d: int = 128) -> None:
    """Launch the Triton kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    require_triton("compact_kv_triton")
    _check(cache, src_slots, dst_start)
    _, KV, S, D = cache.shape
    n = src_slots.shape[0]
    if n == 0 or D == 0:
        return
    block_d = min(block_d, max(16, next_pow2(D)))
    # The kernel reads both index tensors through pointers: they must live beside the cache.
    src_slots = src_slots.to(cache.device).contiguous()
    dst_start = dst_start.to(cache.device)
    grid = (KV, triton.cdiv(D, block_d))
    launch(_compact_kv_kernel, grid, cache, src_slots, dst_start, n, D, cache.stride(1), cache.stride(2),
           cache.stride(3), BLOCK_D=block_d)


@torch.library.triton_op("specc::compact_kv_", mutates_args=("cache",))
def compact_kv_(cache: Tensor, src_slots: Tensor, dst_start: Tensor) -> None:
    """In-place KV compaction (see the module docstring for the order and its precondition). A
    `triton_op`, as tree_attention: compiled graphs inline the kernel (CUDA) or the reference (CPU)."""
    if traced(cache):  # checked once when a graph is traced; eagerly this runs per cache per step
        _check(cache, src_slots, dst_start)
    if cache.device.type == "cuda" and triton is not None:
        compact_kv_triton(cache, src_slots, dst_start)
    else:
        compact_kv_reference(cache, src_slots, dst_start)
