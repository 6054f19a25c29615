"""specc's quantized CPU products per instruction set (AVX-512, AVX2, portable builds), beside PyTorch's own.

    python examples/bench_gguf_isa.py [--formats Q4_1,Q4_0,Q8_0,int8,Q6_K] [--rows 1,2,4,8,16]
        [--builds AVX-512,AVX2,...] [--calls 20] [--rounds 3] [--json] [--write BENCHMARKS.md]

specc's C++ products are built for the machine that loads them; a CPU without AVX-512 gets the AVX2
path, and one without AVX2 the portable loops. This machine builds each path it can run (the
narrower ones with SPECC_CPU_KERNEL_FLAGS leaving the wider instruction sets out, as the tests do),
each in a process of its own (one build per process, ATen's own kernels dispatched for the same
instruction set with ATEN_CPU_CAPABILITY), and times specc's product on SmolLM2-135M's product shapes
(random weights: the fused q/k/v 960x576, gate/up 3072x576, down 576x1536, LM head 49152x576) at each
row count: `specc_cpu::gguf_matvec` for the GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1),
`specc_cpu::gguf_kquant_matvec` for the K-quants' super-blocks (Q4_K, Q5_K, Q6_K; on the shapes whose
rows are whole 256-value super-blocks: SmolLM2's down projection),
`specc_cpu::dense_matvec` for int8 rows; beside it PyTorch's maintained kernel for the same weights
where one exists (int8: aten._weight_int8pack_mm; Q4_0 / Q4_1: aten._weight_int4pack_mm_for_cpu) and
whether that kernel gives a row the same bits at every row count (what a lossless verify needs).
Rounds run the builds in rotated order; figures are medians over rounds of each process's mean ms a
call. GB/s: the weight's bytes over specc's time (a decode step reads each weight once).
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from specc import harness

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
BUILDS = {  # name -> (the cpuinfo flag it needs, the flags that leave the wider sets out, ATen's dispatch)
    "AVX-512": ("avx512f", "", "avx512"),
    "AVX2": ("avx2", "-mno-avx512f", "avx2"),
    # what AVX2 machines ran before the AVX2 path: the portable loops, vectorised by the compiler for AVX2
    "AVX2 portable loops": ("avx2", "-mno-avx512f -DSPECC_GGUF_PORTABLE", "avx2"),
    "portable": ("sse2", "-mno-avx512f -mno-avx2 -mno-fma", "default"),
}
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24}
SUPER_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # K-quants: super-blocks of 256 weights
SUPER_HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # where their float16 scales sit


def _bytes(fmt: str, N: int, K: int) -> int:
    """The weight's bytes in this format (what a one-row product reads)."""
    if fmt == "int8":
        return N * K + 4 * N
    return N * K // 256 * SUPER_BYTES[fmt] if fmt in SUPER_BYTES else N * K // 32 * BLOCK_BYTES[fmt]


def _aten_int4(qs, d, m, fmt: str):
    """PyTorch's int4 CPU kernel over the same 4-bit blocks, or None. Its weight is (q - 8) * scale + zero
    per group of 32: scale d and zero m + 8d give d * q + m (Q4_1), zero 0 gives d * (q - 8) (Q4_0)."""
    import torch

    N, nb, _ = qs.shape
    codes = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(N, nb * 32).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scale = d.float().T.contiguous()
    zero = (m.float() + 8 * d.float()).T.contiguous() if fmt == "Q4_1" else torch.zeros_like(scale)
    sz = torch.stack([scale, zero], dim=-1).contiguous()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)


