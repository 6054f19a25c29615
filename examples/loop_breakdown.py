"""Where a generation's time goes: plain decoding against an engine's speculative decoding, in the loop.

    python examples/loop_breakdown.py ENGINE [--datasets humaneval,mt-bench] [--limit 10]
                                      [--max-new-tokens 128] [--rounds 2] [--write BENCHMARKS.md] [--json]

Each prompt runs plain (the engine's plain graph) and speculative decoding back to back, --rounds
times, the order rotated every round. Every graph call and every call of the drafter's host methods
is timed where it happens, so the split is the loop's own, not a replay: prefill (the chunk graph and
its one-token tail: every graph call inside prefill), each decode graph (calls, median milliseconds per
call), the drafter's work outside them (its host code, and the graphs of a drafter that has its own),
and the rest of the runtime (acceptance bookkeeping, commits, Python). Reported per method: the whole
generate() time summed over prompts and rounds, each part's share of it, and the in-loop cost of each
decode graph against the plain graph's median call in plain decoding (c). "speedup" divides the plain
wall time by the speculative one; "decode only" leaves prefill out of both.
EOS does not stop generation (both methods produce the same number of tokens).
"""
import argparse
import sys
import time
from collections import defaultdict

import specc
import specc.runtime
from specc import harness
from specc.data import load_prompts
from specc.errors import SpeccError
from specc.models import quiet_libraries

DRAFTER_METHODS = ("start", "propose", "confidences", "accepted", "add_rows")


