"""`specc train`: the smoke run CI relies on (a tiny random target over SmolLM2's tokenizer), its
resumption, the held-out tau, and an engine compiled with the trained drafter that stays lossless."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import run_specc
from specc.train import TrainConfig, sharegpt_pairs, tau_of, usable_cpus


def test_tau_of_counts_leading_matches():
    acc = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert tau_of(acc) == pytest.approx(1 + (2 + 0 + 4) / 3)
    assert tau_of(acc, 1) == pytest.approx(1 + 2 / 3)


def test_threads_follow_the_cpus_the_process_may_use(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {1})  # as under `taskset -c 1`
    assert usable_cpus() == 1
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2})
    assert usable_cpus() == 3


def test_training_prompts_never_come_from_evaluation_sets():
    from specc.data import mt_bench_prompts
    from specc.train import _norm

    held = mt_bench_prompts()[0]
    pairs = sharegpt_pairs(50, {_norm(held)})
    assert len(pairs) == 50 and all(p and r for p, r in pairs)
    pairs_all = sharegpt_pairs(50, set())
    assert [p for p, _ in pairs] == [p for p, _ in pairs_all]  # the first 50 ShareGPT prompts are not MT-Bench's
    assert sharegpt_pairs(3, {_norm(pairs_all[0][0])})[0][0] == pairs_all[1][0]  # an excluded one is skipped


def test_config_checks():
    from specc.errors import SpeccError

    with pytest.raises(SpeccError, match="block-size"):
        TrainConfig(block_size=1).check()
    with pytest.raises(SpeccError, match="--steps"):
        TrainConfig(steps=0).check()


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "dflash"
    proc = run_specc("train", "--drafter", "dflash", "--smoke", "--json", "-o", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr
    return out, json.loads(proc.stdout)


@pytest.mark.slow
def test_smoke_trains_a_loadable_drafter(smoke_run):
    from specc.drafters.dflash.model import load_dflash

    out, res = smoke_run
    assert res["steps"] == 40 and res["sequences"] > 0 and res["eval"]["tau"] >= 1.0
    prog = json.loads((out / "train" / "progress.json").read_text())
    assert prog["step"] == 40 and prog["config"]["drafter"] == "dflash"
    losses = [h["loss"] for h in prog["history"] if "loss" in h]
    assert len(losses) == 40 and sum(losses[-10:]) < sum(losses[:10])  # it learns
    d = load_dflash(out)
    assert d.config.block_size == 4 and d.config.num_target_layers == 4
    assert (out / "train" / "curve.png").stat().st_size > 0


@pytest.mark.slow
def test_rerun_resumes_and_refuses_another_config(smoke_run):
    out, _ = smoke_run
    before = (out / "model.safetensors").read_bytes()
    again = run_specc("train", "--drafter", "dflash", "--smoke", "--json", "-o", str(out), timeout=600)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["train_s"] < 5  # nothing left to do
    assert (out / "model.safetensors").read_bytes() == before
    other = run_specc("train", "--drafter", "dflash", "--smoke", "--steps", "60", "-o", str(out), timeout=600)
    assert other.returncode == 2 and "another configuration" in other.stderr and "Traceback" not in other.stderr


@pytest.mark.slow
def test_engine_with_trained_drafter_is_lossless(smoke_run, tmp_path):
    import specc
    from transformers import AutoModelForCausalLM

    out, res = smoke_run
    target_dir = res["smoke_target"]
    engine = specc.load(specc.compile(target_dir, drafter="dflash", drafter_path=out, tree="chain:3",
                                      output_dir=tmp_path / "e", max_len=128, prefill_chunk=16, progress=False,
                                      modes="greedy"))
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    for prompt in ("Write a short poem about the sea.", "def add(a, b):"):
        res = engine.generate(prompt, max_new_tokens=24, chat=True, stop_at_eos=False)
        seq = engine.encode(prompt, chat=True)
        n = len(seq)
        with torch.no_grad():
            for _ in range(24):  # the target alone, greedy, EOS not stopping it
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert res.token_ids == seq[n:]


@pytest.mark.slow
def test_mtp_smoke(tmp_path):
    from specc.drafters.mtp.model import load_deepseek_v3
    from specc.train import train
    from transformers import AutoModelForCausalLM

    res = train(None, tmp_path / "mtp", TrainConfig(drafter="mtp", **{**_smoke(), "steps": 10}), smoke=True,
                progress=False, log=lambda m: None)
    assert res["eval"]["tau"] >= 1.0
    target = AutoModelForCausalLM.from_pretrained(res["smoke_target"])
    heads = load_deepseek_v3(tmp_path / "mtp", target)
    assert heads.config.num_modules == 1


def _smoke():
    from specc.train import SMOKE

    return dict(SMOKE)


def test_accepted_on_sequences_too_short_for_a_block():
    """A held-out response shorter than a block gives no anchors rather than an error."""
    from tiny import tiny_model
    from specc.drafters import get_kind
    from specc.train import sequence_features

    model = tiny_model("llama", vocab=64, layers=2, seed=0)
    for kind in ("dflash", "mtp"):
        tr = get_kind(kind).TRAINER(model, TrainConfig(drafter=kind, block_size=4, taps=2), 3)
        for n, rows in ((6, 0), (20, 13)):  # 1 response token (block of 4), then 15
            ids = torch.arange(n)
            (rec,) = sequence_features(model, [(ids, 5)], tr.layer_ids, True, True)
            acc = tr.accepted(rec)
            assert acc.shape[1] == 3 and (acc.shape[0] == 0) == (rows == 0)


def test_saved_drafter_folds_the_input_scale(tmp_path):
    """Training sees taps divided by their RMS; the saved fc.weight folds that scale back in, so the
    published-format checkpoint computes exactly what was trained, and loading it to resume unfolds it."""
    from tiny import tiny_model
    from specc.drafters.dflash.model import draft_logits, load_dflash
    from specc.drafters.dflash.model import default_layer_ids
    from specc.drafters.dflash.train import DFlashTrainer
    from specc.train import sequence_features, target_view

    model = tiny_model("llama", vocab=64, layers=4, seed=1)
    seqs = [(torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(i)), 10) for i in range(3)]
    feats = sequence_features(model, seqs, default_layer_ids(4, 2), False, True)
    tr = DFlashTrainer(model, TrainConfig(block_size=4, taps=2), 3, feats)
    assert not torch.allclose(tr.scale, torch.ones_like(tr.scale))
    ids, anchors = seqs[0][0], torch.tensor([10, 15, 20])
    trained = tr._logits(feats[0], anchors)[0]
    tr.save(tmp_path / "d")
    loaded = load_dflash(tmp_path / "d")
    taps = target_view(model, ids, loaded.config.target_layer_ids)[0]
    plain = draft_logits(loaded, model.model.embed_tokens, model.lm_head.weight, taps, ids, anchors)
    torch.testing.assert_close(plain, trained, rtol=1e-4, atol=1e-4)
    again = DFlashTrainer(model, TrainConfig(block_size=4, taps=2), 3, feats)
    again.load(tmp_path / "d")
    torch.testing.assert_close(again.drafter.fc.weight, tr.drafter.fc.weight)


@pytest.mark.parametrize("case", ["output-is-a-file", "output-has-other-content", "missing-model"])
def test_train_bad_input(tmp_path, case):
    out = tmp_path / "run"
    model = []
    if case == "output-is-a-file":
        out.write_text("precious")
    elif case == "output-has-other-content":
        out.mkdir()
        (out / "notes.txt").write_text("precious")
    else:
        model = [str(tmp_path / "no-such-model")]
    proc = run_specc("train", *model, "--drafter", "dflash", "--smoke", "-o", str(out), timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("specc: error:") and proc.stderr.count("\n") == 1
    if case == "missing-model":
        assert "no-such-model" in proc.stderr and not out.exists()
    else:
        assert "refusing to overwrite" in proc.stderr
        assert out.read_text() == "precious" if out.is_file() else sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_sequence_features_labels_and_cache(tmp_path):
    """Regenerated responses label each position with its own next token (the greedy choice); the
    prompt keeps the forward's argmax. The cache round-trips and is ignored when made for other settings."""
    from tiny import tiny_model
    from specc.train import load_features, save_features, sequence_features, target_view

    model = tiny_model("llama", vocab=64, layers=4, seed=2)
    seqs = [(torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)), 5) for n in (12, 20)]
    feats = sequence_features(model, seqs, [1, 2], True, regenerated=True)
    for (ids, plen), rec in zip(seqs, feats):
        ref_taps, ref_hidden, argmax = target_view(model, ids, [1, 2])
        labels = rec["labels"]
        assert torch.equal(labels[plen - 1: -1], ids[plen:])
        assert torch.equal(labels[: plen - 1], argmax[: plen - 1]) and labels[-1] == argmax[-1]
        assert rec["loss"].tolist() == [j >= plen - 1 for j in range(len(ids))]  # the response's labels
        torch.testing.assert_close(rec["taps"], ref_taps)
        torch.testing.assert_close(rec["hidden"], ref_hidden)
    meta = {"layer_ids": [1, 2], "dtype": "None"}
    save_features(feats, tmp_path / "f.safetensors", meta)
    back = load_features(tmp_path / "f.safetensors", meta)
    assert all(fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa) for fa, fb in zip(feats, back))
    assert load_features(tmp_path / "f.safetensors", {**meta, "layer_ids": [0, 1]}) is None
    assert load_features(tmp_path / "missing.safetensors", meta) is None


