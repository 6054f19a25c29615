"""Regenerate the trained-drafter figures of BENCHMARKS.md on this machine, side by side in one run.

DFlash on the embedded SmolLM2 at several run-time block sizes and chain lengths, on HumanEval and
MT-Bench prompts (greedy, a fixed number of new tokens, chat template on), each against plain
decoding through the same engine and against HF generate(). Also prints the drafter's held-out
tau from its training run, for comparison with the tau measured here.

Usage: python examples/bench_drafters.py --drafter-path DIR [--configs 4:3,8:7,16:15]
           [--limit 5] [--max-new-tokens 256] [--out BENCHMARKS.md]
"""
import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import torch

import specc
from specc.bench import drafter_label, markdown_table, run_bench


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter-path", required=True, help="a DFlash drafter for SmolLM2 (from `specc train`)")
    ap.add_argument("--configs", default="4:3,8:7,16:15,16:4", help="BLOCK:CHAIN pairs")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--datasets", default="humaneval,mt-bench")
    ap.add_argument("--engines", default="engines/bench-drafters")
    ap.add_argument("--out", default="BENCHMARKS.md")
    a = ap.parse_args()
    cmd = "python examples/bench_drafters.py " + " ".join(sys.argv[1:])
    configs = [tuple(int(x) for x in c.split(":")) for c in a.configs.split(",")]

    engines = []
    for block, k in configs:
        path = specc.compile(None, drafter="dflash", drafter_path=a.drafter_path, block_size=block, tree=f"chain:{k}",
                             backend="inductor", output_dir=f"{a.engines}/dflash-b{block}-c{k}", max_len=1024)
        engines.append(path)

    lines = [f"\n## Trained drafters, {datetime.date.today().isoformat()}\n",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} (CPU), "
             f"{torch.get_num_threads()} threads. SmolLM2-135M-Instruct, fp32, inductor backend, greedy, "
             f"{a.max_new_tokens} new tokens per prompt, first {a.limit} prompts of each set, chat template on, EOS "
             f"ignored; warm-up excluded; medians over prompts. Every speculative row ran side by side with plain "
             f"decoding through the same engine; HF generate() ran once per set, beside the first row.\n",
             f"```\n{cmd}\n```\n"]
    progress = Path(a.drafter_path) / "train" / "progress.json"
    if progress.is_file():
        prog = json.loads(progress.read_text())
        ev = next((h["eval"] for h in reversed(prog["history"]) if "eval" in h), {})
        lines.append(f"Drafter: {a.drafter_path}, trained {prog['step']} steps on {prog['sequences']} sequences; "
                     f"held-out tau at training's end (ShareGPT, teacher-forced, greedy): full block {ev.get('tau')}, "
                     + ", ".join(f"chain:{k.removeprefix('tau_chain')} {v}" for k, v in ev.items()
                                 if k.startswith("tau_chain")) + ".\n")
    for ds in a.datasets.split(","):
        reports = [run_bench(p, dataset=ds, limit=a.limit, max_new_tokens=a.max_new_tokens,
                             baseline="both" if i == 0 else "ar", command=cmd) for i, p in enumerate(engines)]
        hf = next(r for r in reports[0]["rows"] if r["method"] == "hf")
        lines += [f"### {ds} ({reports[0]['prompts']} prompts)\n",
                  "| method | tau | tokens/s (median) | plain tokens/s (same run) | vs plain | vs HF generate() |",
                  "|---|---|---|---|---|---|",
                  f"| HF generate() | - | {hf['tokens_per_s']:.2f} | - | - | 1.00x |"]
        for rep in reports:
            by = {r["method"]: r for r in rep["rows"]}
            s, p = by["speculative"], by["ar"]
            lines.append(f"| {drafter_label(rep)} | {s['tau']:.2f} | {s['tokens_per_s']:.2f} | {p['tokens_per_s']:.2f} | "
                         f"{s['speedup_vs_ar']:.2f}x | {s['tokens_per_s'] / hf['tokens_per_s']:.2f}x |")
        lines.append("")
        for rep in reports:
            lines.append(f"{drafter_label(rep)}: accepted drafts per step (0, 1, 2, ...) {rep['accepted_hist']}; "
                         f"greedy output identical to plain decoding on {rep['greedy_identical_to_ar']} prompts.")
        lines.append("")
    with open(a.out, "a") as f:
        f.write("\n".join(lines) + "\n")
    print(f"appended to {a.out}")
    return 0


if __name__ == "__main__":
    from specc.cli import _quiet_libraries

    _quiet_libraries()
    sys.exit(main())
