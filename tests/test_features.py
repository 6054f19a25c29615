"""Teacher-forced features (specc.features) and the losses that read them: every assistant turn is
scored with its history, extraction resumes to exactly what one run makes, reading streams shards in
a resumable order, DFlash counts a block row only on the target's greedy path, soft targets are the
top-k cross-entropy, and the training pipeline memorises a handful of sequences (a bug check: wrong
offsets cannot)."""
from __future__ import annotations

import json

import pytest
import torch

from specc.errors import SpeccError
from specc.features import Features, FeatureSpec, conversation_sequence, extract
from specc.drafters import get_kind
from specc.drafters.dflash.train import DFlashTrainer
from specc.drafters.dspark.train import total_variation
from specc.drafters.mtp.train import MTPTrainer
from specc.drafters.training import hidden_loss, target_loss
from specc.train import TrainConfig, evaluate


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """SmolLM2's tokenizer (real chat template) and a tiny random Llama over its vocabulary."""
    from specc.models import load_model
    from specc.train import smoke_target

    tok = load_model(None).tokenizer
    return tok, smoke_target(tmp_path_factory.mktemp("smoke") / "target", tok)


def test_every_assistant_turn_is_scored_with_its_history(smol):
    tok, _ = smol
    turns = [("user", "Name a fruit."), ("assistant", "An apple."), ("user", "Another?"), ("assistant", "A pear.")]
    ids, loss = conversation_sequence(tok, turns, 1024)
    scored = tok.decode([ids[j + 1] for j in range(len(ids)) if loss[j]])
    assert scored == "An apple.<|im_end|>A pear.<|im_end|>"
    assert tok.decode(ids).count("<|im_start|>assistant\n") == 2  # the history is in the sequence
    cut_ids, cut_loss = conversation_sequence(tok, turns, 40)
    assert cut_ids == ids[:40] and cut_loss == loss[:40]


def _spec(**kw):
    return FeatureSpec(**{"taps": (0, 2), "topk": 4, "max_len": 48, "shard_tokens": 100, "model": "tiny", **kw})


def test_extraction_resumes_to_what_one_run_makes(smol, tmp_path):
    tok, model = smol
    spec = _spec()
    one = extract(model, tok, spec, tmp_path / "one", 400, progress=False)
    extract(model, tok, spec, tmp_path / "two", 150, progress=False)
    two = extract(model, tok, spec, tmp_path / "two", 400, progress=False, log=lambda m: None)
    assert one["shards"] == two["shards"] and sum(s["tokens"] for s in one["shards"]) >= 400
    assert {"sharegpt", "code"} <= {k for s in one["shards"] for k in s["sources"]}  # the mixture
    a, b = Features.open(tmp_path / "one"), Features.open(tmp_path / "two")
    for n in range(len(one["shards"])):
        for ra, rb in zip(a.shard(n), b.shard(n)):
            assert all(torch.equal(ra[k], rb[k]) for k in ra)
    # Labels: the fp32 target's argmax; the hidden and taps: its hidden states; top-k: its log-softmax.
    rec = a.shard(0)[0]
    with torch.no_grad():
        out = model(rec["ids"].long()[None], output_hidden_states=True)
    assert torch.equal(rec["labels"].long(), out.logits[0].argmax(-1))
    torch.testing.assert_close(rec["hidden"].float(), out.hidden_states[-1][0], atol=0.05, rtol=0.02)
    torch.testing.assert_close(rec["taps"][:, 64:].float(), out.hidden_states[3][0], atol=0.05, rtol=0.02)
    torch.testing.assert_close(rec["topk_logp"].float(), out.logits[0].log_softmax(-1).topk(4).values,
                               atol=0.01, rtol=0.01)
    with pytest.raises(SpeccError, match="other settings"):
        extract(model, tok, _spec(topk=2), tmp_path / "one", 500, progress=False)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("precious")
    with pytest.raises(SpeccError, match="not a features folder"):
        extract(model, tok, spec, tmp_path / "notes", 100, progress=False)
    assert [p.name for p in (tmp_path / "notes").iterdir()] == ["mine.txt"]
    # A corpus that no longer replays the same (another Python or tokenizer) cannot resume the folder.
    index = json.loads((tmp_path / "two" / "index.json").read_text())
    index["shards"][-1]["last"] = "0" * 16
    (tmp_path / "two" / "index.json").write_text(json.dumps(index))
    with pytest.raises(SpeccError, match="corpus differs"):
        extract(model, tok, spec, tmp_path / "two", 800, progress=False, log=lambda m: None)
    assert len(Features.open(tmp_path / "one", shards=2).index["shards"]) == 2


