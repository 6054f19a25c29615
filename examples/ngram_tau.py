"""Offline tau of ngram chain drafts on the target's own greedy text: which continuation to draft.

    python examples/ngram_tau.py ENGINE [--limit 10] [--max-new-tokens 128] [--ks 4,8] [--min-ngrams 3,1]
                                 [--corpus 8000,15000]

ENGINE is any compiled SmolLM2 engine: its plain decoding gives the greedy text of each prompt
(HumanEval and MT-Bench, chat template on). Then, for a chain of k drafts, every step is replayed
on that text without the model: the drafts are what ngram would propose from the text committed so
far, and a step commits the drafts that match the text plus one token, exactly as greedy
verification would. tau = tokens / steps, for two rules: the continuation of the most recent
earlier occurrence (specc before 2026-12-02), and specc's by_frequency order. With --corpus, also
the ngram drafter as it runs (specc.drafters.ngram.NgramDrafter: lookup's matches of 2 tokens, then
the corpus table, then lookup's 1-token matches) with tables built from the first N ShareGPT
conversations for each N given, against lookup alone (matches of any length).
"""
import argparse
import sys

import numpy as np

import specc
from specc import corpus
from specc.data import load_prompts
from specc.drafters.ngram import NgramDrafter, ngram_propose
from specc.errors import SpeccError
from specc.tree import chain


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ks", default="4,8")
    ap.add_argument("--min-ngrams", default="3,1")
    ap.add_argument("--corpus", default="", help="comma-separated conversation counts of ShareGPT tables to replay")
    a = ap.parse_args()
    try:
        ks, min_ngrams = [int(x) for x in a.ks.split(",")], [int(x) for x in a.min_ngrams.split(",")]
        sizes = [int(x) for x in a.corpus.split(",")] if a.corpus else []
    except ValueError:
        ks = min_ngrams = []
    if (not ks or not min_ngrams or min(ks + min_ngrams) < 1 or max(min_ngrams) > 4 or a.limit < 1
            or any(n < 1 for n in sizes)):
        print("error: --ks and --min-ngrams take comma-separated positive integers (n-grams up to 4), --corpus "
              "positive conversation counts, --limit at least 1.", file=sys.stderr)
        return 2
    try:
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
    print("| dataset | chain | min n-gram | tau, most recent | tau, by_frequency |\n|---|---|---|---|---|")
    for dataset, rows in texts.items():
        for k in ks:
            for mn in min_ngrams:
                old = replay_tau(rows, lambda t, k: most_recent(t, k, 4, mn), k)
                new = replay_tau(rows, lambda t, k: ngram_propose(t, k, 4, mn), k)
                print(f"| {dataset} | chain:{k} | {mn} | {old:.3f} | {new:.3f} |")
    if sizes:
        vocab = engine.manifest["target"]["vocab_size"]
        tables = {}
        for n in sizes:
            arrays = corpus.build_table(corpus.sharegpt_sequences(engine.tokenizer, n), vocab)
            tables[n] = (corpus.CorpusTable(arrays, vocab), sum(v.nbytes for v in arrays.values()) / 1e6)
        print("\n| dataset | chain | lookup only | " + " | ".join(f"+ table of {n} conversations ({mb:.0f} MB)"
                                                          for n, (_, mb) in tables.items()) + " |")
        print("|---|---|---|" + "---|" * len(tables))
        for dataset, rows in texts.items():
            for k in ks:
                taus = [replay_tau(rows, drafter_propose(k, None), k)]
                taus += [replay_tau(rows, drafter_propose(k, table), k) for table, _ in tables.values()]
                print(f"| {dataset} | chain:{k} | " + " | ".join(f"{t:.3f}" for t in taus) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
