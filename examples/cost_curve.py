"""The cost curve of specc's step graphs on this machine: c(T) = t(T) / t(1), side by side per backend.

    python examples/cost_curve.py [--backends inductor,onnx] [--Ts 1,2,4,8,16] [--context 256]
        [--calls 40] [--rounds 3] [--engines DIR] [--baseline DIR] [--json] [--write BENCHMARKS.md]

Speculative decoding gains tau / c(T): a step that verifies T tokens must cost little more than a plain
step. For each backend and each T > 1 this compiles an engine whose step graph verifies a chain of T
tokens (the ngram drafter: no drafter graphs, so the step graph is the target's alone) and times that
graph against the same engine's plain graph (T = 1) on SmolLM2 with the cache filled to --context
tokens. Every round times each backend and T in turn (one backend's engines loaded at a time; the
backends' order rotated round by round), so slow drift of the machine falls on all alike; figures are medians over calls. Compiled engines are
kept under --engines and reused by later runs by their directory name alone: after changing a pass or
a backend, give a new --engines directory.

Before and after a change, side by side: compile the baseline's engines with the earlier code (e.g. in a
`git worktree` of the previous commit, `PYTHONPATH=<worktree> python <worktree>/examples/cost_curve.py
--engines DIR_A`), then run this checkout's script with `--baseline DIR_A`: each round times those
engines too, rows labelled "(baseline)", with this checkout's runtime. With an editable install,
`specc.passes` and `specc.kernels` resolve to this checkout's folders whatever PYTHONPATH says: link
them into the worktree first (`ln -s ../passes <worktree>/specc/passes`, the same for kernels).
"""
import argparse
import gc
import sys
from pathlib import Path

import torch

import specc
from specc import benchfile, harness
from specc.errors import SpeccError
from specc.data import load_prompts


def engine_for(backend: str, T: int, root: str, max_len: int, progress: bool, build: bool = True):
    tree = f"chain:{max(T - 1, 1)}"  # T = 1 times the plain graph of a chain:1 engine
    out = Path(root) / f"{backend}-{tree.replace(':', '')}-{max_len}"
    if not (out / "specc.json").exists():  # else compiled by an earlier run: reuse it
        if not build:
            raise SpeccError(f"no baseline engine at {out}: compile it with the baseline's code first.")
        specc.compile(None, drafter="ngram", tree=tree, backend=backend, output_dir=str(out), max_len=max_len,
                      progress=progress, modes="greedy")
    return specc.load(out)


def caller(engine, T: int, context_ids: list[int]):
    """A function making one call of the graph that verifies T tokens, on a cache holding context_ids."""
    engine.generate(context_ids, max_new_tokens=2, stop_at_eos=False)  # prefill: the cache holds the context
    graph = engine.graphs["plain_greedy" if T == 1 else "step_greedy"]
    tokens, base = torch.tensor(context_ids[-T:]), torch.tensor(len(context_ids))

    def call():
        graph(tokens, base)[0].tolist()  # the report read: what the runtime waits for
    return call


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="inductor,onnx")
    ap.add_argument("--Ts", default="1,2,4,8,16")
    ap.add_argument("--context", type=int, default=256)
    harness.bench_args(ap, rounds=3, calls=40, calls_help="calls per T per round")
    ap.add_argument("--engines", default="engines/cost-curve")
    ap.add_argument("--baseline", metavar="DIR", help="engines compiled by earlier code, timed alongside")
    ap.add_argument("--max-len", type=int, default=512)
    a = ap.parse_args()
    Ts = sorted({int(t) for t in a.Ts.split(",")} | {1})
    if Ts[0] < 1 or a.context + max(Ts) >= a.max_len:
        print("error: --Ts must be positive, --context + T must fit --max-len.", file=sys.stderr)
        return 2
    cmd = benchfile.command_line()
    backends = a.backends.split(",")
    # (label, backend, engines directory, build if missing)
    sets = [(b, b, a.engines, True) for b in backends]
    sets += [(f"{b} (baseline)", b, a.baseline, False) for b in backends] if a.baseline else []
    try:
        for _, b, root, build in sets:  # compile what is missing first
            for T in Ts:
                engine_for(b, T, root, a.max_len, not a.json, build)
    except SpeccError as e:  # e.g. an unknown backend: one sentence, as the CLI says it
        print(f"error: {e}", file=sys.stderr)
        return 2
    ids = []
    tok = engine_for(backends[0], 1, a.engines, a.max_len, False)
    for p in load_prompts("mt-bench", None):  # a real context: prompts joined to --context tokens
        ids += tok.encode(p, chat=True)
        if len(ids) >= a.context:
            break
    ids = ids[: a.context]
    del tok

    # One backend's engines in memory at a time (each holds its own weights and caches); every round
    # loads each backend's again and times all its Ts in turn.
    def time_set(b: str, root: str) -> dict[int, list[float]]:
        calls = {T: caller(engine_for(b, T, root, a.max_len, False), T, ids) for T in Ts}
        harness.warm_up(calls, times=3)
        out = {T: [1000 * s for s in harness.call_times(fn, a.calls)] for T, fn in calls.items()}
        del calls
        gc.collect()
        return out

    res = harness.paired({label: (lambda b=b, root=root: time_set(b, root)) for label, b, root, _ in sets}, a.rounds,
                         warmup=0)
    med = {(label, T): harness.median(t for out in harness.values(res[label]) for t in out[T])
           for label, *_ in sets for T in Ts}
    labels = [label for label, *_ in sets]
    rows = [{"backend": b, "T": T, "ms": round(med[(b, T)], 3), "c": round(med[(b, T)] / med[(b, 1)], 3)}
            for b in labels for T in Ts]
    setup = (f"SmolLM2-135M-Instruct, fp32, greedy step graphs verifying a chain of T tokens (T = 1: the plain "
             f"graph), cache filled to {a.context} tokens, {a.calls} calls per T per round x {a.rounds} rounds, "
             f"medians; c(T) = t(T) / t(1) on the same backend.")
    lines = ["| backend | " + " | ".join(f"T={T} ms (c)" for T in Ts) + " |", "|---|" + "---|" * len(Ts)]
    for b in labels:
        cells = [f"{med[(b, T)]:.1f} ({med[(b, T)] / med[(b, 1)]:.2f})" for T in Ts]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return harness.record(a, "Cost curve of the step graphs", setup, "\n".join(lines), command=cmd, cost_curve=rows)


if __name__ == "__main__":
    sys.exit(main())
