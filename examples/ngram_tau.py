"""Offline tau of ngram chain drafts on the target's own greedy text: which continuation to draft.

    python examples/ngram_tau.py ENGINE [--limit 10] [--max-new-tokens 128] [--ks 4,8] [--min-ngrams 3,1]
                                 [--corpus 8000,15000] [--trees chain:1,chain:2,topk:1,2]

ENGINE is any compiled SmolLM2 engine: its plain decoding gives the greedy text of each prompt
(HumanEval and MT-Bench, chat template on). Then, for a chain of k drafts, every step is replayed
on that text without the model: the drafts are what ngram would propose from the text committed so
far, and a step commits the drafts that match the text plus one token, exactly as greedy
verification would. tau = tokens / steps, for two rules: the continuation of the most recent
earlier occurrence (specc before 2026-12-02), and specc's by_frequency order. With --corpus, also
the ngram drafter as it runs (specc.drafters.ngram.NgramDrafter: lookup's matches of 2 tokens, then
the corpus table, then lookup's 1-token matches) with tables built from the first N ShareGPT
conversations for each N given, against lookup alone (matches of any length). With --trees, the
shape of one step: at every position of the text, the drafter as an adaptive engine runs it (with
ENGINE's own corpus table, if it has one) fills each tree, and greedy verification's committed
tokens are counted, split by where the drafts came from (prompt lookup, the corpus table): which
tree of a few nodes a step should verify, without compiling one.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

import specc
from specc import benchfile, corpus, harness
from specc.data import load_prompts
from specc.drafters.ngram import NgramDrafter, ngram_propose
from specc.errors import SpeccError
from specc.tree import Tree, chain, parse_tree


def most_recent(tokens: np.ndarray, k: int, max_ngram: int, min_ngram: int) -> list[int]:
    n = len(tokens)
    for size in range(min(max_ngram, n - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: n - 1], size)
        starts = np.flatnonzero((windows == tokens[n - size:]).all(axis=1))
        if len(starts):
            return tokens[starts[-1] + size: starts[-1] + size + k].tolist()
    return []


def replay_tau(texts, propose, k: int) -> float:
    steps = tokens = 0
    for ids, out in texts:
        text = np.array(ids + out, dtype=np.int64)
        p, end = len(ids), len(ids) + len(out)
        while p < end:
            drafts = propose(text[:p], k)
            a = 0
            while a < len(drafts) and p + a < end and drafts[a] == text[p + a]:
                a += 1
            p, steps, tokens = p + a + 1, steps + 1, tokens + a + 1
    return tokens / steps


def drafter_propose(k: int, table):
    """A chain of k drafts from the runtime drafter (adaptive settings: matches of any length)."""
    drafter = NgramDrafter(chain(k), 4, 1, table)

    def propose(tokens, _k):
        drafter.start(tokens.tolist(), "greedy", None, None)
        drafts, found = drafter.propose(tokens.tolist())
        return drafts if found else []
    return propose


def committed(tree: Tree, drafts: list[int], truth: list[int]) -> int:
    """Tokens greedy verification commits: the longest path of drafts that matches the text, plus one."""
    tokens, node, n = [None] + list(drafts), 0, 0
    while n < len(truth):
        node = next((c for c in tree.children[node] if tokens[c] == truth[n]), None)
        if node is None:
            break
        n += 1
    return n + 1


def tree_steps(rows, tree: Tree, table) -> dict[str, list[int]]:
    """Committed tokens of one step of `tree` at every position of each text, by the drafts' source."""
    drafter = NgramDrafter(tree, 4, 1, table)
    out = {"prompt lookup": [], "corpus table": [], "no draft": []}
    for ids, generated in rows:
        text = ids + generated
        drafter.start(ids, "greedy", None, None)  # as the runtime: its match index grows with the text
        for p in range(len(ids), len(text)):
            drafts, found = drafter.propose(text[:p])
            source = "no draft" if not found else "corpus table" if drafter.from_corpus is not None else "prompt lookup"
            out[source].append(committed(tree, drafts, text[p:p + tree.max_depth]) if found else 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine")
    harness.bench_args(ap, limit=10, max_new_tokens=128, json=False)
    ap.add_argument("--ks", default="4,8")
    ap.add_argument("--min-ngrams", default="3,1")
    ap.add_argument("--corpus", default="", help="comma-separated conversation counts of ShareGPT tables to replay")
    ap.add_argument("--trees", default="", help="comma-separated trees (chain:K, topk:D,W) whose single steps to replay")
    a = ap.parse_args()
    try:
        ks, min_ngrams = [int(x) for x in a.ks.split(",")], [int(x) for x in a.min_ngrams.split(",")]
        sizes = [int(x) for x in a.corpus.split(",")] if a.corpus else []
    except ValueError:
        ks = min_ngrams = []
    if not ks or not min_ngrams or min(ks + min_ngrams) < 1 or max(min_ngrams) > 4 or any(n < 1 for n in sizes):
        print("error: --ks and --min-ngrams take comma-separated positive integers (n-grams up to 4), --corpus "
              "positive conversation counts.", file=sys.stderr)
        return 2
    try:
        trees = {spec: parse_tree(spec) for spec in split_trees(a.trees)}
        engine = specc.load(a.engine)
    except SpeccError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    texts = {}
    for dataset in ("humaneval", "mt-bench"):
        texts[dataset] = []
        for prompt in load_prompts(dataset, a.limit):
            ids = engine.encode(prompt, chat=True)
            res = engine.generate(ids, max_new_tokens=a.max_new_tokens, speculate=False, stop_at_eos=False)
            texts[dataset].append((ids, res.token_ids))
    out: list[str] = []
    say = out.append
    say("| dataset | chain | min n-gram | tau, most recent | tau, by_frequency |\n|---|---|---|---|---|")
    for dataset, rows in texts.items():
        for k in ks:
            for mn in min_ngrams:
                old = replay_tau(rows, lambda t, k: most_recent(t, k, 4, mn), k)
                new = replay_tau(rows, lambda t, k: ngram_propose(t, k, 4, mn), k)
                say(f"| {dataset} | chain:{k} | {mn} | {old:.3f} | {new:.3f} |")
    if sizes:
        vocab = engine.manifest.target.vocab_size
        tables = {}
        for n in sizes:
            arrays = corpus.build_table(corpus.sharegpt_sequences(engine.tokenizer, n), vocab)
            tables[n] = (corpus.CorpusTable(arrays, vocab), sum(v.nbytes for v in arrays.values()) / 1e6)
        say("\n| dataset | chain | lookup only | " + " | ".join(f"+ table of {n} conversations ({mb:.0f} MB)"
                                                        for n, (_, mb) in tables.items()) + " |")
        say("|---|---|---|" + "---|" * len(tables))
        for dataset, rows in texts.items():
            for k in ks:
                taus = [replay_tau(rows, drafter_propose(k, None), k)]
                taus += [replay_tau(rows, drafter_propose(k, table), k) for table, _ in tables.values()]
                say(f"| {dataset} | chain:{k} | " + " | ".join(f"{t:.3f}" for t in taus) + " |")
    if trees:
        drafter = engine.manifest.drafter
        table = corpus.load_table(Path(a.engine) / "draft", engine.manifest.target.vocab_size) \
            if drafter.get("kind") == "ngram" and "corpus" in drafter else None
        then = "then the engine's corpus table" if table is not None else "the engine has no corpus table"
        say(f"\nOne step of each tree at every position (drafts: prompt lookup, {then}); tokens committed "
            f"a step, mean, by the drafts' source (share of positions)\n")
        say("| dataset | tree | nodes | all | prompt lookup | corpus table | no draft |\n|---|---|---|---|---|---|---|")
        for dataset, rows in texts.items():
            for spec, tree in trees.items():
                by = tree_steps(rows, tree, table)
                n = sum(len(v) for v in by.values())
                cells = [f"{sum(v) / len(v):.3f} ({len(v) / n:.0%})" if v else "-" for v in by.values()]
                say(f"| {dataset} | {spec} | {tree.size} | {sum(map(sum, by.values())) / n:.3f} | "
                    + " | ".join(cells) + " |")
    report = "\n".join(out)
    print(report)
    if a.write:
        setup = (f"{engine.manifest.target.name}'s greedy text of the first {a.limit} prompts "
                 f"of each set ({a.max_new_tokens} new tokens, chat template on), ngram drafts replayed on it "
                 f"without the model (engine {a.engine}). No timing.")
        run = benchfile.new_run("ngram drafts replayed on the target's text", [])
        title = benchfile.write_run(a.write, run, setup, report)
        print(f"wrote the run {title!r} under History in {a.write}", file=sys.stderr)
    return 0


def split_trees(text: str) -> list[str]:
    """chain:1,topk:1,2 -> [chain:1, topk:1,2]: a comma followed by a digit continues a topk spec."""
    specs: list[str] = []
    for part in filter(None, text.split(",")):
        if part[0].isdigit() and specs:
            specs[-1] += "," + part
        else:
            specs.append(part)
    return specs


if __name__ == "__main__":
    sys.exit(main())
