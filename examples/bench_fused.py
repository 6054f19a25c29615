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
import sys

import torch

import specc
from specc.models import quiet_libraries
from specc import benchfile, harness
from specc.bench import engine_label
from specc.data import load_prompts
from specc.prefill import tap_rows
from specc.signature import split_report


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

    # one call of each a round, the order swapped every round; the first 5 rounds warm up
    arms = {name: (lambda fn=fn: 1000 * harness.clock(fn)[1]) for name, fn in (("fused", fused), ("unfused", unfused))}
    med = harness.medians(harness.paired(arms, calls, warmup=0, warmup_rounds=5))
    return med["fused"], med["unfused"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.bench_args(ap, limit=8, max_new_tokens=128, rounds=3, calls=200,
                       calls_help="step calls of each kind, alternating, for the step-call figures")
    ap.add_argument("--configs", default="dflash=chain:3,mtp=chain:1")
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

        def run(mode, job):
            x, n = job
            engine.use_fused = mode == "fused"
            return engine.generate(x, max_new_tokens=n, speculate=mode != "plain", stop_at_eos=False)

        arms = {mode: (lambda job, mode=mode: run(mode, job)) for mode in ("fused", "unfused", "plain")}
        harness.warm_up(arms, (ids[0], 8))
        ms = {"fused": [], "unfused": []}
        ratios, tps, plain_tps, tau, same = [], [], [], [], 0
        for x in ids:  # per prompt: fused and unfused paired --rounds times, then plain once
            res = harness.paired({m: arms[m] for m in ms}, a.rounds, items=[(x, a.max_new_tokens)], warmup=0)
            pair = {m: harness.values(res[m], key=lambda r: harness.decode_ms_per_step(r.stats)) for m in ms}
            for m in ms:
                ms[m] += pair[m]
            ratios += harness.ratios(pair["unfused"], pair["fused"])
            tps += harness.values(res["fused"], key=lambda r: r.stats.tokens_per_s)
            tau += harness.values(res["fused"], key=lambda r: r.stats.tau)
            r = run("plain", (x, a.max_new_tokens))
            plain_tps.append(r.stats.tokens_per_s)
            same += res["fused"][-1][0].token_ids == res["unfused"][-1][0].token_ids == r.token_ids
        med = harness.median
        faster = sum(q > 1 for q in ratios)
        call_f, call_u = step_calls(engine, ids[0], a.calls)
        lines.append(f"| {kind} | {tree} | {med(ms['fused']):.2f} | {med(ms['unfused']):.2f} | {med(ratios):.3f}x "
                     f"| {faster}/{len(ratios)} | {call_f:.2f} | {call_u:.2f} | {call_u / call_f:.3f}x "
                     f"| {med(tps):.2f} | {med(plain_tps):.2f} | "
                     f"{med(tps) / med(plain_tps):.2f}x | {med(tau):.2f} | {same}/{len(ids)} |")
        print(lines[-1], file=sys.stderr, flush=True)
        # The fused step is what an engine runs by default, so its figures are the configuration's.
        figures.append(benchfile.figure(engine_label(engine.manifest), a.dataset,
                                        model=engine.manifest.target.name, tau=med(tau), tokens_per_s=med(tps),
                                        vs_plain=med(tps) / med(plain_tps),
                                        new_tokens=a.max_new_tokens, prompts=len(ids),
                                        note=f"median of {len(tps)} runs, fused step"))
    setup = (f"SmolLM2-135M-Instruct with the shipped drafters, fp32, inductor, greedy, {a.max_new_tokens} new tokens, "
             f"first {a.limit} {a.dataset} prompts (chat template), EOS ignored, warm-up excluded. Each prompt runs "
             f"fused and unfused back to back {a.rounds} times (order swapped each round), then plain. Speedup: median "
             f"over the {a.limit * a.rounds} pairs of unfused / fused decode ms per step (prefill excluded).")
    return harness.record(a, "Fused decode step vs unfused", setup, "\n".join(lines), figures)


if __name__ == "__main__":
    quiet_libraries()
    sys.exit(main())
