"""Token trees in engines: tree drafting (ngram, DFlash, MTP) and the measured trees (sequoia, auto)."""
import json

import pytest
import torch

import specc
from specc.calibrate import comb
from specc.errors import SpeccError
from specc.tree import tree_from_paths
from test_engine import PROMPT, hf_greedy, mtp_checkpoint, random_dflash, record
from tiny import tiny_model

# Uneven on purpose: three ranks at depth 1, two under the first, a rank-1 branch deeper than the chain.
PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [1, 0, 0]]


def tree_file(tmp_path):
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(PATHS))
    return str(path)


def node_tokens(ranked, tree):
    """The tree's drafts from per-depth ranked candidates: node i takes ranked[depth-1][rank]."""
    return [ranked[tree.depths[i] - 1][tree.ranks[i]] for i in range(1, tree.size)]


def mtp_target(tmp_path):
    """A one-layer target with unit-RMS embeddings and MTP heads that copy its layer (mostly accepted)."""
    model = tiny_model("llama", vocab=64, layers=1, seed=2)
    with torch.no_grad():
        w = model.model.embed_tokens.weight
        w /= w.pow(2).mean(-1, keepdim=True).sqrt()
    model.save_pretrained(tmp_path / "m")
    dpath, heads = mtp_checkpoint(model, tmp_path / "mtp", "copy")
    return model, dpath, heads


def record_proposals(engine):
    engine.use_fused = False  # every step through the drafter's own graph (the fused step is checked against it)
    seen, real = [], engine.drafter.propose
    engine.drafter.propose = record(real, seen)
    return seen


def test_comb_tree():
    t = comb(3, 2)
    assert t.size == 7 and t.max_depth == 3
    assert set(t.paths) == {(), (0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 1)}


def test_dflash_tree_drafts_are_ranked_candidates(tmp_path):
    """Every node holds the drafter's candidate of its rank at its block position (the reference
    forward's top-k), and greedy output equals the target's."""
    from specc.drafters.dflash.model import draft_logits

    model = tiny_model("llama", vocab=64, layers=3, seed=2)
    model.save_pretrained(tmp_path / "m")
    dpath, d = random_dflash(model, tmp_path / "dflash", block=4)
    engine = specc.load(specc.compile(tmp_path / "m", drafter="dflash", drafter_path=dpath, tree=tree_file(tmp_path),
                                      output_dir=tmp_path / "e", max_len=64, prefill_chunk=8, progress=False,
                                      modes="greedy"))
    assert json.loads((engine.path / "specc.json").read_text())["drafter"]["block_size"] == 4  # depth 3 + anchor
    seen = record_proposals(engine)
    for prompt in (PROMPT, PROMPT[:3]):
        assert engine.generate(prompt, max_new_tokens=16, stop_at_eos=False).token_ids == hf_greedy(model, prompt, 16)
    with torch.no_grad():
        for committed, (drafts, _) in seen:
            hs = model(torch.tensor([committed]), output_hidden_states=True).hidden_states
            taps = torch.cat([hs[i + 1][0] for i in d.config.target_layer_ids], dim=-1)
            logits = draft_logits(d, model.model.embed_tokens, model.lm_head.weight, taps, torch.tensor(committed),
                                  torch.tensor([len(committed) - 1]))[0]
            assert drafts == node_tokens(torch.topk(logits, 3).indices.tolist(), engine.tree)


def test_mtp_tree_drafts_are_ranked_candidates(tmp_path):
    from specc.drafters.mtp.model import cached_scheme_drafts

    model, dpath, heads = mtp_target(tmp_path)
    engine = specc.load(specc.compile(tmp_path / "m", drafter="mtp", drafter_path=dpath, tree=tree_file(tmp_path),
                                      output_dir=tmp_path / "e", max_len=64, prefill_chunk=8, progress=False,
                                      modes="greedy"))
    seen = record_proposals(engine)
    for prompt in (PROMPT, PROMPT * 2):
        res = engine.generate(prompt, max_new_tokens=20, stop_at_eos=False)
        assert res.token_ids == hf_greedy(model, prompt, 20)
    for committed, (drafts, _) in seen:
        assert drafts == node_tokens(cached_scheme_drafts(heads, model, committed, 3, width=3), engine.tree)
    assert len(seen) > 5


