"""DSpark: the Markov head's tree drafting against a node-by-node oracle, the checkpoint format,
and engines whose drafts equal the teacher-forced forward and whose output equals the target's."""
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specc
from specc.drafters.dflash.model import dflash_config_for
from specc.drafters.dspark.model import (DSparkDrafter, load_dspark, markov_drafts, markov_drafts_reference,
                                         save_dspark)
from specc.errors import SpeccError
from specc.tree import tree_from_paths
from test_engine import PROMPT, hf_greedy, random_dflash, record
from tiny import tiny_model


def random_dspark(target, path=None, block=4, layers=1, seed=0, rank=8):
    """A DSpark drafter with random weights (heads included), saved to `path` when given."""
    torch.manual_seed(seed)
    d = DSparkDrafter(dflash_config_for(target.config, num_layers=layers, block_size=block, num_taps=2,
                                        mask_token_id=3), markov_rank=rank)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn_like(p) * 0.3 if p.dim() > 1 else 1 + 0.1 * torch.randn_like(p))
    return (save_dspark(d, path) if path is not None else None), d


@st.composite
def trees(draw, max_nodes=12, max_depth=4):
    """Prefix-closed trees with contiguous sibling ranks: each new node is its parent's next child."""
    paths = [()]
    for pick in draw(st.lists(st.integers(0, 10**6), max_size=max_nodes - 1)):
        parent = paths[pick % len(paths)]
        if len(parent) < max_depth:
            paths.append(parent + (sum(1 for p in paths if p[:-1] == parent and len(p) == len(parent) + 1),))
    return tree_from_paths([list(p) for p in paths[1:]] or [[0]])


@settings(max_examples=40, deadline=None)
@given(trees(), st.integers(0, 2**31 - 1))
def test_markov_tree_drafts_equal_the_node_by_node_oracle(tree, seed):
    """Each node ranks its depth's row plus the Markov term of its parent's token and takes its own
    rank; its confidence is that row's head under the parent's token."""
    target = tiny_model("llama", vocab=64, layers=2, seed=0)
    _, d = random_dspark(target, seed=seed % 1000)
    g = torch.Generator().manual_seed(seed)
    D, V, H = tree.max_depth, 64, target.config.hidden_size
    logits, h = torch.randn(D, V, generator=g) * 3, torch.randn(D, H, generator=g)
    anchor = int(torch.randint(V, (1,), generator=g))
    with torch.no_grad():
        drafts, conf = markov_drafts(d, logits, h, torch.tensor([anchor]), tree)
        ref_drafts, ref_conf = markov_drafts_reference(d, logits, h, anchor, tree)
    assert drafts.tolist() == ref_drafts
    assert conf.tolist() == pytest.approx(ref_conf, abs=1e-6)


def test_the_markov_term_changes_children_with_their_parent():
    """Two depth-1 siblings get different children when the Markov head favours different tokens
    after each (a DFlash tree would give both the same candidates)."""
    target = tiny_model("llama", vocab=64, layers=2, seed=0)
    _, d = random_dspark(target)
    tree = tree_from_paths([[0], [1], [0, 0], [1, 0]])
    with torch.no_grad():
        d.markov.w1.weight.zero_()
        d.markov.w2.weight.zero_()
        logits = torch.zeros(2, 64)
        logits[0, 10], logits[0, 11] = 5.0, 4.0  # depth 1: tokens 10 and 11
        d.markov.w1.weight[10, 0] = d.markov.w1.weight[11, 1] = 1.0
        d.markov.w2.weight[20, 0] = d.markov.w2.weight[21, 1] = 9.0  # after 10 -> 20, after 11 -> 21
        drafts, _ = markov_drafts(d, logits, torch.zeros(2, target.config.hidden_size), torch.tensor([1]), tree)
    assert drafts.tolist() == [10, 11, 20, 21]


