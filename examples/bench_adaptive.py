"""Adaptive verification against the fixed tree and plain decoding, side by side in one run.

For each tree in --trees, one engine per --variant of --drafter (ngram, or dspark: its family is
fused steps chosen from its confidence head): `fixed` (the tree verified whole every step),
`adaptive` (compiled with --adaptive: the tree as a family of step graphs; greedy choices read the
step times measured as it runs), `adaptive-compiled` (the same engine choosing from its compiled
latency table alone), and for ngram the first two with `+lookup` (prompt lookup alone, no corpus
table), all on the same backend. On each prompt set,
each prompt runs plain (through the first engine) and every engine back to back, --rounds times,
the order rotated every round. Figures: per method the median over rounds of the median tokens/s
over prompts (decode and prefill, the whole generate() call), each round's own ratio to plain (the
spread a verdict has on a noisy machine), tau, and how often the adaptive
engines ran each graph of their family (plain: plain decoding, or a resting drafter's plain step). Greedy
outputs are checked identical.

Usage: python examples/bench_adaptive.py [--drafter ngram|dspark] [--block-size B] [--trees chain:4,chain:8]
           [--variants fixed,adaptive,adaptive-compiled,adaptive+lookup]
           [--backend inductor] [--quant none|int8|int4|gguf] [--limit 10] [--max-new-tokens 128] [--rounds 3] [--datasets humaneval,mt-bench]
           [--engines DIR] [--write BENCHMARKS.md] [--json]
A tree may be a JSON file of paths (as for `specc compile --tree`).
Compiled engines are reused by directory name (after changing the compiler, use a new --engines).
Prints the run; writes it (under History, newest first, Current figures regenerated) only with --write.
"""
import argparse
import sys
from pathlib import Path

import specc
from specc import benchfile, harness
from specc.adaptive import MIN_TIMED
from specc.data import load_prompts
from specc.models import quiet_libraries


TITLES = {"ngram": "Adaptive verification", "dspark": "Adaptive verification from DSpark's confidence head"}


def tree_tag(tree: str) -> str:
    return Path(tree).stem if tree.endswith(".json") else tree.replace(":", "")


def engine_dir(root: Path, drafter: str, tree: str, backend: str, variant: str, progress: bool,
               block_size: int | None, quant: str = "none") -> Path:
    """The engine of one variant: `fixed` or `adaptive`, ngram's with `+lookup` for prompt lookup alone
    (no corpus table: --ngram-corpus none); `quant`: the target's --quant."""
    adaptive, lookup_only = variant.startswith("adaptive"), variant.endswith("+lookup")
    out = root / (f"{drafter}-{tree_tag(tree)}-{backend}{'-adaptive' if adaptive else ''}{'-lookup' if lookup_only else ''}"
                  f"{'' if quant == 'none' else '-' + quant}")
    if not (out / "specc.json").is_file():
        specc.compile(None, drafter=drafter, tree=tree, backend=backend, adaptive=adaptive, output_dir=out,
                      max_len=1024, modes="greedy", progress=progress, quant=quant,
                      **({"block_size": block_size} if block_size else {}),
                      **({"ngram_corpus": "none"} if lookup_only else {}))
    return out


def label(drafter: str, tree: str, variant: str, quant: str = "none") -> str:
    words = [drafter, Path(tree).stem if tree.endswith(".json") else tree] + (
        ["adaptive"] if variant.startswith("adaptive") else []) + (
        ["(compiled latencies)"] if variant.endswith("-compiled") else [])
    if drafter == "ngram":
        words.append("(prompt lookup only)" if variant.endswith("+lookup") else "+ ShareGPT table")
    return " ".join(words + ([f"{quant} weights"] if quant != "none" else []))


