"""Top-k children against children sampled from the drafter, at temperature > 0 (BENCHMARKS.md).

For each drafter and tree, two engines of the embedded SmolLM2 that differ only in
`--children`: top-k (deterministic drafts, one-hot rule) and sampled (i.i.d. draws from the
drafter's q, min(1, p/q) rule). Both are exact; what differs is how often the target accepts.
Each generates on the first --limit prompts of MT-Bench and of HumanEval (chat template), with
--seeds seeds per prompt, at --temperature; tau is pooled: committed tokens / verify steps.

Usage: python examples/bench_children.py [--configs "mtp=chain:3;dflash=chain:3;dflash=topk:2,2"]
           [--limit 3] [--seeds 2] [--temperature 1.0] [--max-new-tokens 96] [--backend eager]
           [--write BENCHMARKS.md] [--json]
Prints the run; writes it (under History, newest first, Current figures regenerated) only with --write.
"""
import argparse
import sys

import specc
from specc.models import quiet_libraries
from specc import benchfile, harness
from specc.bench import engine_label
from specc.data import load_prompts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.bench_args(ap, limit=3, max_new_tokens=96)
    ap.add_argument("--configs", default="mtp=chain:3;dflash=chain:3;dflash=topk:2,2",
                    help="KIND=TREE items separated by ';'")
    ap.add_argument("--seeds", type=harness.at_least_one, default=2)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--backend", default="eager")
    ap.add_argument("--engines", default="engines/bench-children")
    a = ap.parse_args()
    lines = ["| drafter | tree | MT-Bench tau, top-k | MT-Bench tau, sampled | HumanEval tau, top-k "
             "| HumanEval tau, sampled |",
             "|---|---|---|---|---|---|"]
    figures = []
    sets = {name: load_prompts(name, a.limit) for name in ("mt-bench", "humaneval")}
    for item in a.configs.split(";"):
        kind, _, tree = item.partition("=")
        tau = {}
        for children in ("topk", "sampled"):
            out = f"{a.engines}/{kind}-{tree.replace(':', '').replace(',', '-')}-{children}"
            engine = specc.load(specc.compile(None, drafter=kind, tree=tree, backend=a.backend, output_dir=out,
                                              max_len=1024, children=children, progress=False, modes="sample"))
            # engine_label names sampled children and a backend other than inductor; top-k is said here
            # so that the two rows of a pair read alike.
            label = engine_label(engine.manifest).replace(", sampled children", "")
            label = f"{label}, {children} children, T={a.temperature:g}"
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
                figures.append(benchfile.figure(label, name, model=engine.manifest.target.name,
                                                tau=tau[name, children], new_tokens=a.max_new_tokens,
                                                prompts=len(prompts), note=f"{a.seeds} seeds per prompt, tau pooled"))
                print(f"{kind} {tree} {children} {name}: tau {tau[name, children]:.3f}", file=sys.stderr, flush=True)
        lines.append(f"| {kind} | {tree} | {tau['mt-bench', 'topk']:.3f} | {tau['mt-bench', 'sampled']:.3f} "
                     f"| {tau['humaneval', 'topk']:.3f} | {tau['humaneval', 'sampled']:.3f} |")
    setup = (f"SmolLM2-135M-Instruct with the shipped drafters, {a.backend}, temperature {a.temperature}, top-p 1, "
             f"{a.max_new_tokens} new tokens, first {a.limit} prompts of each set (chat template) x {a.seeds} seeds, "
             f"EOS ignored. tau pooled over the runs: committed tokens / verify steps.")
    return harness.record(a, f"Top-k vs sampled children at temperature {a.temperature}", setup, "\n".join(lines),
                          figures)


if __name__ == "__main__":
    quiet_libraries()
    sys.exit(main())
