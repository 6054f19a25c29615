"""The `specc_cpu` ops: hand-written CPU products of a few rows, built here.

* `specc_cpu::gguf_matvec(x, qs, d, m, fmt)`: with a weight in GGUF blocks of 32 (gguf_cpu.cpp), and
  `specc_cpu::gguf_kquant_matvec(x, qs, fmt)`: with one in K-quant super-blocks (gguf_kquants_cpu.cpp),
  the body of specc::gguf_linear on CPU;
* `specc_cpu::dense_matvec(x, w)`: with a float32 or int8 [out, in] weight (dense_cpu.cpp), the
  body of specc::rows_linear on CPU at the row counts and input widths it was measured faster
  (rows_linear.py);
* `specc_cpu::rows_attention(q, k, v, mask, scale, kv_len)`: a decode step's attention over the cache
  (attention_cpu.cpp), the CPU body of specc::tree_attention: each row summed over the keys in slot
  order, so a tree node's row gets the plain step's bits (tree_attention.py).

The C++ is compiled for the machine it runs on (`-march=native`, once per machine, source and
torch version, under ~/.cache/specc/cpp) the first time a CPU product needs it, with the compiler
Inductor uses. Where no compiler is found the products keep their torch references, which
Inductor compiles to native loops (the same values up to the order of the sums; slower).
AOTInductor calls the ops through its proxy executor, so a graph compiled with them needs them
loaded where it runs: `specc.load` does that for the engines whose manifest says so
(`cpu_kernels`; `quant.cpu_kernel` in engines built before the dense product).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import platform
from pathlib import Path

import torch

SOURCES = [Path(__file__).with_name(f)
           for f in ("gguf_cpu.cpp", "gguf_kquants_cpu.cpp", "dense_cpu.cpp", "attention_cpu.cpp")]
# no contraction: the reference's rounding. SPECC_CPU_KERNEL_FLAGS adds flags (the tests build the
# portable path on an AVX-512 machine with -mno-avx512f).
# -fno-trapping-math: lets the compiler vectorise loops with conditional selects (attention's exp), which
# changes no value.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math",
         *os.environ.get("SPECC_CPU_KERNEL_FLAGS", "").split()]

_state: dict[str, object] = {}


def _machine() -> str:
    """What the build depends on besides the source: the CPU's instruction sets and torch's version."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {torch.__version__} {' '.join(FLAGS)} {flags}"


def build_dir() -> Path:
    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES) + _machine().encode()).hexdigest()[:16]
    root = Path(os.environ.get("SPECC_CACHE", Path.home() / ".cache" / "specc"))
    return root / "cpp" / f"cpu_kernels-{key}"


def load_cpu_kernel() -> bool:
    """Build (or find built) and load the op; False where that is impossible here (no compiler, not
    x86 or ARM Linux) or turned off with SPECC_CPU_KERNELS=0. Decided once per process."""
    if "loaded" in _state:
        return bool(_state["loaded"])
    ok = False
    if os.environ.get("SPECC_CPU_KERNELS", "1") != "0":
        try:
            from torch.utils.cpp_extension import load

            out = build_dir()
            out.mkdir(parents=True, exist_ok=True)
            with open(out / "build.flock", "w") as held:
                # torch's build lock is a file whose presence means "building": one that a killed build left
                # would make every later load wait for ever. Under this lock, which the OS drops with its
                # process, no other specc process is building here, so such a file is stale.
                fcntl.flock(held, fcntl.LOCK_EX)
                (out / "lock").unlink(missing_ok=True)
                load(name=f"specc_cpu_kernels_{out.name.split('-')[-1]}", sources=[str(p) for p in SOURCES],
                     extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], build_directory=str(out), is_python_module=False,
                     verbose=False)
            torch.library.register_fake("specc_cpu::gguf_matvec")(_fake_gguf)
            torch.library.register_fake("specc_cpu::gguf_kquant_matvec")(_fake_gguf_kquant)
            torch.library.register_fake("specc_cpu::dense_matvec")(_fake_dense)
            torch.library.register_fake("specc_cpu::rows_attention")(_fake_attention)
            ok = True
        except Exception as e:  # no compiler, or a build that failed: keep the reference
            _state["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    _state["loaded"] = ok
    return ok


def load_error() -> str | None:
    """Why load_cpu_kernel() returned False (None if it did not, or was not called)."""
    return _state.get("error")  # type: ignore[return-value]


def _fake_gguf(x, qs, d, m, fmt):
    return x.new_empty((*x.shape[:-1], qs.shape[0]))


def _fake_gguf_kquant(x, qs, fmt):
    return x.new_empty((*x.shape[:-1], qs.shape[0]))


def _fake_dense(x, w):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _fake_attention(q, k, v, mask, scale, kv_len=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