def graph_order(name: str) -> tuple:
    """plain, step2 .. step, fused1 .. fused: by kind, then by node count (the whole tree last)."""
    digits = name.lstrip("abcdefghijklmnopqrstuvwxyz_")
    return (name != "plain", name.startswith("fused"), int(digits) if digits else 10 ** 6)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.bench_args(ap, limit=10, max_new_tokens=128, rounds=3)
    ap.add_argument("--drafter", default="ngram", choices=("ngram", "dspark"))
    ap.add_argument("--block-size", type=int, default=None, help="dspark: the block length to run")
    ap.add_argument("--trees", default="chain:4,chain:8")
    ap.add_argument("--variants", default="fixed,adaptive",
                    help="per tree: fixed, adaptive; ngram: +lookup for prompt lookup alone (no corpus table)")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--quant", default="none",
                    help="every engine's --quant (plain decoding runs through the first engine: the same weights)")
    ap.add_argument("--datasets", default="humaneval,mt-bench")
    ap.add_argument("--engines", default="engines/bench-adaptive")
    a = ap.parse_args()
    cmd = benchfile.command_line()
    trees = a.trees.split(",")
    engines = {}
    variants = a.variants.split(",")
    if any(v not in ("fixed", "adaptive", "adaptive-compiled", "fixed+lookup", "adaptive+lookup") for v in variants) or (
            a.drafter != "ngram" and any(v.endswith("+lookup") for v in variants)):
        raise SystemExit("--variants takes fixed, adaptive and adaptive-compiled, for ngram also fixed+lookup and "
                         "adaptive+lookup.")
    for tree in trees:
        for variant in variants:
            eng = specc.load(engine_dir(Path(a.engines), a.drafter, tree, a.backend, variant.removesuffix("-compiled"),
                                        not a.json, a.block_size, a.quant))
            eng.time_steps = not variant.endswith("-compiled")
            engines[label(a.drafter, tree, variant, a.quant)] = eng
    plain_engine = next(iter(engines.values()))
    methods = ["plain"] + list(engines)
    model = plain_engine.manifest.target.name

    figures, lines = [], []
    for ds in a.datasets.split(","):
        ids = [plain_engine.encode(p, chat=True) for p in load_prompts(ds, a.limit)]
        ids = [x for x in ids if len(x) + a.max_new_tokens <= plain_engine.max_len]

        def run(method, job):
            x, n = job
            eng = plain_engine if method == "plain" else engines[method]
            return eng.generate(x, max_new_tokens=n, speculate=method != "plain", stop_at_eos=False)

        res = harness.paired({m: (lambda job, m=m: run(m, job)) for m in methods}, a.rounds,
                             items=[(x, a.max_new_tokens) for x in ids], warm=(ids[0], 8))
        tps = {m: harness.round_medians(res[m], key=lambda r: r.stats.tokens_per_s) for m in methods}
        med = {m: harness.median(tps[m]) for m in methods}
        # Each round's own ratio of medians: how far one round's verdict strays from the median's.
        by_round = {m: harness.ratios(tps[m], tps["plain"]) for m in methods}
        first = {m: res[m][0] for m in methods}  # tau, steps by graph and identical tokens: the first round
        tau = {m: [sum(r.stats.new_tokens - 1 for r in first[m]), sum(r.stats.steps for r in first[m])]
               for m in methods}
        chosen = {m: {} for m in methods}
        for m in methods:
            for r in first[m]:
                for k, v in r.stats.graphs.items():
                    chosen[m][k] = chosen[m].get(k, 0) + v
        identical = {m: sum(r.token_ids == p.token_ids for r, p in zip(first[m], first["plain"])) for m in methods}
        lines += [f"#### {ds} ({len(ids)} prompts)\n", "| method | tau | tokens/s (median) | vs plain | vs plain by round "
                  "| steps by graph | greedy identical |", "|---|---|---|---|---|---|---|"]
        for m in methods:
            t = tau[m][0] / tau[m][1] if tau[m][1] else None
            shown = ", ".join(f"{k}: {v}" for k, v in sorted(chosen[m].items(), key=lambda kv: graph_order(kv[0])))
            rounds = " / ".join(f"{v:.2f}x" for v in by_round[m])
            lines.append(f"| {m} | {t:.2f} | {med[m]:.2f} | {med[m] / med['plain']:.2f}x | {rounds} | {shown} | "
                         f"{identical[m]}/{len(ids)} |")
            plain_label = benchfile.PLAIN + (f", {a.quant} weights ({a.backend})" if a.quant != "none" else "")
            figures.append(benchfile.figure(plain_label if m == "plain" else f"{m} ({a.backend})", ds, model=model,
                                            tau=t if m != "plain" else None, tokens_per_s=med[m],
                                            vs_plain=med[m] / med["plain"], new_tokens=a.max_new_tokens,
                                            prompts=len(ids)))
        lines.append("")
        for m, eng in engines.items():
            fam = eng.adaptive
            if fam:
                rest = f"plain with the drafter resting {fam['rest_ms']}, " if "rest_ms" in fam else ""
                lines.append(f"{m}: family latencies (ms, {rest}{', '.join(fam['graphs'])}) {fam['latency_ms']}; "
                             f"rates by confidence bucket "
                             f"{fam['rates']} (seen {fam['seen']}).")
                clock = eng.step_clock()
                if clock is not None:  # what its greedy choices read by the end of this set
                    timed = ([clock.rest_ms] if clock.rest_ms is not None else []) + clock.latency_ms
                    lines.append(f"{m}: step times as measured while it ran, the same order (ms; a member run fewer "
                                 f"than {MIN_TIMED} times: its compiled latency rescaled) {[round(t, 2) for t in timed]}.")
        lines.append("")
    setup = (f"SmolLM2-135M-Instruct, fp32, {a.backend} backend, greedy, {a.max_new_tokens} new tokens per prompt, first "
             f"{a.limit} prompts of each set, chat template on, EOS ignored; warm-up excluded; each prompt runs every "
             f"method back to back, {a.rounds} rounds, order rotated; figure = median over rounds of the median over "
             f"prompts of tokens/s (whole generate() call); tau and steps by graph from the first round.")
    return harness.record(a, TITLES[a.drafter], setup, "\n".join(lines), figures, command=cmd)


if __name__ == "__main__":
    quiet_libraries()
    sys.exit(main())
