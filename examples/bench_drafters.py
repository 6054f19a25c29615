"""Regenerate the trained-drafter figures of BENCHMARKS.md on this machine, side by side in one run.

DFlash (at several run-time block sizes and chain lengths), DSpark and MTP (at several chain lengths,
or any tree) on the embedded SmolLM2, on HumanEval and MT-Bench prompts (greedy, a fixed number of new tokens, chat
template on), each against plain decoding through the same engine and against HF generate(). Also
prints each drafter's held-out tau from its training run, for comparison with the tau measured here.

Usage: python examples/bench_drafters.py [--configs dflash@4=chain:3,dflash=sequoia:8,mtp=chain:1]
           [--dflash DIR] [--dspark DIR] [--mtp DIR] [--limit 5] [--max-new-tokens 256] [--write BENCHMARKS.md]
           [--json]
Config items: dflash[@BLOCK]=TREE, dspark[@BLOCK]=TREE or mtp=TREE, TREE as for `specc compile --tree`
(the block defaults to the drafter's trained block), optionally followed by +ngramK: the same tree with
prompt lookup's branch of K nodes (`--ngram-branch K`, a hybrid tree). Without --dflash / --dspark / --mtp, the
drafters shipped with specc for SmolLM2 are used. Compiled engines are reused by directory name
(after changing the compiler, use a new --engines). Prints the run; writes it (under History, newest first, Current figures
regenerated) only with --write.
"""
import argparse
import sys
from pathlib import Path

import specc
from specc.models import quiet_libraries
from specc import benchfile, harness
from specc.bench import drafter_label, run_bench
from specc.shipped import shipped_drafter, training_summary


def parse_config(item: str):
    """KIND[@BLOCK]=TREE[+ngramK], e.g. dflash@4=chain:3, dflash=sequoia:8, dspark=topk:3,2, mtp=chain:1,
    dspark=sequoia:8+ngram4 (a hybrid tree: --ngram-branch 4)."""
    head, eq, rest = item.partition("=")
    tree, plus, branch = rest.partition("+ngram")
    kind, at, block = head.partition("@")
    if (kind not in ("dflash", "dspark", "mtp") or not eq or not tree or (at and not block.isdigit()) or (at and kind == "mtp")
            or (plus and not branch.isdigit())):
        raise SystemExit(f"config {item!r}: use dflash[@BLOCK]=TREE, dspark[@BLOCK]=TREE or mtp=TREE (TREE as for --tree), "
                         f"optionally +ngramK for a hybrid tree")
    return kind, int(block) if at else None, tree, int(branch) if plus else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.bench_args(ap, limit=5, max_new_tokens=256)
    ap.add_argument("--dflash", help="a DFlash drafter for SmolLM2 (default: the shipped one)")
    ap.add_argument("--dspark", help="a DSpark drafter for SmolLM2 (default: the shipped one)")
    ap.add_argument("--mtp", help="MTP heads for SmolLM2 (default: the shipped ones)")
    ap.add_argument("--configs", default="dflash@4=chain:3,dflash@8=chain:7,dflash@16=chain:15,"
                                         "mtp=chain:1,mtp=chain:2,mtp=chain:3,mtp=chain:4")
    ap.add_argument("--datasets", default="humaneval,mt-bench")
    ap.add_argument("--engines", default="engines/bench-drafters")
    a = ap.parse_args()
    cmd = benchfile.command_line()
    configs = [parse_config(c) for c in a.configs.split(",")]
    paths = {"dflash": a.dflash, "dspark": a.dspark, "mtp": a.mtp}

    engines = []
    for kind, block, tree, branch in configs:
        tree_name = Path(tree).stem if tree.endswith(".json") else tree.replace(":", "")
        name = f"{kind}{f'-b{block}' if block else ''}-{tree_name}{f'-ngram{branch}' if branch else ''}"
        path = Path(a.engines) / name
        if not (path / "specc.json").is_file():  # reused by directory name: after changing the compiler, use new --engines
            specc.compile(None, drafter=kind, drafter_path=paths[kind], block_size=block, tree=tree, ngram_branch=branch,
                          backend="inductor", output_dir=path, max_len=1024, progress=not a.json, modes="greedy")
        engines.append(path)

    lines, figures = [], []
    for kind in dict.fromkeys(k for k, *_ in configs):
        summary = training_summary(paths[kind] or shipped_drafter(kind))
        if summary:
            lines.append(f"{kind} drafter: trained {summary['step']} steps on {summary['sequences']} sequences; held-out "
                         f"tau at training's end (ShareGPT, teacher-forced, greedy): "
                         + ", ".join(f"{k} {v}" for k, v in summary["eval"].items() if k.startswith("tau")) + ".\n")
    for ds in a.datasets.split(","):
        reports = [run_bench(p, dataset=ds, limit=a.limit, max_new_tokens=a.max_new_tokens,
                             baseline="both" if i == 0 else "ar", command=cmd, progress=not a.json)
                   for i, p in enumerate(engines)]
        hf = next(r for r in reports[0]["rows"] if r["method"] == "hf")
        figures.append(benchfile.figure(benchfile.HF, ds, model=reports[0]["model"], tokens_per_s=hf["tokens_per_s"],
                                        vs_hf=1.0, new_tokens=a.max_new_tokens, prompts=hf["prompts"]))
        lines += [f"#### {ds} ({reports[0]['prompts']} prompts)\n",
                  "| method | tau | tokens/s (median) | plain tokens/s (same run) | vs plain | vs HF generate() |",
                  "|---|---|---|---|---|---|",
                  f"| HF generate() | - | {hf['tokens_per_s']:.2f} | - | - | 1.00x |"]
        for rep in reports:
            by = {r["method"]: r for r in rep["rows"]}
            s, p = by["speculative"], by["ar"]
            lines.append(f"| {drafter_label(rep)} | {s['tau']:.2f} | {s['tokens_per_s']:.2f} | {p['tokens_per_s']:.2f} | "
                         f"{s['speedup_vs_ar']:.2f}x | {s['tokens_per_s'] / hf['tokens_per_s']:.2f}x |")
            figures.append(benchfile.figure(rep["config"], ds, model=rep["model"], tau=s["tau"],
                                            tokens_per_s=s["tokens_per_s"], vs_plain=s["speedup_vs_ar"],
                                            vs_hf=s["tokens_per_s"] / hf["tokens_per_s"],
                                            new_tokens=a.max_new_tokens, prompts=s["prompts"]))
        lines.append("")
        for rep in reports:
            s = next(r for r in rep["rows"] if r["method"] == "speculative")
            lookup = (f" prompt lookup's continuation was in the tree on {s['lookup_steps']} of {s['steps']} steps and "
                      f"the accepted path went through it on {s['lookup_accepted']};" if "lookup_steps" in s else "")
            lines.append(f"{drafter_label(rep)}: accepted drafts per step (0, 1, 2, ...) {rep['accepted_hist']};{lookup} "
                         f"greedy output identical to plain decoding on {rep['greedy_identical_to_ar']} prompts.")
        lines.append("")
    setup = (f"SmolLM2-135M-Instruct, fp32, inductor backend, greedy, {a.max_new_tokens} new tokens per prompt, first "
             f"{a.limit} prompts of each set, chat template on, EOS ignored; warm-up excluded; medians over prompts. "
             f"Every speculative row ran side by side with plain decoding through the same engine; HF generate() ran "
             f"once per set, beside the first row.")
    return harness.record(a, "Trained drafters", setup, "\n".join(lines), figures, command=cmd)


if __name__ == "__main__":
    quiet_libraries()
    sys.exit(main())
