"""Optional Triton import shared by the kernel modules."""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the references serve every call
    triton = None
    tl = None

HAS_TRITON = triton is not None


def require_triton(what: str) -> None:
    if triton is None:
        raise RuntimeError(f"{what} needs Triton, which is not installed; the torch reference serves CPU "
                           f"tensors and CUDA tensors without it.")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
