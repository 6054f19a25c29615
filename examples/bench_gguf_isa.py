"""The GGUF block product (kernels/gguf_cpu.cpp) per instruction set: AVX-512, AVX2 and portable builds.

    python examples/bench_gguf_isa.py [--formats Q4_1,Q4_0,Q8_0] [--rows 1,2,4,8,16] [--calls 20]
        [--rounds 3] [--json] [--write BENCHMARKS.md]

specc's C++ products are built for the machine that loads them; a CPU without AVX-512 gets the AVX2
path, and one without AVX2 the portable loops. This machine builds each path it can run (the
narrower ones with SPECC_CPU_KERNEL_FLAGS leaving the wider instruction sets out, as the tests do),
each in a process of its own (one build per process), and times `specc_cpu::gguf_matvec` on
SmolLM2-135M's product shapes (random blocks: the fused q/k/v 960x576, gate/up 3072x576, down
576x1536, LM head 49152x576) at each row count. Rounds run the builds in rotated order; figures are
medians over rounds of each process's mean ms a call. The GB/s column is the blocks' bytes over the
AVX2 time: a decode step reads each weight once, so it is the product's share of the memory's speed.
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from specc import harness

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
BUILDS = {  # name -> (the cpuinfo flag it needs, the flags that leave the wider sets out)
    "AVX-512": ("avx512f", ""),
    "AVX2": ("avx2", "-mno-avx512f"),
    # what AVX2 machines ran before the AVX2 path: the portable loops, vectorised by the compiler for AVX2
    "AVX2, portable loops": ("avx2", "-mno-avx512f -DSPECC_GGUF_PORTABLE"),
    "portable": ("sse2", "-mno-avx512f -mno-avx2 -mno-fma"),
}
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def worker(formats: list[str], rows: list[int], calls: int) -> dict:
    """In a process built with this environment's flags: mean ms a call per (format, shape, rows)."""
    import torch

    from specc.kernels.cpu_kernels import load_cpu_kernel, load_error
    from specc.kernels.gguf_linear import FORMATS

    if not load_cpu_kernel():
        raise SystemExit(f"the C++ products did not build: {load_error()}")
    g = torch.Generator().manual_seed(0)
    out = {}
    for fmt in formats:
        for shape, (N, K) in SHAPES.items():
            nb = K // 32
            qs = torch.randint(-128 if fmt == "Q8_0" else 0, 128 if fmt == "Q8_0" else 256, (N, nb, 32 if fmt == "Q8_0" else 16),
                               generator=g).to(torch.int8 if fmt == "Q8_0" else torch.uint8)
            d = (torch.rand(N, nb, generator=g) * 0.01).half()
            m = (torch.rand(N, nb, generator=g) * -0.01).half() if fmt == "Q4_1" else torch.empty(0, dtype=torch.half)
            for r in rows:
                x = torch.randn(r, K, generator=g)
                op = torch.ops.specc_cpu.gguf_matvec
                ms = 1000 * harness.mean_time(lambda: op(x, qs, d, m, FORMATS.index(fmt)), calls, warmup=2)
                out[f"{fmt} {shape} {r}"] = ms
    return out


def run_build(name: str, args) -> dict:
    env = dict(os.environ, SPECC_CPU_KERNEL_FLAGS=BUILDS[name][1], OMP_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, "-P", __file__, "--worker", "--formats", ",".join(args.formats), "--rows",
           ",".join(map(str, args.rows)), "--calls", str(args.calls)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"the {name} build's run failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", type=lambda s: s.split(","), default=["Q4_1", "Q4_0", "Q8_0"])
    ap.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[1, 2, 4, 8, 16])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    harness.bench_args(ap, rounds=3, calls=20, calls_help="timed calls per shape and row count in each process")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.formats, args.rows, args.calls)))
        return 0
    flags = Path("/proc/cpuinfo").read_text(errors="ignore").split()
    builds = [b for b, (needs, _) in BUILDS.items() if needs in flags]
    res = harness.paired({b: (lambda b=b: run_build(b, args)) for b in builds}, args.rounds, warmup=0)
    ms = {b: {k: harness.median([r[0][k] for r in res[b]]) for k in res[b][0][0]} for b in builds}
    rows = []
    for key in ms[builds[0]]:
        fmt, shape, r = key.split()
        N, K = SHAPES[shape]
        gbs = N * K // 32 * BLOCK_BYTES[fmt] / (ms.get("AVX2", ms[builds[0]])[key] / 1000) / 1e9
        rows.append([fmt, f"{shape} {N}x{K}", r, *(f"{ms[b][key]:.3f}" for b in builds), f"{gbs:.1f}"])
    body = harness.table(["format", "product", "rows", *(f"{b} ms" for b in builds), "AVX2 GB/s"], rows)
    setup = (f"specc_cpu::gguf_matvec built per instruction set, each build in its own process "
             f"({args.threads} threads), {args.calls} calls per figure, {args.rounds} rounds in rotated order, medians; "
             f"random blocks of SmolLM2-135M's product shapes. \"AVX2, portable loops\" is what an AVX2 machine "
             f"ran before the AVX2 path (the portable loops as the compiler vectorises them for AVX2).")
    return harness.record(args, "GGUF block products per instruction set", setup, body,
                          command="python examples/bench_gguf_isa.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
