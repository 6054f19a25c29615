"""The backends side by side on SmolLM2 (BENCHMARKS.md): eager, inductor and onnx engines of one
configuration, plain and speculative decoding, in one run.

Each prompt runs on every backend back to back, --rounds times, the backend order rotated every
round, so the backends see the same machine state. Figures: median tokens/s over prompt runs
(prefill included), median decode ms per step (prefill excluded), tau, the cost of a step relative
to plain decoding through the same backend (c(T)), and whether every backend gave the same tokens.

Usage: python examples/bench_backends.py [--backends eager,inductor,onnx] [--drafter ngram] [--tree chain:4]
           [--limit 4] [--rounds 2] [--max-new-tokens 128] [--dataset mt-bench] [--engines DIR] [--max-len 512]
           [--write BENCHMARKS.md] [--json]
Prints the run; writes it (under History, newest first, Current figures regenerated) only with --write.
"""
import argparse
import sys

import specc
from specc import benchfile, harness
from specc.data import load_prompts
from specc.models import quiet_libraries


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.bench_args(ap, limit=4, max_new_tokens=128, rounds=2)
    ap.add_argument("--backends", default="eager,inductor,onnx")
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--tree", default="chain:4")
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--engines", default="engines/bench-backends")
    ap.add_argument("--max-len", type=int, default=512)
    a = ap.parse_args()
    cmd = benchfile.command_line()
    backends = a.backends.split(",")
    engines = {}
    for b in backends:
        path = specc.compile(None, drafter=a.drafter, tree=a.tree, backend=b, output_dir=f"{a.engines}/{b}",
                             max_len=a.max_len, progress=not a.json, modes="greedy")
        engines[b] = specc.load(path)
    ids = [engines[backends[0]].encode(p, chat=True) for p in load_prompts(a.dataset, a.limit)]

    def run(b, job):  # one backend: plain, then speculative decoding of the prompt
        x, n = job
        return {mode: engines[b].generate(x, max_new_tokens=n, stop_at_eos=False, speculate=mode == "spec")
                for mode in ("plain", "spec")}

    res = harness.paired({b: (lambda job, b=b: run(b, job)) for b in backends}, a.rounds,
                         items=[(x, a.max_new_tokens) for x in ids], warm=(ids[0], 8))
    fields = {"tps": lambda r: r.stats.tokens_per_s, "ms": lambda r: harness.decode_ms_per_step(r.stats),
              "tau": lambda r: r.stats.tau}
    med = {(b, m): {f: harness.median(harness.values(res[b], key=lambda out, m=m, get=get: get(out[m])))
                    for f, get in fields.items()} for b in backends for m in ("plain", "spec")}
    runs = zip(*(harness.values(res[b]) for b in backends))  # each prompt run: every backend's outputs
    differ = sum(len({tuple(out[m].token_ids) for out in outs for m in out}) > 1 for outs in runs)
    base = med[(backends[0], "plain")]["tps"]
    lines = [f"| backend | plain tokens/s | plain ms/step | {a.drafter} {a.tree} tokens/s | ms/step | tau | "
             f"c(T) | speedup vs its plain | tokens/s vs {backends[0]} plain |", "|---|---|---|---|---|---|---|---|---|"]
    figures = []
    for b in backends:
        p, s = med[(b, "plain")], med[(b, "spec")]
        lines.append(f"| {b} | {p['tps']:.1f} | {p['ms']:.2f} | {s['tps']:.1f} | {s['ms']:.2f} | {s['tau']:.2f} | "
                     f"{s['ms'] / p['ms']:.2f} | {s['tps'] / p['tps']:.2f}x | {s['tps'] / base:.2f}x |")
        n = len(ids)
        figures.append(benchfile.figure(f"plain decoding, {b} backend", a.dataset, model="SmolLM2-135M-Instruct",
                                        tau=1.0, tokens_per_s=p["tps"], vs_plain=1.0, new_tokens=a.max_new_tokens,
                                        prompts=n))
        figures.append(benchfile.figure(f"{a.drafter} {a.tree}, {b} backend", a.dataset,
                                        model="SmolLM2-135M-Instruct", tau=s["tau"], tokens_per_s=s["tps"],
                                        vs_plain=s["tps"] / p["tps"], new_tokens=a.max_new_tokens, prompts=n))
    fastest = max(backends, key=lambda b: med[(b, "spec")]["tps"])
    fastest_plain = min(backends, key=lambda b: med[(b, "plain")]["ms"])
    lines += ["", f"Fastest here: {fastest} for {a.drafter} {a.tree}, {fastest_plain} for plain decoding (decode "
                  f"ms/step). Same tokens on every backend: {len(ids) * a.rounds - differ}/{len(ids) * a.rounds} "
                  f"prompt runs."]
    setup = (f"SmolLM2-135M-Instruct, fp32, greedy, first {len(ids)} {a.dataset} prompts (chat template) x "
             f"{a.max_new_tokens} new tokens x {a.rounds} rounds, backends interleaved per prompt (order rotated "
             f"each round), EOS ignored, warm-up excluded; medians over prompt runs; tokens/s includes prefill, "
             f"ms/step excludes it; c(T) = speculative ms/step / plain ms/step on the same backend.")
    return harness.record(a, "Backends side by side", setup, "\n".join(lines), figures, command=cmd)


if __name__ == "__main__":
    quiet_libraries()
    sys.exit(main())
