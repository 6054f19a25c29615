"""How long `specc compile` takes on SmolLM2: whole compiles of one configuration, timed in this process.

Each round compiles into a fresh directory (the Inductor cache stays warm after the first round, so
the inductor backend's later rounds time specc's own work: capture, passes and packaging). Prints
seconds per round and the median, and the machine (its CPU's instruction set: compile time is compute-bound);
the figure to compare is two commits' medians on one machine.

Usage: python examples/bench_compile.py [--backend eager] [--drafter ngram] [--tree topk:3,2]
           [--modes greedy] [--rounds 3] [--json]
"""
import argparse
import itertools
import json
import shutil
import tempfile

import torch

import specc
from specc import harness
from specc.models import quiet_libraries


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="eager")
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--tree", default="topk:3,2")
    ap.add_argument("--modes", default="greedy")
    harness.bench_args(ap, rounds=3, write=False)
    a = ap.parse_args()
    quiet_libraries()
    with tempfile.TemporaryDirectory() as tmp:
        rounds = itertools.count(1)

        def compile_once() -> tuple[float, int]:  # one round: seconds, graphs
            r = next(rounds)
            out = f"{tmp}/engine-{r}"
            path, seconds = harness.clock(specc.compile, None, drafter=a.drafter, tree=a.tree, backend=a.backend,
                                          output_dir=out, max_len=512, modes=a.modes, progress=False)
            graphs = len(json.loads((path / "specc.json").read_text())["graphs"])
            shutil.rmtree(out)
            if not a.json:
                print(f"round {r}: {seconds:.1f} s ({graphs} graphs)", flush=True)
            return seconds, graphs

        runs = harness.values(harness.paired({"compile": compile_once}, a.rounds, warmup=0)["compile"])
    seconds, graphs = [s for s, _ in runs], runs[-1][1]
    result = {"backend": a.backend, "drafter": a.drafter, "tree": a.tree, "modes": a.modes, "graphs": graphs,
              "seconds": [round(s, 2) for s in seconds], "median_s": round(harness.median(seconds), 2),
              "torch_threads": torch.get_num_threads(), "machine": harness.machine_note()}
    print(json.dumps(result) if a.json else f"median {result['median_s']} s over {a.rounds} rounds, {graphs} graphs, "
          f"{a.backend} {a.drafter} {a.tree} modes {a.modes}, {result['torch_threads']} torch threads; "
          f"machine: {result['machine']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
