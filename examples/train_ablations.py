"""Short drafter-training ablations on one folder of teacher-forced features (issue 14, item 3).

Each configuration is one `specc train` run (resumable: rerunning this script after a stop finishes
the runs, and a finished run only reports), on the same features, steps and held-out sequences, so
the rows differ only in what the configuration says. Prints a markdown table of the held-out
figures (greedy, chain, teacher-forced over regenerated held-out ShareGPT sequences) and each run's
training time.

Usage: python examples/train_ablations.py --features DIR --runs DIR [--steps 600] [--eval-prompts 16]
           [--only NAME,...] [--json]
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# name: (what it tests, `specc train` options)
CONFIGS = {
    "dflash-b8": ("DFlash, 1 layer, block 8 (7 drafts)", ["--drafter", "dflash", "--block-size", "8"]),
    "dspark-b7-r64": ("DSpark, 1 layer, block 7 (7 drafts), Markov rank 64",
                      ["--drafter", "dspark", "--block-size", "7", "--markov-rank", "64"]),
    "mtp-d4": ("MTP, 1 module, depth 4, 256 rows per depth", ["--drafter", "mtp", "--rows", "256"]),
    "mtp-d4-soft05": ("MTP as above, --soft 0.5", ["--drafter", "mtp", "--rows", "256", "--soft", "0.5"]),
    "dflash-b8-soft05": ("DFlash as above, --soft 0.5", ["--drafter", "dflash", "--block-size", "8", "--soft", "0.5"]),
    "dflash-b8-init": ("DFlash as above, --init target",
                       ["--drafter", "dflash", "--block-size", "8", "--init", "target"]),
    "mtp-d4-regress": ("MTP as above, --regress 1.0", ["--drafter", "mtp", "--rows", "256", "--regress", "1.0"]),
    "mtp-d4-init": ("MTP as above, --init target", ["--drafter", "mtp", "--rows", "256", "--init", "target"]),
}


def run(name: str, options: list[str], args) -> dict:
    out = Path(args.runs) / name
    cmd = ["specc", "train", *options, "--features", args.features, "--prompts", "0", "--eval-prompts",
           str(args.eval_prompts), "--steps", str(args.steps), "--eval-every", str(max(1, args.steps // 3)),
           "--checkpoint-every", str(max(1, args.steps // 3)), "--json", "-o", str(out)]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name}: `{' '.join(cmd)}` failed:\n{proc.stderr[-2000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    progress = json.loads((out / "train" / "progress.json").read_text())
    evals = [h for h in progress["history"] if "eval" in h]
    return {"name": name, "command": " ".join(cmd), "eval": res["eval"], "wall_s": round(time.time() - start, 1),
            "train_s": res["train_s"], "curve": [(h["step"], h["eval"]["tau"]) for h in evals]}


def row(name: str, what: str, r: dict) -> str:
    ev = r["eval"]
    acc = " / ".join(f"{x:.3f}" for x in ev["per_position"][:4])
    curve = ", ".join(f"{s}: {t:.3f}" for s, t in r["curve"])
    return (f"| {name} | {what} | {ev['tau']:.3f} | {ev.get('tau_chain2', float('nan')):.3f} | {acc} | {curve} | "
            f"{r['train_s']:.0f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--features", required=True)
    p.add_argument("--runs", required=True, help="a folder for the run directories (one per configuration)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--eval-prompts", type=int, default=16)
    p.add_argument("--only", default=None, help="comma-separated configuration names (default: all)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    names = args.only.split(",") if args.only else list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        sys.exit(f"unknown configuration {unknown[0]!r}; one of {', '.join(CONFIGS)}")
    results = [run(n, CONFIGS[n][1], args) for n in names]
    if args.json:
        print(json.dumps(results))
        return 0
    print("| run | configuration | tau (all drafts) | tau (2 drafts) | accuracy by depth 1-4 | held-out tau by step | "
          "train s |")
    print("|---|---|---|---|---|---|---|")
    for n, r in zip(names, results):
        print(row(n, CONFIGS[n][0], r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