def test_reading_order_covers_each_sequence_once_per_epoch(smol, tmp_path):
    tok, model = smol
    extract(model, tok, _spec(sources=("code",)), tmp_path / "f", 300, progress=False)
    f = Features.open(tmp_path / "f")
    n = f.sequences
    epoch0 = [f.locate(s, seed=3) for s in range(n)]
    assert len(set(epoch0)) == n and all(i < f.index["shards"][k]["sequences"] for k, i in epoch0)
    assert [f.locate(s, seed=3) for s in range(n)] == epoch0  # a function of the step: resumable
    assert [f.locate(n + s, seed=3) for s in range(n)] != epoch0  # a new order each epoch
    assert torch.equal(f.record(5, seed=3)["ids"], f.shard(epoch0[5][0])[epoch0[5][1]]["ids"])


def _record(n=40, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n,), generator=g)
    labels = torch.randint(0, vocab, (n,), generator=g)
    follow = torch.rand(n, generator=g) < 0.7  # the text follows the greedy path here
    labels[:-1] = torch.where(follow[:-1], ids[1:], labels[:-1])
    loss = torch.rand(n, generator=g) < 0.8
    return {"ids": ids, "labels": labels, "loss": loss, "taps": torch.randn(n, 2 * 32, generator=g),
            "topk_ids": torch.randint(0, vocab, (n, 4), generator=g), "topk_logp": torch.randn(n, 4, generator=g)}


def test_dflash_rows_count_only_on_the_greedy_path():
    from tiny import tiny_model

    model = tiny_model("llama", vocab=64, layers=4, seed=0)
    tr = DFlashTrainer(model, TrainConfig(block_size=6, taps=2), 3)
    for seed in range(3):
        rec = _record(seed=seed)
        anchors = torch.tensor([0, 7, 20, 33, 36])
        _, pos, valid = tr._logits(rec, anchors)
        N = len(rec["ids"])
        for r, a in enumerate(anchors.tolist()):
            for k in range(1, 6):  # row k-1 predicts token a+k; its label is at a+k-1
                j = a + k - 1
                want = j < N and bool(rec["loss"][j]) and all(rec["ids"][a + m] == rec["labels"][a + m - 1]
                                                              for m in range(1, k))
                assert bool(valid[r, k - 1]) == want, (seed, a, k)
                if j < N:
                    assert pos[r, k - 1] == j


def test_mtp_rows_past_depth_one_count_only_on_the_greedy_path():
    from tiny import tiny_model

    model = tiny_model("llama", vocab=64, layers=2, seed=0)
    tr = MTPTrainer(model, TrainConfig(drafter="mtp", block_size=4), 3)
    for seed in range(3):
        rec = _record(seed=seed)
        ids, labels, loss = rec["ids"], rec["labels"], rec["loss"]
        for d, rows in enumerate(tr.counted(rec), start=1):  # row i reads t_{i+1} .. t_{i+d}, labelled at i+d
            want = [i for i in range(len(ids) - d)
                    if loss[i + d] and all(ids[i + m + 1] == labels[i + m] for m in range(1, d))]
            assert rows.tolist() == want, (seed, d)


def test_mtp_scores_a_sample_of_rows_when_asked():
    """--rows: the loss over a random sample of the counted rows is an unbiased estimate of the full one."""
    from tiny import tiny_model

    model = tiny_model("llama", vocab=64, layers=2, seed=0)
    rec = _record(n=60)
    rec["hidden"] = torch.randn(60, model.config.hidden_size)
    full = MTPTrainer(model, TrainConfig(drafter="mtp", block_size=3), 3)
    part = MTPTrainer(model, TrainConfig(drafter="mtp", block_size=3, rows=8), 3)
    part.heads.load_state_dict(full.heads.state_dict())
    with torch.no_grad():
        whole = float(full.loss(rec, torch.Generator().manual_seed(0)))
        draws = [float(part.loss(rec, torch.Generator().manual_seed(s))) for s in range(200)]
    assert len(set(draws)) > 1 and abs(sum(draws) / len(draws) - whole) < 0.05 * whole


def test_drafter_layers_start_from_the_target_and_regression_reads_its_hidden():
    from tiny import tiny_model

    model = tiny_model("llama", vocab=64, layers=4, seed=0)
    mtp = MTPTrainer(model, TrainConfig(drafter="mtp", block_size=3, init="target"), 3)
    torch.testing.assert_close(mtp.heads.mtp[0].layer.mlp.up_proj.weight, model.model.layers[-1].mlp.up_proj.weight)
    dfl = DFlashTrainer(model, TrainConfig(block_size=4, taps=2, layers=2, init="target"), 3)
    for mine, theirs in zip(dfl.drafter.layers, model.model.layers[-2:]):
        torch.testing.assert_close(mine.self_attn.q_proj.weight, theirs.self_attn.q_proj.weight)
        torch.testing.assert_close(mine.post_attention_layernorm.weight, theirs.post_attention_layernorm.weight)
    assert not torch.equal(MTPTrainer(model, TrainConfig(drafter="mtp", block_size=3), 3).heads.mtp[0].layer
                           .mlp.up_proj.weight, model.model.layers[-1].mlp.up_proj.weight)
    rec = {"hidden": torch.randn(10, 32)}
    rows = torch.tensor([2, 5])
    assert hidden_loss(rec["hidden"][rows], rec, rows).abs().max() == 0
    assert (hidden_loss(rec["hidden"][rows] + 1.0, rec, rows) > 0).all()


