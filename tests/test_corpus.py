"""The ngram drafter's corpus table (specc/corpus.py): the table against a brute-force count, tree
drafts against a node-by-node walk, and engines that draft from a corpus (greedy identity, the
table's drafts accepted, adaptive classes, refusals)."""
import json
import os
import time
from collections import Counter

import pytest
import torch
from hypothesis import given, settings, strategies as st

import specc
from specc.corpus import CorpusTable, build_table
from specc.drafters.ngram import NgramDrafter, corpus_tree_drafts
from specc.errors import SpeccError
from specc.tree import parse_tree
from test_engine import hf_greedy
from tiny import tiny_model

seqs_strategy = st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=30), min_size=1, max_size=4)


def brute_ranked(seqs, context, vocab, width, min_count, max_context=3):
    """What follows the longest context (max_context tokens down to 1) whose most frequent next token
    followed at least min_count times: (length, tokens by count then id, count / (total + 1))."""
    for n in range(min(max_context, len(context)), 0, -1):
        follow = Counter(s[i + n] for s in seqs for i in range(len(s) - n) if list(s[i: i + n]) == list(context[-n:]))
        if follow and max(follow.values()) >= min_count:
            ranked = sorted(follow, key=lambda t: (-follow[t], t))[:width]
            total = sum(follow.values()) + 1
            return n, ranked, [follow[t] / total for t in ranked]
    return 0, [], []


@settings(max_examples=150, deadline=None)
@given(seqs_strategy, st.lists(st.integers(0, 4), min_size=1, max_size=5), st.integers(1, 3), st.integers(1, 3))
def test_table_matches_a_brute_force_count(seqs, context, width, min_count):
    table = CorpusTable(build_table(seqs, 5, width=width, min_count=min_count), 5)
    got = table.ranked(context)
    want = brute_ranked(seqs, context, 5, width, min_count)
    assert got[0] == want[0] and got[1] == want[1] and got[2] == pytest.approx(want[2])


def brute_tree(table, context, tree):
    """corpus_tree_drafts node by node: each node's context is the text's tail and its path's tokens."""
    tokens, out_tok, used, conf = {0: list(context)}, [], [], []
    for i in range(1, tree.size):
        p = tree.parents[i]
        n, nxt, c = table.ranked(tokens[p])
        r = tree.ranks[i]
        tok = nxt[r] if r < len(nxt) else tokens[p][-1]
        tokens[i] = tokens[p] + [tok]
        out_tok.append(tok)
        used.append(n if r < len(nxt) else 0)
        conf.append(c[r] if r < len(nxt) else 0.0)
    return out_tok, used, conf


def greedy_walk(table, context, k):
    """Up to k tokens, each the table's most frequent one after the text and the tokens before it."""
    ctx, out = list(context), []
    for _ in range(k):
        n, nxt, _ = table.ranked(ctx)
        if not n:
            break
        out.append(nxt[0])
        ctx.append(nxt[0])
    return out


@settings(max_examples=100, deadline=None)
@given(seqs_strategy, st.lists(st.integers(0, 4), min_size=1, max_size=5),
       st.sampled_from(["chain:4", "topk:2,2", "topk:3,1"]))
def test_tree_drafts_match_a_node_by_node_walk(seqs, context, spec):
    tree = parse_tree(spec)
    table = CorpusTable(build_table(seqs, 5, min_count=1), 5)
    drafts, used, conf = corpus_tree_drafts(table, context, tree)
    want = brute_tree(table, context, tree)
    assert (drafts, used) == (want[0], want[1]) and conf == pytest.approx(want[2])
    if tree.is_chain and used[0]:  # a chain is the table's greedy walk
        walk = greedy_walk(table, context, tree.max_depth)
        assert drafts[: len(walk)] == walk


