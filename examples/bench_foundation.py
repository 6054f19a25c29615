"""Regenerate the foundation figures of BENCHMARKS.md on this machine, side by side in one run.

  1. the floor: the time of the target's matrix-vector products alone for one token, against the
     measured time per token of plain decoding through the inductor backend and HF generate();
  2. `specc bench` for each drafter on HumanEval and MT-Bench prompts (greedy, fixed token count),
     with speedups against plain decoding through the same backend and against HF generate().

Usage: python examples/bench_foundation.py [--drafters ngram,draft-model] [--limit 10] [--max-new-tokens 128]
           [--write BENCHMARKS.md] [--json]
Prints the run; writes it (under History, newest first, Current figures regenerated) only with --write.
"""
import argparse
import sys

import specc
from specc import benchfile, harness
from specc.bench import markdown_table, matvec_floor, report_figures, run_bench
from specc.models import load_model, quiet_libraries

ENGINES = [  # (name, drafter, tree, extra, note for BENCHMARKS.md)
    ("ngram", "ngram", "chain:4", {}, None),
    ("draft-model", "draft-model", "chain:3", {"drafter_layers": 6}, "the target's first 6 layers as drafter"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.bench_args(ap, limit=10, max_new_tokens=128)
    ap.add_argument("--engines", default="engines/bench")
    ap.add_argument("--datasets", default="humaneval,mt-bench")
    ap.add_argument("--drafters", default="ngram,draft-model", help="which of the engines to bench")
    a = ap.parse_args()
    cmd = benchfile.command_line()

    floor = matvec_floor(load_model(None).model)
    reports, figures = [], {}
    for name, drafter, tree, extra, note in ENGINES:
        if name not in a.drafters.split(","):
            continue
        path = specc.compile(None, drafter=drafter, tree=tree, backend="inductor",
                             output_dir=f"{a.engines}/{name}", max_len=1024, progress=not a.json, modes="greedy",
                             **extra)
        for ds in a.datasets.split(","):
            rep = run_bench(path, dataset=ds, limit=a.limit, max_new_tokens=a.max_new_tokens, baseline="both",
                            plot=f"{a.engines}/{name}-{ds}.png", command=cmd, progress=not a.json)
            reports.append(rep)
            for f in report_figures(rep):  # plain and HF once per set: from the first engine's run
                figures.setdefault((f["config"], f["dataset"]), f | ({"note": note} if note and
                                                                      f["config"] == rep["config"] else {}))
    if not reports:
        raise SystemExit(f"--drafters {a.drafters!r} names none of {', '.join(e[0] for e in ENGINES)}.")

    first = reports[0]
    by = {r["method"]: r for r in first["rows"]}
    ar_ms, hf_ms = 1e3 / by["ar"]["tokens_per_s"], 1e3 / by["hf"]["tokens_per_s"]
    lines = ["#### Plain decoding against the floor\n",
             "| | ms per token | tokens/s |", "|---|---|---|",
             f"| floor: the {floor['matvecs']} matrix-vector products alone, [out, in] layout as HF keeps it "
             f"({floor['weight_bytes'] / 1e6:.0f} MB, {floor['gb_per_s']:.1f} GB/s) | {floor['ms_per_token']:.1f} | "
             f"{1e3 / floor['ms_per_token']:.1f} |",
             f"| memory floor: reading the same weights once (a plain sum, "
             f"{floor['stream_gb_per_s']:.1f} GB/s) | {floor['stream_ms_per_token']:.1f} | "
             f"{1e3 / floor['stream_ms_per_token']:.1f} |",
             f"| specc plain decoding, inductor backend ({first['dataset']}) | {ar_ms:.1f} "
             f"| {by['ar']['tokens_per_s']:.1f} |",
             f"| Hugging Face generate() ({first['dataset']}) | {hf_ms:.1f} | {by['hf']['tokens_per_s']:.1f} |",
             "",
             f"Plain decoding through the inductor backend runs at {by['ar']['speedup_vs_hf']:.2f}x the tokens/s of "
             f"HF generate(), and spends {ar_ms / floor['stream_ms_per_token']:.2f}x the memory floor per "
             f"token (the rest is attention over the static cache, norms, the step graph's own work, the host loop, "
             f"and the padded prefill chunks; every figure includes prefill).\n"]
    for rep in reports:
        lines.append(f"#### {rep['config']} on {rep['dataset']} ({rep['prompts']} prompts)\n")
        lines.append(markdown_table(rep))
        if rep["greedy_identical_to_ar"]:
            lines.append(f"\nGreedy output identical to plain decoding: {rep['greedy_identical_to_ar']} prompts.")
        if rep["accepted_hist"]:
            lines.append(f"Accepted drafts per step (0, 1, 2, ...): {rep['accepted_hist']}.\n")
    setup = (f"SmolLM2-135M-Instruct, fp32, greedy, {a.max_new_tokens} new tokens per prompt, first {a.limit} prompts "
             f"of each set, chat template on, EOS ignored so every method produces the same count; warm-up excluded; "
             f"medians over prompts.")
    return harness.record(a, "Foundation run", setup, "\n".join(lines), figures.values(), command=cmd,
                          floor={k: round(v, 4) for k, v in floor.items()})


if __name__ == "__main__":
    quiet_libraries()
    sys.exit(main())
