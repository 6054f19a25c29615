"""The fused decode step against the unfused one, side by side in one run (BENCHMARKS.md).

Fused: one graph call per step (verify, accept, KV compaction, drafter update, next drafts).
Unfused: the same engine's separate target step graph and drafter step graph, with the host
gathering the accepted rows in between. Plain decoding through the same engine runs beside them;
the tokens must be identical.

The difference is small on a CPU (a graph call and a gather, against 20-45 ms of verify), smaller
than the drift between runs, so the design is paired: every prompt runs fused and unfused back to
back, `--rounds` times, with the order swapped every round. The figure is the median over those
pairs of unfused / fused decode time per step (prefill excluded; both paths take the same steps,
since their tokens are identical), with the share of pairs in which fused was faster.

A second measure isolates the step itself: after a prompt's prefill, the fused step (one graph
call) and the unfused step (target step graph, the runtime's gather of the accepted rows, the
drafter's proposal through its own graph) alternate call by call `--calls` times on the same
cache, so slow drift of the machine cancels; medians of the per-call times.

Usage: python examples/bench_fused.py [--configs dflash=chain:3,mtp=chain:1] [--limit 8] [--rounds 3]
           [--calls 200] [--max-new-tokens 128] [--dataset mt-bench] [--write BENCHMARKS.md] [--json]
Prints the run; writes it (under History, newest first, Current figures regenerated) only with --write.

Unlike the other bench scripts this one reaches below the public API, since switching the fused
step off and timing single step calls is what it measures: engine.use_fused, engine.graphs,
engine.drafter, engine.tree and specc.prefill.tap_rows.
"""
import argparse
import statistics
import sys
import time

import torch

import specc
from specc.models import quiet_libraries
from specc import benchfile
from specc.bench import engine_label
from specc.data import load_prompts
from specc.prefill import tap_rows
from specc.signature import split_report


def decode_ms_per_step(r) -> float:
    return 1000 * (r.stats.wall_s - r.stats.prefill_s) / r.stats.steps


def step_calls(engine, ids: list[int], calls: int) -> tuple[float, float]:
    """Median ms of one fused step call and of one unfused step (as the runtime makes them),
    alternating call by call after a prefill of `ids`."""
    engine.generate(ids, max_new_tokens=2, stop_at_eos=False)  # the caches now hold the prompt
    graphs, drafter, T = engine.graphs, engine.drafter, engine.tree.size
    base = len(ids)
    tokens = torch.tensor([ids[-1]] * T)
    args = lambda: (tokens, torch.tensor(base))  # noqa: E731  (greedy graphs: no sampling inputs)

    def fused():
        report, _, tokens = graphs["fused_greedy"](*args())
        return report.tolist(), tokens

    def unfused():
        report, _, _, *taps = graphs["step_greedy"](*args())
        n, path, _ = split_report(report)
        n = int(n)
        drafter.start(ids, "greedy", 0.0, 1.0)  # nothing pending: this step's rows are the ones to flush
        drafter.add_rows(tap_rows(taps, path[: n + 1]), base)
        return drafter.propose(ids + [ids[-1]] * (n + 2))  # a row for every committed token but the last

    times = {fused: [], unfused: []}
    for i in range(calls + 5):
        for fn in ((fused, unfused) if i % 2 == 0 else (unfused, fused)):
            t = time.perf_counter()
            fn()
            if i >= 5:  # the first calls warm up
                times[fn].append(1000 * (time.perf_counter() - t))
    return statistics.median(times[fused]), statistics.median(times[unfused])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benchfile.add_arguments(ap, limit=8, max_new_tokens=128)
    ap.add_argument("--configs", default="dflash=chain:3,mtp=chain:1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--engines", default="engines/bench-fused")
    a = ap.parse_args()
    figures = []
    lines = ["| drafter | tree | decode ms/step fused | decode ms/step unfused | fused speedup (median of pairs) "
             "| pairs fused faster | step call fused (ms) | step call unfused (ms) | step call speedup "
             "| fused tokens/s | plain tokens/s | fused vs plain | tau | identical tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    prompts = load_prompts(a.dataset, a.limit)
    for item in a.configs.split(","):
        kind, _, tree = item.partition("=")
        path = specc.compile(None, drafter=kind, tree=tree, backend="inductor", progress=not a.json,
                             output_dir=f"{a.engines}/{kind}-{tree.replace(':', '').replace(',', '-')}", max_len=1024,
                             modes="greedy")
        engine = specc.load(path)
        ids = [engine.encode(p, chat=True) for p in prompts]

        def run(x, mode, n):
            engine.use_fused = mode == "fused"
            return engine.generate(x, max_new_tokens=n, speculate=mode != "plain", stop_at_eos=False)

        for mode in ("fused", "unfused", "plain"):  # warm-up
            run(ids[0], mode, 8)
        ms = {"fused": [], "unfused": []}
        ratios, tps, plain_tps, tau, same = [], [], [], [], 0
        for x in ids:
            outs = {}
            for rnd in range(a.rounds):
                pair = {}
                for mode in (("fused", "unfused") if rnd % 2 == 0 else ("unfused", "fused")):
                    r = run(x, mode, a.max_new_tokens)
                    pair[mode] = decode_ms_per_step(r)
                    ms[mode].append(pair[mode])
                    outs[mode] = r.token_ids
                    if mode == "fused":
                        tps.append(r.stats.tokens_per_s)
                        tau.append(r.stats.tau)
                ratios.append(pair["unfused"] / pair["fused"])
            r = run(x, "plain", a.max_new_tokens)
            plain_tps.append(r.stats.tokens_per_s)
            same += outs["fused"] == outs["unfused"] == r.token_ids
        med = statistics.median
        faster = sum(q > 1 for q in ratios)
        call_f, call_u = step_calls(engine, ids[0], a.calls)
        lines.append(f"| {kind} | {tree} | {med(ms['fused']):.2f} | {med(ms['unfused']):.2f} | {med(ratios):.3f}x "
                     f"| {faster}/{len(ratios)} | {call_f:.2f} | {call_u:.2f} | {call_u / call_f:.3f}x "
                     f"| {med(tps):.2f} | {med(plain_tps):.2f} | "
                     f"{med(tps) / med(plain_tps):.2f}x | {med(tau):.2f} | {same}/{len(ids)} |")
        print(lines[-1], file=sys.stderr, flush=True)
        # The fused step is what an engine runs by default, so its figures are the configuration's.
        figures.append(benchfile.figure(engine_label(engine.manifest), a.dataset,
                                        model=engine.manifest["target"]["name"], tau=med(tau), tokens_per_s=med(tps),
                                        vs_plain=med(tps) / med(plain_tps),
                                        new_tokens=a.max_new_tokens, prompts=len(ids),
                                        note=f"median of {len(tps)} runs, fused step"))
    setup = (f"SmolLM2-135M-Instruct with the shipped drafters, fp32, inductor, greedy, {a.max_new_tokens} new tokens, "
             f"first {a.limit} {a.dataset} prompts (chat template), EOS ignored, warm-up excluded. Each prompt runs "
             f"fused and unfused back to back {a.rounds} times (order swapped each round), then plain. Speedup: median "
             f"over the {a.limit * a.rounds} pairs of unfused / fused decode ms per step (prefill excluded).")
    return benchfile.finish(a, benchfile.new_run("Fused decode step vs unfused", figures), setup, "\n".join(lines))


if __name__ == "__main__":
    quiet_libraries()
    sys.exit(main())