def test_checkpoint_round_trip_and_refusals(tmp_path):
    target = tiny_model("llama", vocab=64, layers=2, seed=0)
    path, d = random_dspark(target, tmp_path / "ds")
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["DSparkDraftModel"] and config["dspark_config"] == {"markov_rank": 8}
    back = load_dspark(path)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in d.state_dict().items())
    assert {"markov.w1.weight", "markov.w2.weight", "confidence.weight", "confidence.bias"} <= set(back.state_dict())
    dflash, _ = random_dflash(target, tmp_path / "df")
    with pytest.raises(SpeccError, match="not a DSpark drafter"):
        load_dspark(dflash)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path / "model.safetensors"))
    del weights["confidence.bias"]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(SpeccError, match="lacks weight 'confidence.bias'"):
        load_dspark(path)


@pytest.mark.parametrize("tree", ["chain:4", "topk:2,2"])
def test_dspark_engine_drafts_the_teacher_forced_forward(tmp_path, tree, monkeypatch):
    """Greedy output equals the target's, fused and unfused; every tree the drafter's graph drafts
    equals the oracle over a teacher-forced forward of the committed tokens (context rows, positions,
    anchor, and the anchor row drafting), confidences included; the fused step returns the
    confidences the drafter's graph gives for the same trees. The block is the trained length (4)
    even where the tree is shallower."""
    from specc import strategies
    from specc.drafters.dflash.model import block_hidden
    from specc.tree import parse_tree

    model = tiny_model("llama", vocab=64, layers=3, seed=2)
    model.save_pretrained(tmp_path / "m")
    dpath, d = random_dspark(model, tmp_path / "ds", block=4)
    path = specc.compile(tmp_path / "m", drafter="dspark", drafter_path=dpath, tree=tree, backend="eager",
                         output_dir=tmp_path / "e", max_len=64, prefill_chunk=8, progress=False, modes="greedy")
    assert json.loads((path / "specc.json").read_text())["drafter"]["block_size"] == 4
    engine = specc.load(path)
    t = parse_tree(tree)
    propose = type(engine.drafter).propose.__get__(engine.drafter)
    fused_step = strategies.fused_step
    rated = {False: [], True: []}  # per generation step: the confidences of the tree drafted for the next one

    def proposing(committed):
        out = propose(committed)
        seen.append((list(committed), out[0].tolist(), engine.drafter.confidence.tolist()))
        return out

    def fused(run):
        out = fused_step(run)
        rated[True].append(run.next_confidence.tolist())
        return out

    engine.drafter.propose = proposing
    monkeypatch.setattr(strategies, "fused_step", fused)  # the strategy the engine picks
    for use_fused in (False, True):
        engine.use_fused = use_fused
        seen = []
        res = engine.generate(PROMPT, max_new_tokens=20, stop_at_eos=False)
        assert res.token_ids == hf_greedy(model, PROMPT, 20)
        rated[use_fused] = [c for _, _, c in seen] + (rated[True] if use_fused else [])
        if use_fused:
            assert len(seen) == 1  # the first tree; the fused step drafts the rest
            continue
        assert len(seen) >= 10
        with torch.no_grad():
            for committed, drafts, conf in seen:
                hs = model(torch.tensor([committed]), output_hidden_states=True).hidden_states
                taps = torch.cat([hs[i + 1][0] for i in d.config.target_layer_ids], dim=-1)
                h = block_hidden(d, model.model.embed_tokens, taps, torch.tensor(committed),
                                 torch.tensor([len(committed) - 1]), 4)[0][: t.max_depth]
                ref, ref_conf = markov_drafts_reference(d, h @ model.lm_head.weight.T, h, committed[-1], t)
                assert drafts == ref
                assert conf == pytest.approx(ref_conf, abs=1e-5) and all(0 < c < 1 for c in conf)
    n = len(rated[False])
    assert n >= 10 and torch.allclose(torch.tensor(rated[True][:n]), torch.tensor(rated[False]), atol=1e-5)


