"""Offline tau of ngram chain drafts on the target's own greedy text: which continuation to draft.

    python examples/ngram_tau.py ENGINE [--limit 10] [--max-new-tokens 128] [--ks 4,8] [--min-ngrams 3,1]

ENGINE is any compiled SmolLM2 engine: its plain decoding gives the greedy text of each prompt
(HumanEval and MT-Bench, chat template on). Then, for a chain of k drafts, every step is replayed
on that text without the model: the drafts are what ngram would propose from the text committed so
far, and a step commits the drafts that match the text plus one token, exactly as greedy
verification would. tau = tokens / steps, for two rules: the continuation of the most recent
earlier occurrence (specc before 2026-12-02), and specc's by_frequency order.
"""
import argparse
import sys

import numpy as np

import specc
from specc.data import load_prompts
from specc.drafters.ngram import ngram_propose
from specc.errors import SpeccError


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ks", default="4,8")
    ap.add_argument("--min-ngrams", default="3,1")
    a = ap.parse_args()
    try:
        ks, min_ngrams = [int(x) for x in a.ks.split(",")], [int(x) for x in a.min_ngrams.split(",")]
    except ValueError:
        ks = min_ngrams = []
    if not ks or not min_ngrams or min(ks + min_ngrams) < 1 or max(min_ngrams) > 4 or a.limit < 1:
        print("error: --ks and --min-ngrams take comma-separated positive integers (n-grams up to 4), "
              "--limit at least 1.", file=sys.stderr)
        return 2
    try:
        engine = specc.load(a.engine)
    except SpeccError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("| dataset | chain | min n-gram | tau, most recent | tau, by_frequency |\n|---|---|---|---|---|")
    for dataset in ("humaneval", "mt-bench"):
        texts = []
        for prompt in load_prompts(dataset, a.limit):
            ids = engine.encode(prompt, chat=True)
            res = engine.generate(ids, max_new_tokens=a.max_new_tokens, speculate=False, stop_at_eos=False)
            texts.append((ids, res.token_ids))
        for k in ks:
            for mn in min_ngrams:
                old = replay_tau(texts, lambda t, k: most_recent(t, k, 4, mn), k)
                new = replay_tau(texts, lambda t, k: ngram_propose(t, k, 4, mn), k)
                print(f"| {dataset} | chain:{k} | {mn} | {old:.3f} | {new:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
