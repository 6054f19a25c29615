"""Optional Triton import shared by the kernel modules, and what the op bodies need to be traced."""
from __future__ import annotations

import torch
import torch.library

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the references serve every call
    triton = None
    tl = None

HAS_TRITON = triton is not None


def wrap_triton(kernel):
    """torch.library.wrap_triton: a launch that Inductor can trace. Under Triton's interpreter
    (TRITON_INTERPRET=1, the CPU tests) torch 2.11 refuses the interpreter's functions, which
    nothing traces there anyway: they launch as they are."""
    try:
        return torch.library.wrap_triton(kernel)
    except RuntimeError:
        from triton.runtime.interpreter import InterpretedFunction

        if isinstance(kernel, InterpretedFunction):
            return kernel
        raise


def require_triton(what: str) -> None:
    if triton is None:
        raise RuntimeError(f"{what} needs Triton, which is not installed; the torch reference serves CPU "
                           f"tensors and CUDA tensors without it.")


def traced(x: torch.Tensor) -> bool:
    """True when an op body sees a fake or functional tensor (export, Inductor), not a real one."""
    return type(x) is not torch.Tensor and not isinstance(x, torch.nn.Parameter)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