@pytest.mark.parametrize("tree", ["topk:2,2", None])
def test_ngram_tree_greedy_identical(tmp_path, tree):
    model = tiny_model("qwen3", vocab=64, layers=2, seed=1)
    model.save_pretrained(tmp_path / "m")
    engine = specc.load(specc.compile(tmp_path / "m", drafter="ngram", tree=tree or tree_file(tmp_path),
                                      output_dir=tmp_path / "e", max_len=96, prefill_chunk=8, progress=False,
                                      modes="greedy"))
    prompt = PROMPT * 3
    res = engine.generate(prompt, max_new_tokens=30, stop_at_eos=False)
    assert res.token_ids == hf_greedy(model, prompt, 30)
    assert len(res.stats.rank_paths) > 0


@pytest.fixture
def quick_calibration(monkeypatch):
    """Fewer and shorter calibration prompts and fewer auto budgets: the logic, not the statistics."""
    import specc.calibrate as cal

    monkeypatch.setattr(cal, "PROMPTS", 3)
    monkeypatch.setattr(cal, "NEW_TOKENS", 24)
    monkeypatch.setattr(cal, "AUTO_BUDGETS", (2, 4, 8))


def test_sequoia_tree_from_calibration(tmp_path, quick_calibration):
    """sequoia:BUDGET measures acceptance on a comb tree and compiles the DP's tree; the manifest
    keeps the table, and greedy output still equals the target's."""
    model, dpath, _ = mtp_target(tmp_path)
    path = specc.compile(tmp_path / "m", drafter="mtp", drafter_path=dpath, tree="sequoia:6",
                         output_dir=tmp_path / "e", max_len=96, prefill_chunk=8, progress=False, modes="greedy")
    tree = json.loads((path / "specc.json").read_text())["tree"]
    assert tree["spec"] == "sequoia:6" and len(tree["paths"]) <= 6
    assert len(tree["acceptance"]) == 4 and tree["calibration"]["steps"] > 0
    assert tree["acceptance"][0][0] > 0.3  # these heads copy the target's one layer: mostly accepted
    assert [p.name for p in tmp_path.iterdir() if ".calibrate-" in p.name] == []  # staging removed
    engine = specc.load(path)
    assert engine.generate(PROMPT, max_new_tokens=20, stop_at_eos=False).token_ids == hf_greedy(model, PROMPT, 20)


def test_auto_reports_candidates(tmp_path, quick_calibration):
    model, dpath, _ = mtp_target(tmp_path)
    path = specc.compile(tmp_path / "m", drafter="mtp", drafter_path=dpath, tree="auto",
                         output_dir=tmp_path / "e", max_len=96, prefill_chunk=8, progress=False, modes="greedy")
    tree = json.loads((path / "specc.json").read_text())["tree"]
    rows = tree["candidates"]
    assert tree["spec"] == "auto" and len(rows) >= 3 and rows[0]["tree"] == "plain" and rows[0]["nodes"] == 1
    best = max(rows, key=lambda r: (r["expected_tokens_per_s"], -r["nodes"]))
    assert tree["picked"] == best["tree"]
    assert len(tree["paths"]) == (best["nodes"] if best["tree"] != "plain" else rows[1]["nodes"])
    assert all(r["measured_tokens_per_s"] > 0 and r["step_ms"] > 0 for r in rows)
    engine = specc.load(path)
    assert engine.speculates == (best["tree"] != "plain")
    assert engine.generate(PROMPT, max_new_tokens=20, stop_at_eos=False).token_ids == hf_greedy(model, PROMPT, 20)


def test_auto_keeps_plain_decoding_when_it_is_fastest(tmp_path, quick_calibration, monkeypatch):
    """Plain decoding is one of auto's candidates: where every tree is slower on the calibration
    prompts (here, a tree's steps are made to look 10x slower), the engine decodes plainly."""
    import specc.calibrate as cal

    real = cal.run_prompts

    def slow_trees(engine, prompts, new_tokens=None, speculate=True):
        m = real(engine, prompts, new_tokens, speculate)
        m.wall_s *= 10 if speculate else 1
        return m

    monkeypatch.setattr(cal, "run_prompts", slow_trees)
    monkeypatch.setattr(cal, "AUTO_BUDGETS", (2,))  # one tree against plain decoding
    model, dpath, _ = mtp_target(tmp_path)
    path = specc.compile(tmp_path / "m", drafter="mtp", drafter_path=dpath, tree="auto",
                         output_dir=tmp_path / "e", max_len=96, prefill_chunk=8, progress=False, modes="greedy")
    tree = json.loads((path / "specc.json").read_text())["tree"]
    assert tree["picked"] == "plain"
    engine = specc.load(path)
    res = engine.generate(PROMPT, max_new_tokens=20, stop_at_eos=False)
    assert not engine.speculates and res.stats.verified_sizes == {1: res.stats.steps}
    assert res.token_ids == hf_greedy(model, PROMPT, 20)


