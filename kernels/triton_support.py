"""Optional Triton import shared by the kernel modules, and what the op bodies need to be traced."""
from __future__ import annotations

import torch
from torch.library import wrap_triton  # noqa: F401  (re-exported: launches that Inductor can trace)

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


def traced(x: torch.Tensor) -> bool:
    """True when an op body sees a fake or functional tensor (export, Inductor), not a real one."""
    return type(x) is not torch.Tensor and not isinstance(x, torch.nn.Parameter)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
