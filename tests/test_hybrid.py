"""Hybrid trees (--ngram-branch, specc/hybrid.py): the branch's place in the tree, where prompt
lookup's continuation is written (against a brute-force walk), engines whose greedy output is the
target's, fused equal to unfused, and the refusals. The sampling test is in test_sampling.py (its top-k tree test)."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import specc
from specc.drafters.ngram import ngram_propose
from specc.errors import SpeccError
from specc.hybrid import NgramBranch, branch_entry, with_ngram_branch
from specc.tree import parse_tree, tree_from_paths
from test_dspark import random_dspark
from test_engine import PROMPT, hf_greedy
from tiny import tiny_model


def test_the_branch_is_a_chain_under_the_root_at_the_next_rank():
    tree = with_ngram_branch(parse_tree("topk:2,2"), 3)
    assert tree.size == 7 + 3
    assert {(2,), (2, 0), (2, 0, 0)} <= set(tree.paths) and tree.max_depth == 3
    assert branch_entry(tree, 3)["rank"] == 2 and branch_entry(tree, 3)["depth"] == 3
    skips = with_ngram_branch(tree_from_paths([[0], [2]]), 1)  # a tree file may skip ranks
    assert (3,) in skips.paths and branch_entry(skips, 1)["rank"] == 3


def token_paths(tree, tokens):
    """Every node's tokens from the root (the root's own excluded)."""
    paths = {0: ()}
    for i in range(1, tree.size):
        paths[i] = paths[tree.parents[i]] + (tokens[i],)
    return paths


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=40), st.sampled_from(["chain:2", "topk:2,2", "topk:1,3"]),
       st.integers(1, 4), st.randoms(use_true_random=False))
def test_lookup_is_written_where_it_can_be_accepted(text, spec, depth, rnd):
    """The continuation prompt lookup proposes ends up on one root path, as deep as that path goes:
    under the model's depth-1 node that already holds its first token (down that node's first
    children), else down the branch; nothing else changes, and the branch never repeats a depth-1 token."""
    tree = with_ngram_branch(parse_tree(spec), depth)
    entry = branch_entry(tree, depth)
    hybrid = NgramBranch(tree, entry)
    drafted = [text[-1]] + [rnd.randrange(4) for _ in range(tree.size - 1)]
    merged, written = hybrid.merge(drafted, text)
    cont = ngram_propose(np.array(text), depth, entry["max_ngram"], entry["min_ngram"])
    assert all(merged[i] == drafted[i] for i in range(tree.size) if i not in written)
    if not cont:
        assert merged == drafted and written == []
        return
    branch_root = next(j for j in tree.children[0] if tree.paths[j] == (entry["rank"],))
    model_roots = [j for j in tree.children[0] if j != branch_root]
    same = [j for j in model_roots if drafted[j] == cont[0]]
    start = same[0] if same else branch_root
    line = [start]  # the brute-force walk: first children from start
    while len(line) < len(cont) and tree.children[line[-1]]:
        line.append(tree.children[line[-1]][0])
    assert token_paths(tree, merged)[line[-1]] == tuple(cont[: len(line)])
    assert sorted(written) == sorted(line[1:] if same else line)
    if not same:
        assert merged[branch_root] not in [merged[j] for j in model_roots]


@pytest.fixture(scope="module")
def hybrid_engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hybrid")
    model = tiny_model("llama", vocab=64, layers=3, seed=2)
    model.save_pretrained(tmp / "m")
    dpath, _ = random_dspark(model, tmp / "ds", block=4)
    path = specc.compile(tmp / "m", drafter="dspark", drafter_path=dpath, tree="topk:2,2", ngram_branch=3,
                         backend="eager", output_dir=tmp / "e", max_len=96, prefill_chunk=8, progress=False,
                         modes="greedy,sample")
    return model, path


def test_hybrid_engine_is_greedy_identical_and_takes_lookups(hybrid_engine, specc_cli):
    """Greedy output equals the target's, fused and unfused (the unfused path merges the drafter
    graph's tree, the fused one the tree its step returned); sampling too gives the same tokens
    both ways. On repetitive text the verifier accepts lookup's tokens."""
    model, path = hybrid_engine
    engine = specc.load(path)
    assert engine.manifest.drafter["ngram_branch"]["depth"] == 3 and engine.tree.size == 10
    prompt = PROMPT * 3
    runs = {}
    for use_fused in (True, False):
        engine.use_fused = use_fused
        runs[use_fused] = [engine.generate(prompt, max_new_tokens=32, stop_at_eos=False, temperature=t, seed=1)
                           for t in (0.0, 0.8)]
    assert runs[True][0].token_ids == hf_greedy(model, prompt, 32)
    assert [r.token_ids for r in runs[True]] == [r.token_ids for r in runs[False]]
    assert [r.stats.accepted_hist for r in runs[True]] == [r.stats.accepted_hist for r in runs[False]]
    greedy = runs[True][0].stats
    assert greedy.lookup_steps > 0 and greedy.lookup_accepted > 0, greedy.as_dict()
    out = specc_cli("inspect", str(path))
    assert "prompt lookup's branch: 3 nodes under the root at rank 2" in out.stdout


@pytest.mark.parametrize("options,words", [
    ({"drafter": "ngram"}, "use it with --drafter"),
    ({"drafter": "draft-model"}, "use it with --drafter"),
    ({"drafter": "mtp", "children": "sampled"}, "use --children topk"),
    ({"drafter": "dspark", "tree": "auto"}, "pass the tree auto picked"),
    ({"drafter": "dspark", "ngram_branch": 17}, "out of range"),
    ({"drafter": "dspark", "ngram_branch": -1}, "out of range"),
    ({"drafter": "dspark", "tree": "topk:7,2", "ngram_branch": 16}, "more than the limit"),
])
def test_ngram_branch_refusals(tmp_path, options, words):
    options = {"ngram_branch": 4, **options}
    with pytest.raises(SpeccError, match=words):
        specc.compile(None, output_dir=tmp_path / "e", progress=False, **options)
    assert not (tmp_path / "e").exists()
