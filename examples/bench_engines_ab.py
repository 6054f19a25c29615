"""Two engine directories side by side: paired decode time per step on the same prompts (BENCHMARKS.md).

For comparing builds of one engine (before and after a compiler change). Each prompt runs on A
and B back to back, --rounds times, the order swapped every round; the figure is the median over
the pairs of A / B decode ms per step (prefill excluded), with the share of pairs B won.

Usage: python examples/bench_engines_ab.py A_DIR B_DIR [--plain] [--limit 4] [--rounds 3]
           [--max-new-tokens 128] [--dataset mt-bench] [--write BENCHMARKS.md] [--json]
Prints the run; writes it (under History, newest first) only with --write. Two builds of one
configuration are not two configurations, so the run adds no row to Current figures.
"""
import argparse
import sys

import specc
from specc.models import quiet_libraries
from specc import harness
from specc.data import load_prompts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    harness.bench_args(ap, limit=4, max_new_tokens=128, rounds=3)
    ap.add_argument("--plain", action="store_true", help="plain decoding through each engine (no drafts)")
    ap.add_argument("--dataset", default="mt-bench")
    args = ap.parse_args()
    engines = {"A": specc.load(args.a), "B": specc.load(args.b)}
    ids = [engines["B"].encode(p, chat=True) for p in load_prompts(args.dataset, args.limit)]

    def run(name, job):
        x, n = job
        return engines[name].generate(x, max_new_tokens=n, speculate=not args.plain, stop_at_eos=False)

    res = harness.paired({name: (lambda job, name=name: run(name, job)) for name in engines}, args.rounds,
                         items=[(x, args.max_new_tokens) for x in ids], warm=(ids[0], 8))
    ms = {name: harness.values(res[name], key=lambda r: harness.decode_ms_per_step(r.stats)) for name in engines}
    same = sum(a.token_ids == b.token_ids for a, b in zip(harness.values(res["A"]), harness.values(res["B"])))
    ratios = harness.ratios(ms["A"], ms["B"])
    mode = "plain" if args.plain else "speculative"
    result = {"mode": mode, "a": args.a, "b": args.b, "a_ms_per_step": round(harness.median(ms["A"]), 4),
              "b_ms_per_step": round(harness.median(ms["B"]), 4), "pairs": len(ratios),
              "b_speedup": round(harness.median(ratios), 4), "b_faster": sum(r > 1 for r in ratios),
              "identical": same}
    body = (f"decode ms/step ({mode}): A {result['a_ms_per_step']:.2f}, B {result['b_ms_per_step']:.2f}; B speedup "
            f"(median of {len(ratios)} pairs) {result['b_speedup']:.3f}x, B faster in "
            f"{result['b_faster']}/{len(ratios)}; identical tokens in {same}/{len(ratios)}.\n\n"
            f"A: `{args.a}`; B: `{args.b}`.")
    setup = (f"{mode.capitalize()} decoding through each engine, first {len(ids)} {args.dataset} prompts "
             f"(chat template) x {args.max_new_tokens} new tokens x {args.rounds} rounds, paired, order swapped each "
             f"round, EOS ignored, warm-up excluded; decode ms per step excludes prefill.")
    return harness.record(args, "Two engines paired", setup, body, result=result)


if __name__ == "__main__":
    quiet_libraries()
    sys.exit(main())
