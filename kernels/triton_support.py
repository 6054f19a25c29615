"""Optional Triton import shared by the kernel modules, and what the op bodies need to be traced."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

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


if triton is not None:
    @triton.jit
    def rowwise_dot(a, b):
        """a [M, K] @ b [K, N] as products summed over K for each output on its own: the interpreted
        kernels' tl.dot (INTERPRETED). Triton's interpreter runs tl.dot as numpy's matmul, whose library
        kernel may sum a row differently by the row's place in the tile (measured on an AMD EPYC: row 6
        of a 16-row tile), which the GPU's MMA instructions do not; under the interpreter this keeps a
        row's bits independent of the other rows, as on the GPU."""
        return tl.sum(a[:, :, None] * b[None, :, :], axis=1)
else:
    rowwise_dot = None


# Triton's defaults, which a launch keeps unless its plan says otherwise.
NUM_WARPS, NUM_STAGES = 4, 3


@dataclass
class Launch:
    """One kernel launch as a launcher made it: the kernel, its grid, every argument by name (tensors as
    they were passed) and the launch options. Recorded (recording()) instead of run, it is what the
    sm_90a build check compiles (kernels/hopper_build.py)."""
    kernel: Any
    grid: tuple
    args: dict = field(default_factory=dict)
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES

    @property
    def name(self) -> str:
        return getattr(self.kernel, "__name__", None) or self.kernel.fn.__name__


_RECORDING: list[list[Launch]] = []


@contextlib.contextmanager
def recording():
    """Within it, launch() records each launch in the list it yields and runs nothing: the launchers
    can be called on meta tensors of any model's shapes to learn which kernels, with which arguments,
    an engine of those shapes launches."""
    launches: list[Launch] = []
    _RECORDING.append(launches)
    try:
        yield launches
    finally:
        _RECORDING.pop()


def launch(kernel, grid: tuple, *args, num_warps: int | None = None, num_stages: int | None = None, **kwargs) -> None:
    """kernel[grid](*args, **kwargs) through torch.library.wrap_triton (so Inductor can trace it), with
    num_warps / num_stages only where given (else Triton's defaults); recorded instead within recording()."""
    if _RECORDING:
        names = getattr(kernel, "arg_names", None)
        bound = dict(zip(names, args)) | kwargs
        _RECORDING[-1].append(Launch(kernel, tuple(grid), bound, num_warps or NUM_WARPS, num_stages or NUM_STAGES))
        return
    options = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}
    wrap_triton(kernel)[grid](*args, **kwargs, **options)


def require_triton(what: str) -> None:
    if triton is None:
        raise RuntimeError(f"{what} needs Triton, which is not installed; the torch reference serves CPU "
                           f"tensors and CUDA tensors without it.")


def traced(x: torch.Tensor) -> bool:
    """True when an op body sees a fake or functional tensor (export, Inductor), not a real one."""
    return type(x) is not torch.Tensor and not isinstance(x, torch.nn.Parameter)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
