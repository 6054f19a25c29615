"""Prefill with several chunk sizes against the one chunk, side by side on one engine.

    python examples/bench_prefill.py ENGINE [--datasets humaneval,mt-bench] [--limit 10] [--rounds 5]
                                     [--write BENCHMARKS.md]

ENGINE is an engine compiled with several prefill chunk sizes (`--prefill-chunk 128,32`, the
default). Every prompt (chat template on) is prefilled back to back two ways, --rounds times, the
order alternating: as the runtime does (the cheapest mix of the engine's chunk graphs under the costs
timed at compile, specc/prefill.py) and with the smallest chunk alone (as engines did before several
sizes: whole chunks, a padded last one or a tail of up to 3 tokens through the one-token graph). The
cache, tokens and first token are the same graphs' work either way; the first tokens are compared.
Figures: per prompt set, the median over prompts of the median prefill time, the calls each way,
and the ratio.
"""
import argparse
import sys

import specc
from specc import harness
from specc.data import load_prompts
from specc.errors import SpeccError
from specc.models import quiet_libraries
from specc.prefill import estimated_costs, prefill, prefill_name, prefill_plan
from specc.signature import graphs_for_mode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine")
    ap.add_argument("--datasets", default="humaneval,mt-bench")
    harness.bench_args(ap, limit=10, rounds=5)
    a = ap.parse_args()
    quiet_libraries()
    try:
        engine = specc.load(a.engine)
        if "greedy" not in engine.modes:
            raise SpeccError(f"{a.engine} has no greedy graphs (compile it with --modes greedy).")
        if len(engine.chunks) < 2 or engine.prefill_ms is None:
            raise SpeccError(f"{a.engine} has one prefill chunk size ({engine.chunk}); compile it with "
                             f"--prefill-chunk 128,32 (the default) to compare.")
        sets = {d: load_prompts(d, a.limit) for d in a.datasets.split(",")}
    except SpeccError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    mode = "greedy"
    graphs = graphs_for_mode(engine.graphs, mode)
    chunk_graphs = {c: graphs[prefill_name(c, engine.chunk)] for c in engine.chunks}
    cache_len = engine.manifest.cache_len
    ways = {"several sizes": (chunk_graphs, engine.prefill_ms),
            f"{engine.chunk} alone": ({engine.chunk: chunk_graphs[engine.chunk]}, estimated_costs([engine.chunk]))}
    lines, rows = [], []
    for dataset, texts in sets.items():
        prompts = [engine.encode(t, chat=True) for t in texts]

        def way(w, ids):  # one prefill of the prompt: (its first token, milliseconds)
            cg, costs = ways[w]
            first, seconds = harness.clock(prefill, ids, cg, graphs["plain"], mode, costs=costs, capacity=cache_len,
                                           device=engine.device)
            return first, 1000 * seconds

        # a whole warm-up round first (every prompt length); the order alternates by round and prompt
        res = harness.paired({w: (lambda ids, w=w: way(w, ids)) for w in ways}, a.rounds, items=prompts, warmup=0,
                             warmup_rounds=1, stagger=True)
        for k, outs in enumerate(zip(*(harness.values(res[w]) for w in ways))):  # round by round, prompt by prompt
            firsts = {first for first, _ in outs}
            if len(firsts) != 1:
                print(f"error: prompt {k % len(prompts)} of {dataset}: the two ways give different first tokens "
                      f"{firsts}", file=sys.stderr)
                return 1
        med = {w: harness.median_of_items(res[w], key=lambda v: v[1]) for w in ways}
        calls = {w: sum(len(prefill_plan(len(ids), {s: v for s, v in c.items() if s == 1 or s in cg}, cache_len))
                        for ids in prompts) for w, (cg, c) in ways.items()}
        lengths = sorted(len(ids) for ids in prompts)
        new, old = list(ways)
        lines += [f"\n#### {dataset} ({len(prompts)} prompts, {lengths[0]}-{lengths[-1]} tokens)\n",
                  "| prefill | ms (median over prompts) | calls (all prompts) | vs the one chunk |",
                  "|---|---|---|---|"]
        for w in ways:
            lines.append(f"| {w} | {med[w]:.1f} | {calls[w]} | {med[old] / med[w]:.2f}x |")
        rows.append({"dataset": dataset, "prompts": len(prompts), "ms": {w: round(v, 2) for w, v in med.items()},
                     "calls": calls, "speedup": round(med[old] / med[new], 4)})
    costs = ", ".join(f"{k} {'token' if k == 1 else 'tokens'} {v:.1f} ms" for k, v in sorted(engine.prefill_ms.items()))
    setup = (f"Engine {a.engine} ({engine.manifest.target.name}, {engine.manifest.backend}); its costs a call "
             f"as timed at compile: {costs}. Chat template on; {a.rounds} rounds after a warm-up round, the two ways "
             f"back to back per prompt, order alternating; figure = median over prompts of each prompt's median; "
             f"the first token is the same both ways on every prompt.")
    return harness.record(a, "Prefill chunks", setup, "\n".join(lines), device=str(engine.device), prefill=rows)


if __name__ == "__main__":
    sys.exit(main())