def test_soft_targets_are_the_top_k_cross_entropy():
    rec = _record()
    logits = torch.randn(5, 64)
    rows = torch.tensor([1, 4, 9, 16, 25])
    ce = torch.nn.functional.cross_entropy(logits, rec["labels"][rows], reduction="none")
    torch.testing.assert_close(target_loss(logits, rec, rows, 0.0), ce)
    p = rec["topk_logp"][rows].softmax(-1)
    kl = -(p * logits.log_softmax(-1).gather(-1, rec["topk_ids"][rows])).sum(-1)
    torch.testing.assert_close(target_loss(logits, rec, rows, 1.0), kl)
    torch.testing.assert_close(target_loss(logits, rec, rows, 0.25), 0.75 * ce + 0.25 * kl)


def test_total_variation_against_brute_force():
    """Over the target's top-k plus one cell for the rest: the distance between the two distributions
    coarsened to that partition (exact when k covers the vocabulary); without top-k: 1 - p(label)."""
    g = torch.Generator().manual_seed(0)
    V, R, k = 12, 5, 4
    p = torch.randn(R, V, generator=g).softmax(-1)
    pt = (torch.randn(R, V, generator=g) * 2).softmax(-1)
    top = pt.topk(k, dim=-1)
    rec = {"labels": top.indices[:, 0], "topk_ids": top.indices, "topk_logp": top.values.log().half()}
    rows = torch.arange(R)
    for r in range(R):
        cells = [[int(v)] for v in top.indices[r]] + [[v for v in range(V) if v not in top.indices[r]]]
        want = 0.5 * sum(abs(float(p[r, c].sum() - pt[r, c].sum())) for c in cells)
        assert float(total_variation(p, rec, rows)[r]) == pytest.approx(want, abs=2e-3)  # fp16 log-probs
    full = pt.topk(V, dim=-1)
    exact = {"labels": rec["labels"], "topk_ids": full.indices, "topk_logp": full.values.log()}
    torch.testing.assert_close(total_variation(p, exact, rows), 0.5 * (p - pt).abs().sum(-1))
    hard = {"labels": rec["labels"]}
    torch.testing.assert_close(total_variation(p, hard, rows), 1 - p[rows, rec["labels"]])


@pytest.mark.parametrize("kind", ["mtp", "dflash", "dspark"])
def test_training_memorises_a_few_sequences(smol, tmp_path, kind):
    """Trained and evaluated on the same four sequences (the target's own greedy continuations, as
    regenerated training data is), a correct pipeline memorises them (tau far above 2). Drafts scored
    against shifted labels (an offset bug) could not."""
    from specc.drafters.dflash.model import choose_mask_token, default_layer_ids
    from specc.features import target_features

    torch.manual_seed(0)
    tok, model = smol
    texts = ["def add(a, b):\n    return a + b\n", "The cat sat on the mat and looked at the door.",
             "for i in range(10):\n    print(i * i)\n", "Paris is the capital of France, and Rome of Italy."]
    spec = FeatureSpec(taps=tuple(default_layer_ids(model.config.num_hidden_layers, 2)), topk=0, model="tiny")
    recs = []
    for t in texts:
        prompt = tok(t)["input_ids"]
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                 pad_token_id=0)[0].tolist()
        r = target_features(model, ids, [j >= len(prompt) - 1 for j in range(len(ids))], spec)
        r["ids"], r["labels"] = r["ids"].long(), r["labels"].long()
        recs.append(r)
    cfg = TrainConfig(drafter=kind, block_size=4, taps=2, anchors=32, lr=3e-3, markov_rank=16)
    tr = get_kind(kind).TRAINER(model, cfg, choose_mask_token(tok, model.config.vocab_size), recs)
    opt = torch.optim.AdamW(tr.parameters(), lr=cfg.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    before = evaluate(tr, recs)["tau"]
    for step in range(150):
        loss = tr.loss(recs[step % 4], gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = evaluate(tr, recs)
    assert after["tau"] > 2.5 > before, (before, after)
    tr.save(tmp_path / "saved")  # the published format computes what was trained (fc's input scale folded in)
    again = get_kind(kind).TRAINER(model, cfg, choose_mask_token(tok, model.config.vocab_size), recs)
    again.load(tmp_path / "saved")
    assert evaluate(again, recs) == after


@pytest.mark.parametrize("argv,needle", [(["--tokens", "10", "--sources", "web"], "feature sources"),
                                         (["--tokens", "0"], "--tokens"),
                                         (["--tokens", "10", "--max-len", "4"], "at least 16 tokens")])
def test_features_command_refuses_bad_input(tmp_path, argv, needle):
    from conftest import run_specc

    proc = run_specc("features", "-o", tmp_path / "feat", *argv)
    assert proc.returncode == 2 and proc.stderr.startswith("specc: error:") and proc.stderr.count("\n") == 1
    assert needle in proc.stderr and not (tmp_path / "feat").exists()
