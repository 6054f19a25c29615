"""Plain decoding from quantized weights against float32, side by side in one run (BENCHMARKS.md).

One engine per --quant value (drafter none, the same backend), compiled into --engines or reused
by directory name. On each prompt set, each prompt runs through every engine back to back, --rounds
times, the order rotated every round. Figures: per engine the median over rounds of the median
tokens/s over prompts (the whole generate() call, prefill included), the speedup over the first
--quant value (none: float32), the weight bytes each decoded token reads (the manifest's count) and
the time that many bytes take at this machine's streaming-read speed (a vectorised sum over 256 MB:
the memory floor of a token).
Greedy outputs are compared with the first engine's: a quantized model is a different model, so
they may differ; the count is reported, not required.

Usage: python examples/bench_quant.py [--quants none,int8] [--backend inductor] [--limit 10]
           [--max-new-tokens 128] [--rounds 3] [--datasets humaneval,mt-bench] [--engines DIR]
           [--write BENCHMARKS.md] [--json]
Prints the run; writes it (under History, newest first, Current figures regenerated) only with --write.
"""
import argparse
import sys
from pathlib import Path

import torch

import specc
from specc import benchfile, harness
from specc.data import load_prompts
from specc.errors import SpeccError
from specc.models import quiet_libraries


def read_gb_s(mb: int = 256, reps: int = 7) -> float:
    """GB/s of a vectorised sum over `mb` MB of float32 (far beyond any cache), on the threads torch
    uses: the speed at which a decode step can at best stream its weights (MKL's sgemv, the
    machine line's "matvec" figure, streams slower than the reductions the engines compile to)."""
    w = torch.full((mb * 2**20 // 4,), 0.5)
    return w.numel() * 4 / harness.median(harness.call_times(w.sum, reps, warmup=1)) / 1e9  # warm-up: first touch


def engine_dir(root: Path, quant: str, backend: str, progress: bool) -> Path:
    out = root / f"plain-{backend}-{quant}"
    if not (out / "specc.json").is_file():
        specc.compile(None, drafter="none", backend=backend, quant=quant, modes="greedy", output_dir=out,
                      progress=progress)
    return out


def label(quant: str, backend: str) -> str:
    return f"plain decoding, {'float32' if quant == 'none' else quant} weights ({backend})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.bench_args(ap, limit=10, max_new_tokens=128, rounds=3)
    ap.add_argument("--quants", default="none,int8")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--datasets", default="humaneval,mt-bench")
    ap.add_argument("--engines", default="engines/bench-quant")
    args = ap.parse_args()
    quants = args.quants.split(",")
    engines = {q: specc.load(engine_dir(Path(args.engines), q, args.backend, not args.json)) for q in quants}
    gb_s = read_gb_s()
    nbytes = {q: e.manifest.quant.bytes_per_token["target"] for q, e in engines.items()}
    figures, lines = [], []
    model = engines[quants[0]].manifest.target.name
    for dataset in args.datasets.split(","):
        ids = [engines[quants[0]].encode(p, chat=True) for p in load_prompts(dataset, args.limit)]
        arms = {q: (lambda job, q=q: engines[q].generate(job[0], max_new_tokens=job[1], stop_at_eos=False))
                for q in quants}
        res = harness.paired(arms, args.rounds, items=[(x, args.max_new_tokens) for x in ids], warm=(ids[0], 8))
        tps = {q: harness.median_of_rounds(res[q], key=lambda r: len(r.token_ids) / r.stats.wall_s) for q in quants}
        first = harness.values(res[quants[0]])
        same = {q: sum(r.token_ids == f.token_ids for r, f in zip(harness.values(res[q]), first)) for q in quants}
        base = tps[quants[0]]
        lines += [f"**{dataset}** ({len(ids)} prompts):", "",
                  "| weights | tokens/s | vs first | weight MB per token | memory floor ms/token | same tokens as first |",
                  "|---|---|---|---|---|---|"]
        for q in quants:
            t = tps[q]
            lines.append(f"| {q} | {t:.1f} | {t / base:.2f}x | {nbytes[q] / 1e6:.1f} | {nbytes[q] / gb_s / 1e6:.2f} | "
                         f"{same[q]}/{len(ids) * args.rounds} |")
            figures.append(benchfile.figure(label(q, args.backend), dataset, model=model,
                                            tokens_per_s=t, vs_plain=t / base if q != quants[0] else None,
                                            new_tokens=args.max_new_tokens, prompts=len(ids),
                                            note=f"vs plain: against {quants[0]} weights' plain decoding" if q != quants[0]
                                            else None))
        lines.append("")
    setup = (f"Plain decoding (drafter none, {args.backend}) through one engine per weight format, first {args.limit} "
             f"prompts of each set (chat template) x {args.max_new_tokens} new tokens x {args.rounds} rounds, order "
             f"rotated each round, EOS ignored, warm-up excluded; tokens/s over the whole generate() call. Memory "
             f"floor: the weight bytes a token reads at this machine's streaming-read speed (a vectorised sum over "
             f"256 MB: {gb_s:.1f} GB/s).")
    return harness.record(args, "Quantized weights, plain decoding", setup, "\n".join(lines), figures,
                          bytes_per_token=nbytes, read_gb_s=round(gb_s, 1))


if __name__ == "__main__":
    quiet_libraries()
    try:
        sys.exit(main())
    except SpeccError as e:  # a bad --quants value, say
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