def test_training_forward_is_the_engine_chain(tmp_path):
    """The trainer's evaluation forward (the held-out tau) drafts what the engine's chain drafts:
    over text where the drafts were accepted (the committed tokens followed by the engine's drafts,
    labelled as the target's choices), its argmax per block row equals the engine's drafts."""
    from specc.drafters.dspark.train import DSparkTrainer
    from specc.train import TrainConfig

    model = tiny_model("llama", vocab=64, layers=3, seed=2)
    model.save_pretrained(tmp_path / "m")
    dpath, d = random_dspark(model, tmp_path / "ds", block=4)
    engine = specc.load(specc.compile(tmp_path / "m", drafter="dspark", drafter_path=dpath, tree="chain:4",
                                      backend="eager", output_dir=tmp_path / "e", max_len=64, prefill_chunk=8,
                                      progress=False, modes="greedy"))
    engine.use_fused = False
    seen = []
    engine.drafter.propose = record(type(engine.drafter).propose.__get__(engine.drafter), seen)
    engine.generate(PROMPT, max_new_tokens=12, stop_at_eos=False)
    trainer = DSparkTrainer(model, TrainConfig(drafter="dspark", block_size=4, taps=2, markov_rank=8), 3)
    trainer.drafter.load_state_dict(d.state_dict())
    for committed, (drafts, _) in seen[:6]:
        ids = torch.tensor(committed + drafts)
        with torch.no_grad():
            hs = model(ids[None], output_hidden_states=True).hidden_states
        taps = torch.cat([hs[i + 1][0] for i in d.config.target_layer_ids], dim=-1)
        labels = torch.cat((ids[1:], ids[:1]))  # as if the target had chosen every draft
        rec = {"ids": ids, "labels": labels, "taps": taps, "loss": torch.ones(len(ids), dtype=torch.bool)}
        with torch.no_grad():
            logits, _ = trainer._draft_logits(rec, torch.tensor([len(committed) - 1]), 4)
        assert logits[0].argmax(-1).tolist() == drafts


def test_dspark_refusals(tmp_path):
    model = tiny_model("llama", vocab=64, layers=2, seed=0)
    model.save_pretrained(tmp_path / "m")
    dpath, _ = random_dspark(model, tmp_path / "ds", block=3)
    with pytest.raises(SpeccError, match="--drafter-path"):
        specc.compile(tmp_path / "m", drafter="dspark", output_dir=tmp_path / "e1", progress=False)
    with pytest.raises(SpeccError, match="block of 3 gives 3"):
        specc.compile(tmp_path / "m", drafter="dspark", drafter_path=dpath, tree="chain:4",
                      output_dir=tmp_path / "e2", progress=False)
    with pytest.raises(SpeccError, match="--children sampled"):
        specc.compile(tmp_path / "m", drafter="dspark", drafter_path=dpath, tree="topk:2,2", children="sampled",
                      output_dir=tmp_path / "e3", progress=False)
    assert not any((tmp_path / n).exists() for n in ("e1", "e2", "e3"))


def test_sequoia_tree_for_dspark(tmp_path, monkeypatch):
    """sequoia:BUDGET measures a DSpark drafter's ranked candidates on a comb and compiles the DP's
    tree, run at the block length the comb was measured at; greedy output still equals the target's."""
    import specc.calibrate as cal

    monkeypatch.setattr(cal, "PROMPTS", 2)
    monkeypatch.setattr(cal, "NEW_TOKENS", 12)
    model = tiny_model("llama", vocab=64, layers=2, seed=2)
    model.save_pretrained(tmp_path / "m")
    dpath, _ = random_dspark(model, tmp_path / "ds", block=5)  # trained lengths 4 and 5
    path = specc.compile(tmp_path / "m", drafter="dspark", drafter_path=dpath, tree="sequoia:5",
                         output_dir=tmp_path / "e", max_len=64, prefill_chunk=8, progress=False, modes="greedy")
    manifest = json.loads((path / "specc.json").read_text())
    tree = manifest["tree"]
    assert tree["spec"] == "sequoia:5" and len(tree["paths"]) <= 5 and len(tree["acceptance"]) == 4  # budget - 1
    # the block its comb was measured at, however shallow the tree (rows depend on the block's length)
    assert manifest["drafter"]["block_size"] == 5
    engine = specc.load(path)
    assert engine.generate(PROMPT, max_new_tokens=20, stop_at_eos=False).token_ids == hf_greedy(model, PROMPT, 20)