def products(fmt: str, N: int, K: int, g):
    """(specc's hand-written product, PyTorch's maintained kernel or None, the weight's bytes) for
    random weights of one format and shape."""
    import torch

    from specc.kernels.gguf_linear import FORMATS

    if fmt == "int8":  # --quant int8: int8 rows, a float32 scale per output row, applied after the product
        w = torch.randint(-127, 128, (N, K), generator=g).to(torch.int8)
        scale = torch.rand(N, generator=g) * 0.01
        return (lambda x: torch.ops.specc_cpu.dense_matvec(x, w) * scale,
                lambda x: torch.ops.aten._weight_int8pack_mm(x, w, scale), _bytes(fmt, N, K))
    if fmt in SUPER_BYTES:  # random bytes are valid super-blocks once their float16 scales are small and finite
        qs = torch.randint(0, 256, (N, K // 256, SUPER_BYTES[fmt]), generator=g, dtype=torch.uint8)
        for at in SUPER_HALVES[fmt]:
            qs[..., at:at + 2] = (torch.rand(N, K // 256, generator=g) * 1e-3).half().view(torch.uint8).reshape(N, -1, 2)
        code = FORMATS.index(fmt)
        return (lambda x: torch.ops.specc_cpu.gguf_kquant_matvec(x, qs, code)), None, _bytes(fmt, N, K)
    nb = K // 32
    code_bytes = {"Q8_0": 32, "Q5_0": 20, "Q5_1": 20}.get(fmt, 16)  # 5-bit: qh's 4 bytes, then the codes
    qs = torch.randint(-128 if fmt == "Q8_0" else 0, 128 if fmt == "Q8_0" else 256, (N, nb, code_bytes),
                       generator=g).to(torch.int8 if fmt == "Q8_0" else torch.uint8)
    d = (torch.rand(N, nb, generator=g) * 0.01).half()
    m = (torch.rand(N, nb, generator=g) * -0.01).half() if fmt in ("Q4_1", "Q5_1") else torch.empty(0, dtype=torch.half)
    ours = lambda x: torch.ops.specc_cpu.gguf_matvec(x, qs, d, m, FORMATS.index(fmt))  # noqa: E731
    # no maintained CPU kernel takes int8 blocks with a scale per 32 weights (Q8_0) or 5-bit codes
    return ours, (_aten_int4(qs, d, m, fmt) if fmt in ("Q4_0", "Q4_1") else None), _bytes(fmt, N, K)


def worker(formats: list[str], rows: list[int], calls: int) -> dict:
    """In a process built with this environment's flags (and ATen's kernels dispatched for the same
    instruction set): {"format shape rows": [specc ms, aten ms or None, aten row-invariant or None]}."""
    import torch

    from specc.kernels.cpu_kernels import load_cpu_kernel, load_error

    if not load_cpu_kernel():
        raise SystemExit(f"the C++ products did not build: {load_error()}")
    g = torch.Generator().manual_seed(0)
    out = {}
    for fmt in formats:
        for shape, (N, K) in SHAPES.items():
            if fmt in SUPER_BYTES and K % 256:
                continue  # a K-quant row is whole super-blocks (llama.cpp's tools write such rows in another format)
            ours, aten, _ = products(fmt, N, K, g)
            xs = torch.randn(max(rows), K, generator=g)
            one = aten(xs[:1]) if aten is not None else None
            for r in rows:
                x = xs[:r].contiguous()
                ms = 1000 * harness.mean_time(lambda: ours(x), calls, warmup=2)
                if aten is None:
                    out[f"{fmt} {shape} {r}"] = [ms, None, None]
                    continue
                aten_ms = 1000 * harness.mean_time(lambda: aten(x), calls, warmup=2)
                # lossless speculation needs each row's bits whatever the row count: row 0 as in a 1-row call
                out[f"{fmt} {shape} {r}"] = [ms, aten_ms, bool(torch.equal(aten(x)[:1], one))]
    return out


def run_build(name: str, args) -> dict:
    env = dict(os.environ, SPECC_CPU_KERNEL_FLAGS=BUILDS[name][1], ATEN_CPU_CAPABILITY=BUILDS[name][2],
               OMP_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, "-P", __file__, "--worker", "--formats", ",".join(args.formats), "--rows",
           ",".join(map(str, args.rows)), "--calls", str(args.calls)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"the {name} build's run failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", type=lambda s: s.split(","), default=["Q4_1", "Q4_0", "Q8_0", "int8"])
    ap.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[1, 2, 4, 8, 16])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--builds", type=lambda s: s.split(","), default=list(BUILDS),
                    help="the builds to time, of: " + ", ".join(BUILDS) + " (those this CPU runs)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    harness.bench_args(ap, rounds=3, calls=20, calls_help="timed calls per shape and row count in each process")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.formats, args.rows, args.calls)))
        return 0
    formats = ["int8", *BLOCK_BYTES, *SUPER_BYTES]
    odd = [f for f in args.formats if f not in formats]
    if odd:
        raise SystemExit(f"unknown format {odd[0]!r}; the formats are: {', '.join(formats)}.")
    flags = Path("/proc/cpuinfo").read_text(errors="ignore").split()
    unknown = [b for b in args.builds if b not in BUILDS]
    if unknown:
        raise SystemExit(f"unknown build {unknown[0]!r}; the builds are: {', '.join(BUILDS)}.")
    builds = [b for b in args.builds if BUILDS[b][0] in flags]
    res = harness.paired({b: (lambda b=b: run_build(b, args)) for b in builds}, args.rounds, warmup=0)
    ms = {b: {k: [harness.median([r[0][k][i] for r in res[b]]) if res[b][0][0][k][i] is not None else None
                  for i in range(2)] for k in res[b][0][0]} for b in builds}
    invariant = {b: {k: all(r[0][k][2] is not False for r in res[b]) for k in res[b][0][0]} for b in builds}
    rows = []
    for key in ms[builds[0]]:
        fmt, shape, r = key.split()
        N, K = SHAPES[shape]
        for b in builds:
            ours, aten = ms[b][key]
            gbs = _bytes(fmt, N, K) / (ours / 1000) / 1e9
            rows.append([fmt, f"{shape} {N}x{K}", r, b, f"{ours:.3f}", f"{gbs:.1f}",
                         "-" if aten is None else f"{aten:.3f}", "-" if aten is None else f"{aten / ours:.2f}",
                         "-" if aten is None else ("yes" if invariant[b][key] else "no")])
    body = harness.table(["format", "product", "rows", "build", "specc ms", "specc GB/s", "ATen ms", "ATen / specc",
                          "ATen rows invariant"], rows)
    setup = (f"specc's hand-written products (specc_cpu::gguf_matvec; int8: specc_cpu::dense_matvec and its scale) "
             f"against PyTorch's maintained CPU kernels on the same weights (int8: aten._weight_int8pack_mm; "
             f"Q4_0/Q4_1: aten._weight_int4pack_mm_for_cpu, groups of 32; none takes Q8_0's blocks), per "
             f"instruction set: each build in its own process with ATen dispatched for the same set "
             f"(ATEN_CPU_CAPABILITY), {args.threads} threads, {args.calls} calls per figure, {args.rounds} rounds "
             f"in rotated order, medians; random weights of SmolLM2-135M's product shapes. GB/s: the weight's "
             f"bytes over specc's time. \"ATen rows invariant\": whether row 0 of an R-row call has the bits of a "
             f"1-row call in every round (a speculative verify needs that). \"AVX2 portable loops\" is what an "
             f"AVX2 machine ran before the AVX2 path.")
    return harness.record(args, "GGUF block products per instruction set", setup, body,
                          command="python examples/bench_gguf_isa.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