def timed(fn, log: list):
    def call(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        log.append(time.perf_counter() - t0)
        return out
    return call


def instrument(engine) -> dict:
    """Wrap the engine's graphs and its drafter's host methods with timers, and the runtime's prefill
    (whose one-token tail runs the plain graph: those calls count as prefill); the logs by name."""
    logs = defaultdict(list)
    in_prefill = [False]

    def graph_timer(name, fn):
        def call(*args):
            t0 = time.perf_counter()
            out = fn(*args)
            logs["graph:prefill" if in_prefill[0] else f"graph:{name}"].append(time.perf_counter() - t0)
            return out
        return call

    def prefill(*args, **kwargs):
        in_prefill[0] = True
        try:
            return run_prefill(*args, **kwargs)
        finally:
            in_prefill[0] = False

    run_prefill, specc.runtime.prefill = specc.runtime.prefill, prefill
    engine.graphs = {name: graph_timer(name, fn) for name, fn in engine.graphs.items()}
    if engine.drafter is not None:
        for name in DRAFTER_METHODS:
            if hasattr(engine.drafter, name):
                setattr(engine.drafter, name, timed(getattr(engine.drafter, name), logs["drafter"]))
    return logs


def measure(engine, logs, prompts, new_tokens: int, rounds: int) -> dict:
    """Per method: wall seconds, seconds per part, calls and per-call times of each graph, tokens, steps.
    A warm-up generation of each first; the two methods alternate by round and prompt."""
    def method(name: str):
        def call(job):  # one generation: its result, wall seconds, and the timers' logs of it
            ids, n = job
            for log in logs.values():
                log.clear()
            res, wall = harness.clock(engine.generate, ids, max_new_tokens=n, speculate=name == "speculative",
                                      stop_at_eos=False)
            return res, wall, {k: list(v) for k, v in logs.items()}
        return call

    runs = harness.paired({m: method(m) for m in ("plain", "speculative")}, rounds,
                          items=[(ids, new_tokens) for ids in prompts], warm=(prompts[0], 8), stagger=True)
    out = {m: {"wall": 0.0, "parts": defaultdict(float), "calls": defaultdict(list), "tokens": 0, "steps": 0}
           for m in runs}
    for method, per_round in runs.items():
        m = out[method]
        for res, wall, snapshot in harness.values(per_round):
            m["wall"] += wall
            m["tokens"] += len(res.token_ids)
            m["steps"] += res.stats.steps
            spent = 0.0
            for name, log in snapshot.items():
                part = "prefill" if name == "graph:prefill" else name
                m["parts"][part] += sum(log)
                spent += sum(log)
                if name.startswith("graph:") and name != "graph:prefill" and log:
                    m["calls"][name[len("graph:"):]].extend(log)
            m["parts"]["runtime (rest)"] += wall - spent
    return out


def report(dataset: str, out: dict, n_prompts: int, lines: list[str]) -> dict:
    """The dataset's tables, appended to `lines`; its figures as a dict."""
    plain_call = harness.median(out["plain"]["calls"].get("plain_greedy") or [float("nan")])
    rows = {}
    for method, m in out.items():
        graphs = {name: {"calls": len(ts), "ms": round(harness.median(ts) * 1000, 2),
                         "c": round(harness.median(ts) / plain_call, 2)}
                  for name, ts in sorted(m["calls"].items(), key=lambda kv: -len(kv[1]))}
        rows[method] = {"wall_s": round(m["wall"], 3), "tokens": m["tokens"], "steps": m["steps"],
                        "tau": round(m["tokens"] / max(m["steps"], 1), 3),
                        "parts_s": {k: round(v, 3) for k, v in m["parts"].items()}, "graphs": graphs}
    p, s = out["plain"], out["speculative"]
    speedup = p["wall"] / s["wall"]
    decode_only = (p["wall"] - p["parts"]["prefill"]) / (s["wall"] - s["parts"]["prefill"])
    lines += [f"\n#### {dataset} ({n_prompts} prompts)\n",
              f"speedup {speedup:.2f}x (decode only {decode_only:.2f}x); plain graph in plain decoding: "
              f"{plain_call * 1000:.2f} ms a call\n",
              "| method | wall s | tau | prefill | graphs (decode) | drafter | runtime (rest) |",
              "|---|---|---|---|---|---|---|"]
    for method, row in rows.items():
        parts = row["parts_s"]
        decode = sum(v for k, v in parts.items() if k.startswith("graph:"))
        cells = [parts.get("prefill", 0.0), decode, parts.get("drafter", 0.0), parts.get("runtime (rest)", 0.0)]
        lines.append(f"| {method} | {row['wall_s']:.2f} | {row['tau']:.2f} | "
                     + " | ".join(f"{v:.2f} ({v / row['wall_s']:.0%})" for v in cells) + " |")
    lines += ["", "| method | graph | calls | ms a call (median) | c (against plain decoding's plain call) |",
              "|---|---|---|---|---|"]
    for method, row in rows.items():
        for name, g in row["graphs"].items():
            lines.append(f"| {method} | {name} | {g['calls']} | {g['ms']:.2f} | {g['c']:.2f} |")
    return {"dataset": dataset, "prompts": n_prompts, "speedup": round(speedup, 4),
            "decode_only_speedup": round(decode_only, 4), "methods": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine")
    ap.add_argument("--datasets", default="humaneval,mt-bench")
    harness.bench_args(ap, limit=10, max_new_tokens=128, rounds=2)
    a = ap.parse_args()
    quiet_libraries()
    try:
        engine = specc.load(a.engine)
        if not engine.speculates:
            raise SpeccError(f"{a.engine} does not speculate (compiled without a drafter): nothing to compare.")
        if "greedy" not in engine.modes:
            raise SpeccError(f"{a.engine} has no greedy graphs (compile it with --modes greedy).")
        if engine.device.type != "cpu":
            raise SpeccError("this breakdown times calls on the host, which only CPU engines finish before they return.")
        sets = {d: load_prompts(d, a.limit) for d in a.datasets.split(",")}
    except SpeccError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logs = instrument(engine)
    results, lines = [], []
    for dataset, texts in sets.items():
        prompts = [engine.encode(t, chat=True) for t in texts]
        out = measure(engine, logs, prompts, a.max_new_tokens, a.rounds)
        results.append(report(dataset, out, len(prompts), lines))
    setup = (f"Engine {a.engine} ({engine.manifest.target.name}, {engine.manifest.backend}, "
             f"{engine.manifest.dtype}); greedy, {a.max_new_tokens} new tokens per prompt, first {a.limit} "
             f"prompts of each set, chat template on, EOS ignored; each prompt plain and speculative back to "
             f"back, {a.rounds} rounds, the order alternating; times summed over prompts and rounds, per-call "
             f"times medians over every call.")
    return harness.record(a, "Where the time goes", setup, "\n".join(lines), breakdown=results)


if __name__ == "__main__":
    sys.exit(main())