def test_measured_tree_refusals(tmp_path):
    model = tiny_model("llama", vocab=64, layers=1, seed=2)
    model.save_pretrained(tmp_path / "m")
    for drafter, tree, words in [("none", "auto", "use it with --drafter ngram, mtp, dflash or dspark"),
                                 ("draft-model", "sequoia:4", "use it with --drafter ngram, mtp, dflash or dspark"),
                                 ("ngram", "sequoia:0", "BUDGET must be a positive integer")]:
        with pytest.raises(SpeccError, match=words):
            specc.compile(tmp_path / "m", drafter=drafter, tree=tree, output_dir=tmp_path / "e", progress=False)
    assert not (tmp_path / "e").exists()


# Inductor: the sampled DFlash engine (greedy runs take its top-k path); the SmolLM2 tests run the
# shipped drafters' top-k engines fused on inductor.
@pytest.mark.parametrize("kind,backend,tree,children", [("dflash", "eager", None, "topk"), ("mtp", "eager", None, "topk"),
                                                        ("mtp", "eager", None, "sampled"),
                                                        ("dflash", "inductor", None, "sampled")])
def test_fused_step_equals_unfused(tmp_path, kind, backend, tree, children):
    """One graph per step (verify, accept, compaction, drafter update and next drafts) gives exactly
    the tokens of the unfused path, greedy and sampling, and greedy equals the target's; with
    top-k children and with children sampled from the drafter."""
    if kind == "mtp":
        model, dpath, _ = mtp_target(tmp_path)
    else:
        model = tiny_model("llama", vocab=64, layers=3, seed=2)
        model.save_pretrained(tmp_path / "m")
        dpath, _ = random_dflash(model, tmp_path / "d", block=4)
    # Inductor compiles each graph separately (minutes in this suite): its case samples only, since
    # its greedy runs take the top-k path that the eager cases and test_engine's inductor MTP cover.
    modes = ("sample",) if backend == "inductor" else ("greedy", "sample")
    path = specc.compile(tmp_path / "m", drafter=kind, drafter_path=dpath, tree=tree or tree_file(tmp_path),
                         backend=backend, output_dir=tmp_path / "e", max_len=96, prefill_chunk=8, progress=False,
                         children=children, modes=",".join(modes))
    engine = specc.load(path)
    assert {f"fused_{m}" for m in modes} <= set(engine.graphs)
    assert engine.manifest.drafter["children"] == children
    calls = []
    for name in (f"fused_{m}" for m in modes):
        fused = engine.graphs[name]
        engine.graphs[name] = lambda *a, fused=fused: calls.append(1) or fused(*a)
    temperatures = (0.0, 0.9) if "greedy" in modes else (0.9, 0.6)
    runs = {}
    for use in (True, False):
        engine.use_fused = use
        runs[use] = [engine.generate(p, max_new_tokens=24, stop_at_eos=False, temperature=t, seed=3)
                     for p in (PROMPT, PROMPT * 2) for t in temperatures]
    assert [r.token_ids for r in runs[True]] == [r.token_ids for r in runs[False]]
    assert [r.stats.accepted_hist for r in runs[True]] == [r.stats.accepted_hist for r in runs[False]]
    if "greedy" in modes:
        assert runs[True][0].token_ids == hf_greedy(model, PROMPT, 24)
    assert len(calls) == sum(r.stats.steps for r in runs[True])  # every step ran the fused graph


def test_sequoia_refuses_when_nothing_was_accepted(tmp_path, monkeypatch):
    import specc.calibrate as cal

    model = tiny_model("llama", vocab=64, layers=1, seed=2)
    model.save_pretrained(tmp_path / "m")
    monkeypatch.setattr(cal, "measure", lambda *a, **k: ([[0.0] * 4] * 3, 3, {}))
    with pytest.raises(SpeccError, match="no draft the target ever accepted"):
        specc.compile(tmp_path / "m", drafter="ngram", tree="sequoia:4", output_dir=tmp_path / "e", progress=False,
                      modes="greedy")
    assert not (tmp_path / "e").exists()
    assert [p.name for p in tmp_path.iterdir() if ".calibrate-" in p.name] == []
