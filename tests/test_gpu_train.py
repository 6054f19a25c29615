"""The GPU drafter run (examples/gpu_train.sh) as far as a CPU allows: the pieces it adds to `specc
train` (features computed in padded batches, a pre-tokenized corpus streamed through the target,
sequences packed into one record, a clock that ends the steps annealed), and the whole script end to
end on a tiny random target over SmolLM2's tokenizer: pack, parts stashed as separate device calls
would, assembly, training, and files that fit what comes back from the device."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import cli_env
from tiny import tiny_model

from specc.drafters.dflash.model import segment_starts
from specc.drafters.dspark.train import DSparkTrainer
from specc.errors import SpeccError
from specc.features import FeatureSpec, FeatureStream, TokenCorpus, batch_features, target_features
from specc.train import TrainConfig, lr_at

ROOT = Path(__file__).resolve().parents[1]
SPEC = FeatureSpec(taps=(0, 1), topk=4, hidden=False, model="tiny")


def _seq(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (n,), generator=g).tolist()
    loss = [j >= n // 4 for j in range(n)]
    loss[-1] = False
    return ids, loss


def test_batched_features_are_one_forward_each():
    model = tiny_model("llama", vocab=64, layers=2, seed=1)
    seqs = [_seq(n, n) for n in (23, 9, 17)]
    for rec, (ids, loss) in zip(batch_features(model, seqs, SPEC), seqs):
        one = target_features(model, ids, loss, SPEC)
        assert rec.keys() == one.keys()
        for k in ("ids", "labels", "loss", "topk_ids"):
            assert torch.equal(rec[k], one[k]), k
        torch.testing.assert_close(rec["taps"].float(), one["taps"].float(), atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(rec["topk_logp"].float(), one["topk_logp"].float(), atol=2e-3, rtol=1e-3)


def _trainer(model, block: int = 4):
    torch.manual_seed(0)
    return DSparkTrainer(model, TrainConfig(drafter="dspark", block_size=block, taps=2, markov_rank=8, anchors=64), 3)


def test_a_packed_record_trains_what_its_sequences_would():
    """Every block of a record that packs two sequences computes what it computes in its own sequence:
    hidden states, label positions (shifted) and which rows count, the ones past its sequence's end
    not counted."""
    model = tiny_model("llama", vocab=64, layers=2, seed=1)
    tr = _trainer(model)
    a, b = (target_features(model, *_seq(n, n), SPEC) for n in (21, 30))
    for r in (a, b):  # text on the target's greedy path for a few positions, so later rows count too
        r["ids"][5:9] = torch.cat((r["ids"][4:5], r["labels"][4:7])).to(r["ids"].dtype)
    packed = {k: torch.cat((a[k], b[k])) for k in a}
    packed["segments"] = torch.tensor([21, 30])
    assert segment_starts(packed["segments"]).tolist() == [0] * 21 + [21] * 30
    with torch.no_grad():
        for alone, offset, anchors in ((a, 0, [4, 17, 19, 20]), (b, 21, [0, 4, 26, 29])):
            at = torch.tensor(anchors)
            h1, p1, v1 = tr._logits(alone, at, head=False)
            h2, p2, v2 = tr._logits(packed, at + offset, head=False)
            torch.testing.assert_close(h2, h1, atol=1e-5, rtol=1e-5)
            assert torch.equal(v2, v1) and torch.equal(p2[v2], p1[v1] + offset)
            assert v1.any() and not v1.all()  # some rows count, the ones past the end do not


def _corpus(tmp_path, lengths) -> TokenCorpus:
    seqs = [_seq(n, i) for i, n in enumerate(lengths)]
    ids = np.concatenate([np.asarray(s, dtype=np.uint16) for s, _ in seqs])
    loss = np.concatenate([np.asarray(m, dtype=bool) for _, m in seqs])
    lengths = np.asarray(lengths, dtype=np.int64)
    return TokenCorpus(tmp_path, {}, lengths, np.concatenate([[0], np.cumsum(lengths)]), ids, loss)


def test_the_stream_reads_each_sequence_once_an_epoch_and_resumes(tmp_path):
    model = tiny_model("llama", vocab=64, layers=2, seed=1)
    lengths = [12, 30, 7, 19, 25, 16, 9, 28]
    corpus = _corpus(tmp_path, lengths)
    stream = FeatureStream(corpus, model, SPEC, seed=3, pack_tokens=40, batch_tokens=64, window_tokens=60)
    n = stream.sequences
    seen = []
    for step in range(n):
        rec = stream.record(step)
        segs = rec["segments"].tolist()
        assert sum(segs) == len(rec["ids"]) and (sum(segs) <= 40 or len(segs) == 1)
        for s, chunk in zip(segs, rec["ids"].split(segs)):
            i = next(i for i in range(len(lengths)) if lengths[i] == s)
            assert chunk.tolist() == corpus.sequence(i)[0].tolist()
            seen.append(i)
    assert sorted(seen) == list(range(len(lengths)))  # each sequence once in the epoch
    assert stream.positions == sum(lengths) and stream.windows >= 2
    again = FeatureStream(corpus, model, SPEC, seed=3, pack_tokens=40, batch_tokens=64, window_tokens=60)
    for step in (n + 1, 1):  # a resumed run: any step's record without the ones before
        for k, v in again.record(step).items():
            assert torch.equal(v, stream.record(step)[k]), k


def test_the_clock_ends_the_schedule_annealed():
    cfg = TrainConfig(lr=1e-3, steps=1000, time_budget=100.0)
    assert lr_at(0, cfg, 0.0) < 1e-4  # warming up
    assert lr_at(10, cfg, 50.0) == pytest.approx(lr_at(499, cfg, 0.0), rel=1e-6)  # halfway by the clock
    assert lr_at(10, cfg, 100.0) == pytest.approx(0.0, abs=1e-12)
    plain = TrainConfig(lr=1e-3, steps=1000)
    assert lr_at(500, plain, 99.0) == lr_at(500, plain)  # no budget: the step alone


def test_the_clock_stops_the_steps_evaluated_and_saved():
    from specc.train import _train_steps

    model = tiny_model("llama", vocab=64, layers=2, seed=1)
    tr = _trainer(model)
    rec = target_features(model, *_seq(40, 1), SPEC)
    cfg = TrainConfig(drafter="dspark", block_size=4, taps=2, markov_rank=8, steps=50, time_budget=1e-6)
    opt = torch.optim.AdamW(tr.parameters(), lr=cfg.lr)
    history, saved = [], []
    ran = _train_steps(tr, opt, cfg, lambda step, gen: rec, [rec], history, 0, saved.append, None, False)
    assert ran["steps"] == 1 and ran["stopped_by_time"] and ran["positions"] == 40
    assert saved == [0, 1] and "eval" in history[-1] and history[-1]["step"] == 1


def _sh(*args, env) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / "examples" / "gpu_train.sh"), *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


def test_dry_run_end_to_end(tmp_path):
    """--prepare --tiny, the parts but the last stashed (as separate device calls would), the run on the
    CPU with the last part carried: a drafter the project's loader reads, its training.json, held-out
    tau, and files within what the device returns."""
    from specc.drafters.dflash.model import check_fits
    from specc.drafters.dspark.model import load_dspark
    from transformers import AutoConfig

    env = dict(cli_env(), SPECC_GPU_TRAIN_TMP=str(tmp_path / "stash"))
    pack = tmp_path / "pack"
    proc = _sh("--prepare", pack, "--tiny", "--part-mib", 10, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = sorted(pack.glob("part-*"))
    assert len(parts) >= 2 and "examples/gpu_train.sh --stash" in proc.stdout
    for p in parts[:-1]:
        assert _sh("--stash", p, env=env).returncode == 0
        p.rename(tmp_path / p.name)  # only the last part is carried with the run
    out = tmp_path / "out"
    proc = _sh(out, "--pack", pack, "--device", "cpu", "--batch-tokens", 1024, "--budget-s", 200, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out tau" in proc.stdout

    files = [f for f in out.rglob("*") if f.is_file()]
    assert len(files) <= 8 and all(f.stat().st_size <= 16 << 20 for f in files)
    assert all(len(f.relative_to(out).parts) <= 3 for f in files)  # OUT/a/b/file at most
    drafter = load_dspark(out / "drafter")  # the project's loader
    check_fits(drafter.config, AutoConfig.from_pretrained(pack / "smoke-target"), "DSpark", least_block=1)
    assert drafter.config.block_size == 7 and drafter.markov_rank == 64 and drafter.config.num_layers == 2
    training = json.loads((out / "drafter" / "training.json").read_text())
    assert training["config"]["drafter"] == "dspark" and training["config"]["feature_stream"]
    assert training["step"] >= 1 and training["eval"]["tau"] >= 1.0 and training["curve"]
    assert training["positions"] > 0 and training["feature_positions"] >= training["positions"]
    result = json.loads((out / "result.json").read_text())
    assert result["exit"] == 0 and result["tau"] == training["eval"]["tau"] and result["steps"] == training["step"]
    assert result["shipped_tau"] is None  # no shipped drafter fits a tiny target

    # Shipping what came back: one weights file, the one shipped before gone, the same drafter.
    import specc.shipped as shipped

    old = tmp_path / "assets" / shipped.SHIPPED["dspark"]
    old.mkdir(parents=True)
    (old / "model.safetensors").write_bytes(b"stale")
    shipped.ASSETS, assets = tmp_path / "assets", shipped.ASSETS
    try:
        dest = shipped.ship(out / "drafter", "dspark", "bfloat16")
    finally:
        shipped.ASSETS = assets
    assert sorted(f.name for f in dest.glob("*.safetensors")) == ["model.safetensors"]
    again = load_dspark(dest).state_dict()
    assert all(torch.equal(again[k], v) for k, v in drafter.state_dict().items())
    assert shipped.training_summary(dest)["curve"] == training["curve"]

    # A machine that went cold forgets the stashed parts: the run names them instead of training.
    env["SPECC_GPU_TRAIN_TMP"] = str(tmp_path / "cold")
    proc = _sh(tmp_path / "out2", "--pack", pack, "--device", "cpu", env=env)
    assert proc.returncode != 0 and "part-1" in proc.stderr and not (tmp_path / "out2" / "drafter").exists()


def test_batched_extraction_writes_what_one_forward_each_does(tmp_path):
    """`specc features --batch-tokens N` (a GPU's way): the same shards, up to rounding in the features."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from specc.features import extract
    from specc.models import resolve_model
    from specc.train import smoke_target

    tok = AutoTokenizer.from_pretrained(resolve_model(None)[0])
    model = smoke_target(tmp_path / "target", tok)
    spec = FeatureSpec(taps=(0, 2), topk=4, max_len=48, shard_tokens=100, model="tiny")
    for name, batch in (("one", 0), ("batched", 256)):
        extract(model, tok, spec, tmp_path / name, 300, progress=False, batch_tokens=batch)
    one, batched = (json.loads((tmp_path / n / "index.json").read_text()) for n in ("one", "batched"))
    assert one == batched
    for shard in one["shards"]:
        a, b = (load_file(str(tmp_path / n / shard["file"])) for n in ("one", "batched"))
        for k in ("ids", "labels", "loss", "lengths", "topk_ids"):
            assert torch.equal(a[k], b[k]), k
        torch.testing.assert_close(a["taps"].float(), b["taps"].float(), atol=2e-2, rtol=1e-2)


def test_a_run_from_before_the_new_settings_resumes(tmp_path):
    from dataclasses import asdict

    from specc.train import _check_run_dir

    cfg = TrainConfig(drafter="dspark")
    old = {k: v for k, v in asdict(cfg).items() if k not in ("feature_stream", "pack_tokens", "time_budget",
                                                             "feature_precision", "feature_batch_tokens",
                                                             "feature_window_tokens")}
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "progress.json").write_text(json.dumps({"config": old, "history": []}))
    assert _check_run_dir(tmp_path, cfg)["config"] == old
    with pytest.raises(Exception, match="time_budget"):
        _check_run_dir(tmp_path, TrainConfig(drafter="dspark", time_budget=5.0))


def test_bad_stream_options_are_refused_before_any_work(tmp_path):
    """A --feature-stream folder without a corpus, a bad precision, packing without a stream: one
    sentence each, and no run directory left behind."""
    from specc.train import TrainConfig, train

    with pytest.raises(SpeccError, match="holds no pre-tokenized corpus"):
        train(None, tmp_path / "run", TrainConfig(drafter="dspark", feature_stream=str(tmp_path / "none"), prompts=0))
    with pytest.raises(SpeccError, match="--feature-precision 'fp8' is unknown"):
        TrainConfig(drafter="dspark", feature_stream=str(tmp_path), feature_precision="fp8", prompts=0).check()
    with pytest.raises(SpeccError, match="--pack-tokens packs the sequences of a --feature-stream"):
        TrainConfig(drafter="dspark", pack_tokens=4096).check()
    assert not (tmp_path / "run").exists()