def test_lookup_comes_first_then_the_table():
    """A 2-token match in the text drafts what followed it; without one, the table drafts."""
    tree = parse_tree("chain:2")
    table = CorpusTable(build_table([[1, 2, 3, 4]] * 3, 10), 10)
    d = NgramDrafter(tree, 4, 3, table, min_lookup=2)
    d.start([7, 8, 9, 7, 8], "greedy", None, None)
    assert d.propose([7, 8, 9, 7, 8]) == ([9, 7], True) and d.from_corpus is None  # lookup: "7 8" -> 9 7
    d.start([5, 1, 2], "greedy", None, None)
    assert d.propose([5, 1, 2]) == ([3, 4], True)  # the table: "1 2" -> 3, "1 2 3" -> 4
    classes, conf = d.confidences()
    assert classes == [4 + 1, 4 + 2] and conf == pytest.approx([3 / 4, 3 / 4])  # after lookup's 4 classes
    d.start([6, 0], "greedy", None, None)
    assert d.propose([6, 0])[1] is False  # neither knows what follows


@pytest.fixture(scope="module")
def corpus_setup(tmp_path_factory):
    """A tiny target, a prompt, and a corpus of the target's own greedy continuations of random
    prompts and of that prompt, each three times (the table keeps contexts seen 3 times): the table
    learns what the target says."""
    root = tmp_path_factory.mktemp("corpus")
    model = tiny_model("llama", vocab=64, layers=2, seed=0, scale=4.0)
    model.save_pretrained(root / "m")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 64, (6,), generator=g).tolist() for _ in range(4)]
    lines = [json.dumps({"ids": p + hf_greedy(model, p, 40)}) for p in prompts] * 3
    (root / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    return root, model, prompts[0]


def test_engine_drafts_from_the_corpus(corpus_setup, specc_cli):
    root, model, prompt = corpus_setup
    path = specc.compile(root / "m", drafter="ngram", tree="chain:3", backend="eager", adaptive=True,
                         ngram_corpus=str(root / "corpus.jsonl"), output_dir=root / "e", max_len=128, prefill_chunk=4,
                         progress=False, modes="greedy")
    manifest = json.loads((path / "specc.json").read_text())
    assert manifest["drafter"]["corpus"]["contexts"][0] > 0 and (path / "draft" / "corpus.safetensors").is_file()
    assert len(manifest["adaptive"]["rates"]) == 4 + 3  # lookup's matched lengths, then the table's contexts
    assert sum(map(sum, manifest["adaptive"]["seen"][4:])) > 0  # the table's drafts were calibrated
    engine = specc.load(path)
    engine.time_steps = False  # the choices read this table: a GPU's flat c(T), verify all
    engine.adaptive = {**engine.adaptive, "latency_ms": [1.0, 1.01, 1.02, 1.03]}
    res = engine.generate(prompt, max_new_tokens=40, stop_at_eos=False)
    assert res.token_ids == hf_greedy(model, prompt, 40)
    assert res.stats.tau > 2.0, res.stats.as_dict()  # the table knows what the target says here
    out = specc_cli("inspect", path)
    assert out.returncode == 0 and "corpus" in out.stdout, out.stderr


@pytest.mark.parametrize("options, words", [
    ({"ngram_corpus": "missing.jsonl"}, "neither sharegpt, none nor a .jsonl file"),
    ({"ngram_corpus": "sharegpt"}, "has none"),
    ({"ngram_corpus": "{bad}"}, "not a JSON object"),
    ({"ngram_corpus": "{text}"}, "holds text"),
    ({"ngram_corpus": "{big}"}, "outside the model's vocabulary"),
    ({"ngram_corpus": "none", "drafter": "dflash"}, "--ngram-corpus only applies to --drafter ngram"),
])
def test_corpus_refusals(corpus_setup, tmp_path, options, words):
    root, _, _ = corpus_setup
    files = {"{bad}": "[1, 2]\n", "{text}": '{"text": "hello"}\n', "{big}": '{"ids": [1, 999]}\n'}
    source = options["ngram_corpus"]
    if source in files:
        (tmp_path / "c.jsonl").write_text(files[source])
        options = {**options, "ngram_corpus": str(tmp_path / "c.jsonl")}
    kw = {"drafter": "ngram", "tree": "chain:2", **options}
    with pytest.raises(SpeccError, match=words):
        specc.compile(root / "m", backend="eager", output_dir=tmp_path / "e", max_len=64, progress=False,
                      modes="greedy", **kw)
    assert not (tmp_path / "e").exists()


def test_sharegpt_table_is_kept_in_the_cache(tmp_path, monkeypatch, capsys):
    """The ShareGPT table is built once per machine: kept in the cache directory, read back by the
    next process, rebuilt when the file is torn; never half-written; keyed by what it depends on; a
    cache it cannot write only costs the next compile a rebuild."""
    from conftest import tiny_tokenizer
    from tokenizers import normalizers

    from specc import corpus

    monkeypatch.setenv("SPECC_CACHE", str(tmp_path))
    built = []

    def sequences(tokenizer):
        built.append(tokenizer)
        return [[3, 4, 5, 3, 4, 5, 3, 4, 5, 6]] * 3

    monkeypatch.setattr(corpus, "sharegpt_sequences", sequences)
    monkeypatch.setattr(corpus, "_BUILT", {})
    tok = tiny_tokenizer()
    path = corpus.sharegpt_table_path(tok, 64)
    first = corpus.build_sharegpt_table(tok, 64)
    assert len(built) == 1 and path.is_file()
    assert corpus.build_sharegpt_table(tok, 64) is first and len(built) == 1  # this process's copy

    monkeypatch.setattr(corpus, "_BUILT", {})  # a new process: read from the cache, not built
    again = corpus.build_sharegpt_table(tok, 64)
    assert len(built) == 1 and again.keys() == first.keys()
    assert all((again[k] == first[k]).all() for k in first)
    assert CorpusTable(again, 64).ranked([3, 4]) == (2, [5], [pytest.approx(9 / 10)])

    path.write_bytes(path.read_bytes()[:50])  # torn by a crash: built again, and kept whole
    stale, fresh = path.parent / f".{path.name}.1.tmp", path.parent / f".{path.name}.2.tmp"
    for f, age in ((stale, 7200), (fresh, 0)):  # a killed compile's leftover, and another's write under way
        f.write_bytes(b"x")
        os.utime(f, (time.time() - age, time.time() - age))
    monkeypatch.setattr(corpus, "_BUILT", {})
    corpus.build_sharegpt_table(tok, 64)
    assert len(built) == 2
    monkeypatch.setattr(corpus, "_BUILT", {})
    corpus.build_sharegpt_table(tok, 64)
    assert len(built) == 2 and sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, fresh.name])

    # Another vocabulary, tokenizer, corpus size or count threshold: another table.
    other = tiny_tokenizer()
    other.backend_tokenizer.normalizer = normalizers.Lowercase()
    keys = {path, corpus.sharegpt_table_path(tok, 80), corpus.sharegpt_table_path(other, 64)}
    monkeypatch.setattr(corpus, "CONVERSATIONS", 10)
    keys.add(corpus.sharegpt_table_path(tok, 64))
    monkeypatch.setattr(corpus, "MIN_COUNT", 2)
    keys.add(corpus.sharegpt_table_path(tok, 64))
    assert len(keys) == 5

    def cannot_write(*args, **kwargs):
        from safetensors import SafetensorError
        raise SafetensorError("Error while serializing: No space left on device")

    monkeypatch.setattr(corpus, "save_table", cannot_write)  # a full cache: the table still comes back
    monkeypatch.setattr(corpus, "_BUILT", {})
    assert corpus.build_sharegpt_table(tok, 64, progress=True).keys() == first.keys() and len(built) == 3
    assert "could not keep the table" in capsys.readouterr().out
