"""Two engine directories side by side: paired decode time per step on the same prompts (BENCHMARKS.md).

For comparing builds of one engine (before and after a compiler change). Each prompt runs on A
and B back to back, --rounds times, the order swapped every round; the figure is the median over
the pairs of A / B decode ms per step (prefill excluded), with the share of pairs B won.

Usage: python examples/bench_engines_ab.py A_DIR B_DIR [--plain] [--limit 4] [--rounds 3]
           [--max-new-tokens 128] [--dataset mt-bench]
"""
import argparse
import statistics
import sys

import specc
from specc.data import load_prompts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--plain", action="store_true", help="plain decoding through each engine (no drafts)")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dataset", default="mt-bench")
    args = ap.parse_args()
    engines = {"A": specc.load(args.a), "B": specc.load(args.b)}
    ids = [engines["B"].encode(p, chat=True) for p in load_prompts(args.dataset, args.limit)]

    def run(name, x, n):
        return engines[name].generate(x, max_new_tokens=n, speculate=not args.plain, stop_at_eos=False)

    for name in engines:  # warm-up
        run(name, ids[0], 8)
    ms, same = {"A": [], "B": []}, 0
    for rnd in range(args.rounds):
        for x in ids:
            outs = {}
            for name in ("A", "B") if rnd % 2 == 0 else ("B", "A"):
                r = run(name, x, args.max_new_tokens)
                ms[name].append(1000 * (r.stats.wall_s - r.stats.prefill_s) / r.stats.steps)
                outs[name] = r.token_ids
            same += outs["A"] == outs["B"]
    ratios = [a / b for a, b in zip(ms["A"], ms["B"])]
    print(f"decode ms/step ({'plain' if args.plain else 'speculative'}): A {statistics.median(ms['A']):.2f}, "
          f"B {statistics.median(ms['B']):.2f}; B speedup (median of {len(ratios)} pairs) "
          f"{statistics.median(ratios):.3f}x, B faster in {sum(r > 1 for r in ratios)}/{len(ratios)}; "
          f"identical tokens in {same}/{len(ratios)}")
    return 0


if __name__ == "__main__":
    from specc.cli import _quiet_libraries

    _quiet_libraries()
    sys.exit(main())
