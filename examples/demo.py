"""`make demo`: compile the embedded SmolLM2-135M-Instruct with a drafter, generate, and compare
with plain decoding through the same backend.

The first run compiles the graphs with AOTInductor (a few minutes on 2 cores); later runs reuse
the compile cache in ~/.cache/specc and take seconds.
"""
import argparse
import sys
import time

import specc

PROMPT = '''Add a docstring to this function and return the whole function.

def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--drafter", default="dflash", help="dflash (default) and mtp use the drafters shipped for SmolLM2")
    ap.add_argument("--tree", default=None, help="default: chain:3 for dflash, else the drafter's default chain")
    ap.add_argument("--block-size", type=int, default=None,
                    help="dflash run-time block (default 4: the fastest measured on 2 CPU cores, BENCHMARKS.md)")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("-o", "--output", default="engines/demo")
    a = ap.parse_args()

    t0 = time.perf_counter()
    if a.drafter == "dflash":
        a.block_size, a.tree = a.block_size or 4, a.tree or "chain:3"
    path = specc.compile(None, drafter=a.drafter, tree=a.tree, backend=a.backend, output_dir=a.output, max_len=1024,
                         block_size=a.block_size)
    print(f"compiled in {time.perf_counter() - t0:.0f} s -> {path}", file=sys.stderr)
    engine = specc.load(path)
    engine.generate(PROMPT, max_new_tokens=8, chat=True)  # warm-up
    engine.generate(PROMPT, max_new_tokens=8, chat=True, speculate=False)

    spec = engine.generate(PROMPT, max_new_tokens=a.max_new_tokens, chat=True)
    plain = engine.generate(PROMPT, max_new_tokens=a.max_new_tokens, chat=True, speculate=False)
    print(spec.text)
    print()
    print(f"drafter {a.drafter} ({engine.manifest['tree']['spec']}), backend {a.backend}")
    print(f"tau          {spec.stats.tau:.2f} tokens per verify step")
    print(f"speculative  {spec.stats.tokens_per_s:.1f} tokens/s ({spec.stats.new_tokens} tokens)")
    print(f"plain        {plain.stats.tokens_per_s:.1f} tokens/s")
    print(f"speedup      {spec.stats.tokens_per_s / plain.stats.tokens_per_s:.2f}x")
    print(f"lossless     {'identical tokens' if spec.token_ids == plain.token_ids else 'MISMATCH'}")
    return 0 if spec.token_ids == plain.token_ids else 1


if __name__ == "__main__":
    from specc.cli import _quiet_libraries

    _quiet_libraries()
    sys.exit(main())
