"""The ngram drafter against a brute-force prompt lookup."""
import numpy as np
from hypothesis import given, settings, strategies as st

from specc.drafters.ngram import NgramDrafter, ngram_propose
from specc.tree import chain


def brute_force(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The longest suffix with earlier occurrences (the 64 latest); of their continuations, the one
    whose first token, then first two tokens, ... are the most common (a prefix cut short by the end
    of the text counts 0), the latest on a tie."""
    n = len(tokens)
    for size in range(max_ngram, min_ngram - 1, -1):
        if size > n - 1:
            continue
        suffix = tokens[n - size:]
        starts = [s for s in range(n - size - 1, -1, -1) if tokens[s:s + size] == suffix][:64]  # latest first
        if not starts:
            continue
        conts = [tokens[s + size: s + size + k] for s in starts]

        def key(c):
            return [-sum(1 for o in conts if len(o) >= d and o[:d] == c[:d]) if d <= len(c) else 0
                    for d in range(1, k + 1)]
        best = 0
        for i in range(1, len(conts)):
            if key(conts[i]) < key(conts[best]):  # strictly better: a tie keeps the latest
                best = i
        return conts[best]
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
    d.start([1, 2, 3, 9, 1, 2], "greedy", 0.0, 1.0)
    drafts, found = d.propose([1, 2, 3, 9, 1, 2])
    assert found and drafts == [3, 9, 1, 2]
    d.accepted([1, 2, 3, 9, 1, 2, 7], 0)
    drafts, found = d.propose([1, 2, 3, 9, 1, 2, 7])
    assert not found and len(drafts) == 4  # no match: the runtime takes the plain one-token step


def test_ngram_continuations_first_is_the_chain_proposal():
    tokens = np.array([5, 1, 2, 3, 1, 2, 4, 1, 2], dtype=np.int64)
    conts = __import__("specc.drafters.ngram", fromlist=["x"]).ngram_continuations(tokens, 3, 2, 1)
    assert conts[0] == ngram_propose(tokens, 3, 2, 1) == [4, 1, 2]
    assert conts[:2] == [[4, 1, 2], [3, 1, 2]]  # suffix [1, 2]: latest occurrence first
    assert len(conts) == len({tuple(c) for c in conts})


def test_ngram_drafts_what_followed_most_often():
    # After [1, 2]: 7 twice, then 8 most recently. The recent 8 loses to the frequent 7; after
    # [1, 2, 7] the text went on with 1 both times.
    tokens = np.array([1, 2, 7, 1, 2, 7, 1, 2, 8, 1, 2], dtype=np.int64)
    assert ngram_propose(tokens, 2, 2, 1) == [7, 1]
    # A continuation cut short by the end of the text loses a tie to a longer one.
    tokens = np.array([5, 6, 7, 8, 5, 6, 5], dtype=np.int64)
    assert ngram_propose(tokens, 3, 1, 1) == [6, 7, 8]  # the latest, [6, 5], ends with the text


def _node_tokens(tree, drafts, root):
    return [root] + list(drafts)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), max_size=6), st.integers(1, 3),
       st.integers(1, 3))
def test_ngram_tree_drafts_follow_continuations(conts, depth, width):
    from specc.drafters.ngram import ngram_tree_drafts
    from specc.tree import topk

    uniq = []
    for c in conts:
        if c not in uniq:
            uniq.append(c)
    tree = topk(depth, width)
    toks = _node_tokens(tree, ngram_tree_drafts(uniq, tree, 9), 9)
    assert len(toks) == tree.size

    def seq(i):  # tokens along the path root -> i, root excluded
        out = []
        while i > 0:
            out.append(toks[i])
            i = tree.parents[i]
        return out[::-1]

    reached = {0}  # nodes whose path is a prefix of some continuation
    for i in range(tree.size):
        prefix = seq(i)
        nexts = []
        if i in reached:
            for c in uniq:
                if c[: len(prefix)] == prefix and len(c) > len(prefix) and c[len(prefix)] not in nexts:
                    nexts.append(c[len(prefix)])
        for r, kid in enumerate(tree.children[i]):
            if r < len(nexts):
                assert toks[kid] == nexts[r]
                reached.add(kid)
            else:
                assert toks[kid] == toks[i]


def test_ngram_drafter_on_a_tree_offers_several_matches():
    from specc.tree import tree_from_paths

    tree = tree_from_paths([[0], [1], [0, 0], [1, 0]])
    d = NgramDrafter(tree, min_ngram=2)
    ids = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2]
    d.start(ids, "greedy", 0.0, 1.0)
    drafts, found = d.propose(ids)
    # Node order: [0], [1], [0,0], [1,0]: the latest match (5, 6) first, then (3, 4).
    assert found and drafts == [5, 3, 6, 4]


def test_sampled_drafts_draw_each_slot_from_its_depth():
    """Sampled children: node i is the inverse-CDF draw of q[depth i] with the uniform of its
    (depth, rank) slot; the draws follow q. (Greedy graphs draft the top-k with tree_drafts.)"""
    import torch

    from specc.draft_tokens import draft_slots, sampled_drafts
    from specc.tree import topk
    from specc.acceptance import reference_sampling_probs

    tree = topk(3, 2)
    depth, rank, width = draft_slots(tree)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, generator=g)
    t, p = torch.tensor(0.7), torch.tensor(0.9)
    counts = torch.zeros(3, 6)
    for _ in range(2000):
        u = torch.rand(3 * width, generator=g)
        drafts, q = sampled_drafts(logits, depth, rank, width, t, p, u)
        for i in range(len(depth)):
            d, r = int(depth[i]), int(rank[i])
            cdf = torch.cumsum(q[d], 0)
            assert int(drafts[i]) == int((cdf > u[d * width + r]).nonzero()[0])  # the slot's own draw
        for d in range(3):
            counts[d, int(drafts[(depth == d) & (rank == 0)][0])] += 1
    want = torch.tensor([reference_sampling_probs(row.tolist(), 0.7, 0.9) for row in logits])
    assert torch.allclose(q, want.float(), atol=1e-6)
    assert (counts / 2000 - want).abs().max() < 0.05  # draws follow q (top-p zeros stay zero)
    assert (counts[want == 0] == 0).all()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=120), st.lists(st.integers(1, 9), min_size=1, max_size=12),
       st.integers(1, 4))
def test_match_index_agrees_with_the_scan_as_the_text_grows(tokens, cuts, max_ngram):
    """The index (kept up to date step by step) and the reference scan find the same occurrences,
    continuations and confidences at every length the text passes through; a different text re-indexes."""
    from specc.drafters.ngram import (MAX_OCCURRENCES, MatchIndex, _match_ends, ngram_confidences,
                                      ngram_continuations, ngram_tree_drafts)
    from specc.tree import tree_from_paths

    tree = tree_from_paths([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    index, n = MatchIndex(max_ngram), 1
    for cut in cuts + [len(tokens)]:
        n = min(len(tokens), n + cut)
        text = tokens[:n]
        arr = np.array(text, dtype=np.int64)
        index.sync(text)
        for size in range(1, max_ngram + 2):
            want = _match_ends(arr, size)[:MAX_OCCURRENCES].tolist() if size < n else []
            assert index.earlier_ends(size) == want
        for limit in (1, 16):
            conts = ngram_continuations(arr, 4, max_ngram, 1, limit)
            assert ngram_continuations(None, 4, max_ngram, 1, limit, index=index) == conts
        drafts = ngram_tree_drafts(ngram_continuations(arr, 3, max_ngram, 1), tree, text[-1])
        assert (ngram_confidences(None, tree, drafts, max_ngram, 1, index)
                == ngram_confidences(arr, tree, drafts, max_ngram, 1))
    other = [t + 1 for t in tokens[:5]] + [9, 9]
    index.sync(other)
    assert index.tokens == other and index.earlier_ends(1) == _match_ends(np.array(other), 1).tolist()
