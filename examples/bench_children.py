"""Top-k children against children sampled from the drafter, at temperature > 0 (BENCHMARKS.md).

For each drafter and tree, two engines of the embedded SmolLM2 that differ only in
`--children`: top-k (deterministic drafts, one-hot rule) and sampled (i.i.d. draws from the
drafter's q, min(1, p/q) rule). Both are exact; what differs is how often the target accepts.
Each generates on the first --limit prompts of MT-Bench and of HumanEval (chat template), with
--seeds seeds per prompt, at --temperature; tau is pooled: committed tokens / verify steps.

Usage: python examples/bench_children.py [--configs "mtp=chain:3;dflash=chain:3;dflash=topk:2,2"]
           [--limit 3] [--seeds 2] [--temperature 1.0] [--max-new-tokens 96] [--backend eager]
           [--out BENCHMARKS.md]
"""
import argparse
import datetime
import os
import platform
import sys

import torch

import specc
from specc.data import load_prompts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="mtp=chain:3;dflash=chain:3;dflash=topk:2,2",
                    help="KIND=TREE items separated by ';'")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--backend", default="eager")
    ap.add_argument("--engines", default="engines/bench-children")
    ap.add_argument("--out", default="BENCHMARKS.md")
    a = ap.parse_args()
    cmd = "python examples/bench_children.py " + " ".join(sys.argv[1:])
    lines = [f"\n## Top-k vs sampled children at temperature {a.temperature}, {datetime.date.today().isoformat()}\n",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} (CPU). "
             f"SmolLM2-135M-Instruct with the shipped drafters, {a.backend}, temperature {a.temperature}, top-p 1, "
             f"{a.max_new_tokens} new tokens, first {a.limit} prompts of each set (chat template) x {a.seeds} seeds, "
             f"EOS ignored. tau pooled over the runs: committed tokens / verify steps.\n",
             f"```\n{cmd}\n```\n",
             "| drafter | tree | MT-Bench tau, top-k | MT-Bench tau, sampled | HumanEval tau, top-k "
             "| HumanEval tau, sampled |",
             "|---|---|---|---|---|---|"]
    sets = {name: load_prompts(name, a.limit) for name in ("mt-bench", "humaneval")}
    for item in a.configs.split(";"):
        kind, _, tree = item.partition("=")
        tau = {}
        for children in ("topk", "sampled"):
            out = f"{a.engines}/{kind}-{tree.replace(':', '').replace(',', '-')}-{children}"
            engine = specc.load(specc.compile(None, drafter=kind, tree=tree, backend=a.backend, output_dir=out,
                                              max_len=1024, children=children, progress=False))
            for name, prompts in sets.items():
                tokens = steps = 0
                for p in prompts:
                    ids = engine.encode(p, chat=True)
                    for seed in range(a.seeds):
                        r = engine.generate(ids, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                                            seed=seed, stop_at_eos=False)
                        tokens += r.stats.new_tokens - 1  # the first token comes from prefill
                        steps += r.stats.steps
                tau[name, children] = tokens / steps
                print(f"{kind} {tree} {children} {name}: tau {tau[name, children]:.3f}", flush=True)
        lines.append(f"| {kind} | {tree} | {tau['mt-bench', 'topk']:.3f} | {tau['mt-bench', 'sampled']:.3f} "
                     f"| {tau['humaneval', 'topk']:.3f} | {tau['humaneval', 'sampled']:.3f} |")
        print(lines[-1], flush=True)
    with open(a.out, "a") as f:
        f.write("\n".join(lines) + "\n\n")
    print(f"appended to {a.out}")
    return 0


if __name__ == "__main__":
    from specc.cli import _quiet_libraries

    _quiet_libraries()
    sys.exit(main())
