"""`make demo`: compile the embedded SmolLM2-135M-Instruct with the configuration measured fastest,
generate, and compare with plain decoding through the same engine.

The configuration is the row of BENCHMARKS.md's Current figures with the highest speedup over plain
decoding, among those this script can compile with nothing but specc (ngram, or the dflash and mtp
drafters shipped for SmolLM2; inductor backend, greedy). The prompt is the first prompt of the set
that figure was measured on, because a drafter's speed depends on the text: ngram (prompt lookup)
drafts by copying what the context already holds, so it pays on code and repetitive text and
barely on open chat. --drafter and --tree run another configuration instead.

The first run compiles the graphs with AOTInductor (up to about 10 minutes on 2 cores for an
adaptive engine's family of 17 graphs); later runs reuse the compile cache in ~/.cache/specc and
take seconds.
"""
import argparse
import re
import sys
import time
from pathlib import Path

import specc
from specc.models import quiet_libraries
from specc import benchfile, harness
from specc.bench import engine_label
from specc.data import load_prompts

BENCHMARKS = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
# Labels of configurations this script can rebuild: drafter, optional DFlash block, tree, adaptive,
# ngram's corpus table (rows without one were measured before ngram engines had tables: lookup only).
RUNNABLE = re.compile(r"^(ngram|mtp|dflash)(?: B=(\d+))? ((?:chain|sequoia):\d+|topk:\d+,\d+)( adaptive)?"
                      r"( \+ ShareGPT table| \(prompt lookup only\))?(?: \(\d+ nodes\))?(?: \(inductor\))?$")
WHY = {"ngram": "ngram drafts by copying text the context already holds, so it pays on code and repetitive "
                "text, much less on open chat",
       "mtp": "the shipped MTP heads were trained on ShareGPT chat, so they suit chat a little better than code",
       "dflash": "the shipped DFlash drafter was trained on ShareGPT chat, so it suits chat better than code"}


def measured(path: Path) -> list[dict]:
    """The Current-figures rows of BENCHMARKS.md that this script can rebuild and that have a speedup."""
    if not path.is_file():
        return []
    return [f for f in benchfile.current_figures(path.read_text())
            if f["vs_plain"] is not None and f["model"] == "SmolLM2-135M-Instruct" and RUNNABLE.match(f["config"])]


def describe(label: str, backend: str, rows: list[dict], chosen: bool, source: str) -> tuple[dict | None, str]:
    """The figure behind a configuration (its best prompt set) and the line that says why it runs."""
    same = sorted((f for f in rows if f["config"] == label), key=lambda f: -f["vs_plain"])
    if not same:
        return None, f"runs {label} on the {backend} backend: chosen on the command line; {source} has no speedup " \
                     f"figure for it"
    fig = same[0]
    here = benchfile.machine_key(benchfile.machine()) == benchfile.machine_key(fig["machine"])
    where = "this machine" if here else benchfile.machine_key(fig["machine"])
    figures = "; ".join(f"{f['vs_plain']:.2f}x over plain on {f['dataset']}, {f['date']}" for f in same)
    why = f"chosen on the command line, measured on {where}" if chosen else \
        f"the fastest configuration measured on {where}"
    return fig, f"runs {label} on the {backend} backend: {why} ({source}, Current figures: {figures})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default=None, help="ngram | mtp | dflash (default: the fastest in BENCHMARKS.md)")
    ap.add_argument("--tree", default=None, help="with --drafter: chain:K, topk:D,W, sequoia:N (default chain:4)")
    ap.add_argument("--block-size", type=int, default=None, help="with --drafter dflash: the run-time block")
    ap.add_argument("--prompt", default=None, help="default: the first prompt of the set the figure comes from")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: as in the measurement")
    ap.add_argument("--benchmarks", type=Path, default=BENCHMARKS, help="where the measured figures are")
    ap.add_argument("-o", "--output", default="engines/demo")
    a = ap.parse_args()
    if (a.tree or a.block_size) and not a.drafter:
        raise SystemExit("--tree and --block-size go with --drafter.")
    if a.drafter and a.drafter not in WHY:
        raise SystemExit(f"--drafter {a.drafter!r}: this demo runs ngram, mtp or dflash.")

    rows = measured(a.benchmarks)
    chosen = a.drafter is not None
    adaptive, corpus = False, None
    if chosen:
        tree, block = a.tree or "chain:4", a.block_size
    elif rows:
        best = max(rows, key=lambda f: f["vs_plain"])
        a.drafter, block, tree, adaptive, table = RUNNABLE.match(best["config"]).groups()
        adaptive = bool(adaptive)
        corpus = "sharegpt" if table and "ShareGPT" in table else "none" if a.drafter == "ngram" else None
        block = int(block) if block else None
        fig, line = describe(best["config"], "inductor", rows, False, a.benchmarks.name)
        print(line, flush=True)
    else:
        raise SystemExit(f"{a.benchmarks} holds no speedup figure for a configuration this demo can build: "
                         f"pass --drafter (and --tree).")

    t0 = time.perf_counter()
    path = specc.compile(None, drafter=a.drafter, tree=tree, backend="inductor", output_dir=a.output, max_len=1024,
                         block_size=block, modes="greedy", adaptive=adaptive,  # the demo decodes greedily
                         **({"ngram_corpus": corpus} if corpus else {}))
    print(f"compiled in {time.perf_counter() - t0:.0f} s -> {path}", file=sys.stderr)
    engine = specc.load(path)
    if chosen:  # the label (a DFlash block, say) is known once the engine is built
        fig, line = describe(engine_label(engine.manifest), "inductor", rows, True, a.benchmarks.name)
        print(line, flush=True)
    dataset = fig["dataset"] if fig else ("humaneval" if a.drafter == "ngram" else "mt-bench")
    prompt = a.prompt or load_prompts(dataset, 1)[0]
    max_new = a.max_new_tokens or (fig["new_tokens"] if fig else 128)
    print(f"prompt: {'yours' if a.prompt else f'the first {dataset} prompt'}; {WHY[a.drafter]}", flush=True)

    arms = {"speculative": lambda n: engine.generate(prompt, max_new_tokens=n, chat=True),
            "plain": lambda n: engine.generate(prompt, max_new_tokens=n, chat=True, speculate=False)}
    res = harness.paired(arms, 1, items=[max_new], warm=8)  # a warm-up of 8 tokens each, then one run each
    spec, plain = res["speculative"][0][0], res["plain"][0][0]
    print(spec.text)
    print()
    print(f"drafter {a.drafter} ({engine.manifest.tree['spec']}{', adaptive' if adaptive else ''}), "
          f"backend {engine.manifest.backend}")
    print(f"tau          {spec.stats.tau:.2f} tokens per verify step")
    print(f"speculative  {spec.stats.tokens_per_s:.1f} tokens/s ({spec.stats.new_tokens} tokens)")
    print(f"plain        {plain.stats.tokens_per_s:.1f} tokens/s")
    measured_on = f" on this prompt (measured: {fig['vs_plain']:.2f}x on {dataset}, {fig['prompts']} prompts)" \
        if fig else ""
    print(f"speedup      {spec.stats.tokens_per_s / plain.stats.tokens_per_s:.2f}x{measured_on}")
    print(f"lossless     {'identical tokens' if spec.token_ids == plain.token_ids else 'MISMATCH'}")
    return 0 if spec.token_ids == plain.token_ids else 1


if __name__ == "__main__":
    quiet_libraries()
    sys.exit(main())
