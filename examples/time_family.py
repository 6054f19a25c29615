"""Time the step-graph families of adaptive engines side by side: c(T) before and after a compiler change.

    python examples/time_family.py ENGINE [ENGINE ...] [--rounds 3] [--json]

Each ENGINE is a directory written by `specc compile --adaptive`; it holds one step graph per node
count of its tree (plain first). Every round times each engine's whole family in turn
(specc.adaptive.time_family: interleaved calls, medians), the engines' order rotated round by round,
so the engines share the machine's drift; the figure is the median over rounds. The markdown names
the machine (its CPU's instruction set: c(T) differs with it). Engines compiled by earlier code load and run with this
checkout's runtime, which is how a change to a pass is measured against the graphs it replaces.
"""
import argparse
import json
import sys
from pathlib import Path

import specc
from specc import harness
from specc.adaptive import family_sizes, time_family
from specc.errors import SpeccError


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engines", nargs="+", type=Path)
    harness.bench_args(ap, rounds=3, write=False)
    a = ap.parse_args()
    try:
        engines = [specc.load(p) for p in a.engines]
    except SpeccError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not all(e.adaptive for e in engines):
        print("error: every ENGINE must be compiled with --adaptive (it holds the family of step graphs).",
              file=sys.stderr)
        return 2
    res = harness.paired({i: (lambda e=e: time_family(e)) for i, e in enumerate(engines)}, a.rounds, warmup=0)
    rows = []
    for i, (path, engine) in enumerate(zip(a.engines, engines)):
        runs = harness.values(res[i])  # each round's milliseconds per member
        med = [harness.median(r[k] for r in runs) for k in range(len(runs[0]))]
        rows.append({"engine": str(path), "nodes": family_sizes(engine.tree),
                     "ms": [round(m, 2) for m in med], "c": [round(m / med[0], 2) for m in med]})
    if a.json:
        print(json.dumps(rows))
        return 0
    sizes = max((r["nodes"] for r in rows), key=len)
    print("| engine | " + " | ".join(f"{k} nodes ms (c)" for k in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for r in rows:
        cells = [f"{m:.1f} ({c:.2f})" for m, c in zip(r["ms"], r["c"])]
        print(f"| {r['engine']} | " + " | ".join(cells + [""] * (len(sizes) - len(cells))) + " |")
    print(f"\nMachine: {harness.machine_note(str(engines[0].device))}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
