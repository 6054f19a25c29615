"""How long `specc compile` takes on SmolLM2: whole compiles of one configuration, timed in this process.

Each round compiles into a fresh directory (the Inductor cache stays warm after the first round, so
the inductor backend's later rounds time specc's own work: capture, passes and packaging). Prints
seconds per round and the median; the figure to compare is two commits' medians on one machine.

Usage: python examples/bench_compile.py [--backend eager] [--drafter ngram] [--tree topk:3,2]
           [--modes greedy] [--rounds 3] [--json]
"""
import argparse
import json
import shutil
import statistics
import tempfile
import time

import torch

import specc
from specc.models import quiet_libraries


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="eager")
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--tree", default="topk:3,2")
    ap.add_argument("--modes", default="greedy")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    quiet_libraries()
    seconds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            out = f"{tmp}/engine-{r}"
            start = time.perf_counter()
            path = specc.compile(None, drafter=a.drafter, tree=a.tree, backend=a.backend, output_dir=out,
                                 max_len=512, modes=a.modes, progress=False)
            seconds.append(time.perf_counter() - start)
            graphs = len(json.loads((path / "specc.json").read_text())["graphs"])
            shutil.rmtree(out)
            if not a.json:
                print(f"round {r + 1}: {seconds[-1]:.1f} s ({graphs} graphs)", flush=True)
    result = {"backend": a.backend, "drafter": a.drafter, "tree": a.tree, "modes": a.modes, "graphs": graphs,
              "seconds": [round(s, 2) for s in seconds], "median_s": round(statistics.median(seconds), 2),
              "torch_threads": torch.get_num_threads()}
    print(json.dumps(result) if a.json else f"median {result['median_s']} s over {a.rounds} rounds, {graphs} graphs, "
          f"{a.backend} {a.drafter} {a.tree} modes {a.modes}, {result['torch_threads']} torch threads")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