def test_ship_copies_a_run_into_the_assets(tmp_path, monkeypatch):
    """`python -m specc.shipped RUN KIND DTYPE`: weights (cast), config and training.json land in the
    assets directory that compile's default path reads; a run of another drafter kind is refused."""
    import json

    from safetensors.torch import load_file, save_file

    import specc.shipped as shipped

    monkeypatch.setattr(shipped, "ASSETS", tmp_path / "assets")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    (run / "training.json").write_text(json.dumps({"config": {"drafter": "dflash"}, "command": "specc train"}))
    save_file({"fc.weight": torch.randn(4, 6), "ids": torch.arange(3)}, str(run / "model.safetensors"))
    (run / "train").mkdir()
    (run / "train" / "progress.json").write_text(json.dumps({"history": [
        {"step": 0, "eval": {"tau": 1.0}}, {"step": 5, "loss": 2.0}, {"step": 10, "loss": 1.5, "eval": {"tau": 1.2}}]}))
    (run / "train" / "curve.png").write_bytes(b"\x89PNG")
    assert shipped.shipped_drafter("dflash") is None
    dest = shipped.ship(run, "dflash", "bfloat16")
    assert shipped.shipped_drafter("dflash") == dest
    w = load_file(str(dest / "model.safetensors"))
    assert w["fc.weight"].dtype == torch.bfloat16 and w["ids"].dtype == torch.int64
    assert shipped.training_summary(dest)["shipped_dtype"] == "bfloat16"
    assert shipped.training_summary(dest)["curve"] == [{"step": 0, "tau": 1.0}, {"step": 10, "tau": 1.2}]
    assert (dest / "curve.png").read_bytes() == b"\x89PNG"
    with pytest.raises(SystemExit, match="not mtp"):
        shipped.ship(run, "mtp")


def test_mtp_trains_on_features(tmp_path):
    """--features: the run extracts teacher-forced features (a tiny target over SmolLM2's tokenizer),
    trains from them alone (--prompts 0) with soft targets; a rerun with other settings is refused."""
    from specc.features import Features
    from specc.train import train

    feat = tmp_path / "feat"
    cfg = dict(_smoke(), drafter="mtp", steps=6, prompts=0, features=str(feat), feature_tokens=200,
               feature_max_len=48, feature_shard_tokens=64, soft=0.5, eval_every=3, checkpoint_every=3)
    res = train(None, tmp_path / "run", TrainConfig(**cfg), smoke=True, progress=False, log=lambda m: None)
    store = Features.open(feat)
    assert store.tokens >= 200 and len(store.index["shards"]) >= 3
    assert res["sequences"] == store.sequences and res["eval"]["tau"] >= 1.0
    history = json.loads((tmp_path / "run" / "train" / "progress.json").read_text())["history"]
    assert sum("loss" in h for h in history) == 6
    with pytest.raises(Exception, match="another configuration"):
        train(None, tmp_path / "run", TrainConfig(**{**cfg, "soft": 0.2}), smoke=True, progress=False,
              log=lambda m: None)
