"""Regenerate the foundation figures of BENCHMARKS.md on this machine, side by side in one run.

  1. the floor: the time of the target's matrix-vector products alone for one token, against the
     measured time per token of plain decoding through the inductor backend and HF generate();
  2. `specc bench` for each drafter on HumanEval and MT-Bench prompts (greedy, fixed token count),
     with speedups against plain decoding through the same backend and against HF generate().

Usage: python examples/bench_foundation.py [--limit 10] [--max-new-tokens 128] [--out BENCHMARKS.md]
"""
import argparse
import datetime
import os
import platform
import sys

import torch

import specc
from specc.bench import matvec_floor, run_bench
from specc.models import load_model

ENGINES = [  # (name, drafter, tree, extra)
    ("ngram", "ngram", "chain:4", {}),
    ("draft-model", "draft-model", "chain:3", {"drafter_layers": 6}),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="BENCHMARKS.md")
    ap.add_argument("--engines", default="engines/bench")
    ap.add_argument("--datasets", default="humaneval,mt-bench")
    ap.add_argument("--drafters", default="ngram,draft-model", help="which of the engines to bench")
    a = ap.parse_args()
    cmd = "python examples/bench_foundation.py " + " ".join(sys.argv[1:])

    floor = matvec_floor(load_model(None).model)
    sections = []
    for name, drafter, tree, extra in ENGINES:
        if name not in a.drafters.split(","):
            continue
        path = specc.compile(None, drafter=drafter, tree=tree, backend="inductor",
                             output_dir=f"{a.engines}/{name}", max_len=1024, **extra)
        for ds in a.datasets.split(","):
            rep = run_bench(path, dataset=ds, limit=a.limit, max_new_tokens=a.max_new_tokens, baseline="both",
                            plot=f"{a.engines}/{name}-{ds}.png", command=cmd)
            sections.append(rep)

    first = sections[0]
    by = {r["method"]: r for r in first["rows"]}
    ar_ms, hf_ms = 1e3 / by["ar"]["tokens_per_s"], 1e3 / by["hf"]["tokens_per_s"]
    lines = [f"\n## Foundation run, {datetime.date.today().isoformat()}\n",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} (CPU), "
             f"{torch.get_num_threads()} threads. SmolLM2-135M-Instruct, fp32, greedy, "
             f"{a.max_new_tokens} new tokens per prompt, first {a.limit} prompts of each set, chat template on, "
             f"EOS ignored so every method produces the same count; warm-up excluded; medians over prompts.\n",
             f"```\n{cmd}\n```\n",
             "### Plain decoding against the floor\n",
             "| | ms per token | tokens/s |", "|---|---|---|",
             f"| floor: the {floor['matvecs']} matrix-vector products alone, [out, in] layout as HF keeps it "
             f"({floor['weight_bytes'] / 1e6:.0f} MB, {floor['gb_per_s']:.1f} GB/s) | {floor['ms_per_token']:.1f} | "
             f"{1e3 / floor['ms_per_token']:.1f} |",
             f"| memory floor: reading the same weights once (a plain sum, "
             f"{floor['stream_gb_per_s']:.1f} GB/s) | {floor['stream_ms_per_token']:.1f} | "
             f"{1e3 / floor['stream_ms_per_token']:.1f} |",
             f"| specc plain decoding, inductor backend ({first['dataset']}) | {ar_ms:.1f} | {by['ar']['tokens_per_s']:.1f} |",
             f"| Hugging Face generate() ({first['dataset']}) | {hf_ms:.1f} | {by['hf']['tokens_per_s']:.1f} |",
             "",
             f"Plain decoding through the inductor backend runs at {by['ar']['speedup_vs_hf']:.2f}x the tokens/s of "
             f"HF generate(), and spends {ar_ms / floor['stream_ms_per_token']:.2f}x the memory floor per "
             f"token (the rest is attention over the static cache, norms, the step graph's own work, the host loop, "
             f"and the padded prefill chunks; every figure includes prefill).\n"]
    from specc.bench import markdown_table

    for rep in sections:
        lines.append(f"### {rep['drafter']['kind']} {rep['tree']} on {rep['dataset']} ({rep['prompts']} prompts)\n")
        lines.append(markdown_table(rep))
        if rep["greedy_identical_to_ar"]:
            lines.append(f"\nGreedy output identical to plain decoding: {rep['greedy_identical_to_ar']} prompts.")
        hist = rep["accepted_hist"]
        if hist:
            lines.append(f"Accepted drafts per step (0, 1, 2, ...): {hist}.\n")
    with open(a.out, "a") as f:
        f.write("\n".join(lines) + "\n")
    print(f"appended to {a.out}")
    return 0


if __name__ == "__main__":
    from specc.cli import _quiet_libraries

    _quiet_libraries()
    sys.exit(main())
