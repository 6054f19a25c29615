"""The ngram drafter against a brute-force prompt lookup."""
import numpy as np
from hypothesis import given, settings, strategies as st

from specc.drafters import NgramDrafter, ngram_propose
from specc.tree import chain


def brute_force(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    n = len(tokens)
    for size in range(max_ngram, min_ngram - 1, -1):
        if size > n - 1:
            continue
        suffix = tokens[n - size:]
        for start in range(n - size - 1, -1, -1):  # latest earlier occurrence first
            if tokens[start:start + size] == suffix:
                return tokens[start + size: start + size + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 6), st.integers(1, 4), st.integers(1, 4))
def test_ngram_propose_matches_brute_force(tokens, k, max_ngram, min_ngram):
    if min_ngram > max_ngram:
        min_ngram, max_ngram = max_ngram, min_ngram
    got = ngram_propose(np.array(tokens, dtype=np.int64), k, max_ngram, min_ngram)
    assert got == brute_force(tokens, k, max_ngram, min_ngram)


def test_ngram_drafter_pads_and_reports_misses():
    d = NgramDrafter(chain(4), min_ngram=2)
    d.start([1, 2, 3, 9, 1, 2], 0.0, 1.0)
    drafts, found = d.propose([1, 2, 3, 9, 1, 2])
    assert found and drafts == [3, 9, 1, 2]
    d.accepted([1, 2, 3, 9, 1, 2, 7], 0)
    drafts, found = d.propose([1, 2, 3, 9, 1, 2, 7])
    assert not found and len(drafts) == 4  # no match: the runtime takes the plain one-token step
