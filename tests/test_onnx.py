"""The onnx backend: functional ONNX graphs run by onnxruntime give exactly the eager engine's tokens
(greedy, sampling with the same seed, top-p) over many chained steps, for every drafter kind; the
graphs pass onnx.checker with full shape inference and the TensorRT lint, and share one weight file."""
import json

import pytest
import torch

import specc
from specc.errors import SpeccError
from specc.manifest import read
from specc.trt_lint import lint_engine
from test_engine import PROMPT, hf_greedy, mtp_checkpoint, random_dflash
from test_tree_engine import mtp_target
from tiny import tiny_model

pytest.importorskip("onnxruntime")

SETTINGS = [(0.0, 1.0), (0.9, 1.0), (0.9, 0.8)]  # (temperature, top_p): greedy, sample, top_p


def generate_all(path, settings, fused=(True,), n=20):
    engine = specc.load(path)
    runs = []
    for use in fused:
        engine.use_fused = use
        runs += [engine.generate(p, max_new_tokens=n, temperature=t, top_p=tp, seed=s, stop_at_eos=False)
                 for p in (PROMPT, PROMPT[:5]) for t, tp in settings for s in ((0,) if t == 0 else (0, 1))]
    return engine, runs


def assert_same_as_eager(tmp_path, model_dir, settings, fused=(True,), **kw):
    """Compile eager and onnx engines with the same options; every generation gives the same tokens
    and the same accepted lengths. Returns the onnx engine and its runs."""
    runs = {}
    for backend in ("eager", "onnx"):
        path = specc.compile(model_dir, backend=backend, output_dir=tmp_path / backend, progress=False,
                             max_len=96, prefill_chunk=8, **kw)
        engine, runs[backend] = generate_all(path, settings, fused)
    assert [r.token_ids for r in runs["onnx"]] == [r.token_ids for r in runs["eager"]]
    assert [r.stats.accepted_hist for r in runs["onnx"]] == [r.stats.accepted_hist for r in runs["eager"]]
    assert sum(r.stats.steps for r in runs["onnx"]) < sum(len(r.token_ids) for r in runs["onnx"])  # drafts accepted
    assert_checked_graphs(tmp_path / "onnx")
    return engine, runs["onnx"]


def assert_checked_graphs(folder):
    """Every graph file passes the full checker; the weights are one file, each tensor in it once."""
    import onnx

    manifest = json.loads((folder / "specc.json").read_text())
    files = [g["file"] for g in manifest["graphs"].values()]
    files += [g["compact"]["file"] for g in manifest["graphs"].values() if g.get("compact")]
    for f in files:
        onnx.checker.check_model(str(folder / f), full_check=True)
    assert sorted(p.name for p in (folder / "graphs").iterdir() if not p.name.endswith(".onnx")) == \
        ["weights.data", "weights.index.json"]
    index = json.loads((folder / "graphs" / "weights.index.json").read_text())
    weights = (folder / "graphs" / "weights.data").stat().st_size
    assert weights <= sum(e["length"] for e in index.values()) + 4096 * len(index)
    for f in ["graphs/weights.data"] + files:
        assert f in manifest["files"], f"{f} is not hashed in the manifest"
    errors = [str(f) for f in lint_engine(folder, read(folder)) if f.severity == "error"]
    assert not errors, "\n".join(errors)


def test_ngram_onnx_equals_eager_and_hf(tmp_path):
    model = tiny_model("llama", vocab=64, layers=2, seed=0)
    model.save_pretrained(tmp_path / "m")
    engine, runs = assert_same_as_eager(tmp_path, tmp_path / "m", SETTINGS[:1], drafter="ngram", tree="topk:2,2",
                                        modes="greedy")
    assert runs[0].token_ids == hf_greedy(model, PROMPT, 20)
    plain = engine.generate(PROMPT, max_new_tokens=20, stop_at_eos=False, speculate=False)
    assert plain.token_ids == runs[0].token_ids


def test_mtp_sampled_children_onnx_equals_eager(tmp_path):
    """Tree verification with children drawn from the drafter (q as a graph output, uniforms as
    inputs), through the fused step, with top-p (greedy and sample modes: the other tests here, and
    test_sampling.py's statistical test on onnx; one mode's graphs keep this test's time down)."""
    _, dpath, _ = mtp_target(tmp_path)
    assert_same_as_eager(tmp_path, tmp_path / "m", [SETTINGS[2]], fused=(True,), drafter="mtp", drafter_path=dpath,
                         tree="topk:2,2", children="sampled", modes="top_p")


def test_dflash_onnx_equals_eager(tmp_path):
    """DFlash's context caches ([1, KV, S, D] per layer) are caches too: lifted and written as one block;
    fused and unfused steps, greedy (sampled modes through onnx: the MTP test here, top-p with sampled
    children, and test_sampling.py's statistical test on a draft-model engine)."""
    model = tiny_model("llama", vocab=64, layers=3, seed=2)
    model.save_pretrained(tmp_path / "m")
    dpath, _ = random_dflash(model, tmp_path / "d", block=4)
    _, runs = assert_same_as_eager(tmp_path, tmp_path / "m", SETTINGS[:1], fused=(True, False), drafter="dflash",
                                   drafter_path=dpath, tree="topk:2,2", modes="greedy")
    assert runs[0].token_ids == hf_greedy(model, PROMPT, 20)


def test_draft_model_onnx_equals_eager(tmp_path):
    target = tiny_model("llama", vocab=64, layers=2, seed=0, scale=3.0)
    target.save_pretrained(tmp_path / "m")
    draft = tiny_model("llama", vocab=64, layers=1, seed=0, scale=3.0)
    with torch.no_grad():  # the draft copies the target's embeddings and head: often right
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight)
    draft.save_pretrained(tmp_path / "d")
    # greedy here; sampling through this engine kind is test_sampling.py's statistical test on onnx
    assert_same_as_eager(tmp_path, tmp_path / "m", SETTINGS[:1], drafter="draft-model", drafter_path=tmp_path / "d",
                         tree="chain:3", modes="greedy")


def test_onnx_refusals(tmp_path):
    tiny_model("llama", vocab=64, layers=1, seed=0).save_pretrained(tmp_path / "m")
    with pytest.raises(SpeccError, match="^the onnx backend runs float32 and float16"):
        specc.compile(tmp_path / "m", backend="onnx", dtype="bfloat16", drafter="ngram", tree="chain:2",
                      output_dir=tmp_path / "e", progress=False)
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("opset", [18, 24])
def test_kv_write_block_in_onnxruntime(tmp_path, opset):
    """The cache write as ONNX: TensorScatter-24, or ScatterND (reduction none) below opset 24, equal
    to the torch reference at every start, present bound to past's memory (written in place)."""
    import onnx
    import onnxruntime as ort

    from specc.onnx_backend import _Binder, to_onnx
    from specc.passes.functional_kv import kv_write

    class Write(torch.nn.Module):
        def forward(self, cache, update, start):
            return torch.ops.specc.kv_write(cache, update, start, -2)

    cache, update = torch.randn(1, 2, 16, 4), torch.randn(1, 2, 3, 4)
    ep = torch.export.export(Write(), (cache, update, torch.tensor(0)), strict=False)
    model = to_onnx(ep, ["past", "update", "start"], ["present"], opset)
    import onnx_ir as ir

    ir.save(model, str(tmp_path / "w.onnx"))
    ops = {n.op_type for n in onnx.load(str(tmp_path / "w.onnx")).graph.node}
    assert ("TensorScatter" in ops) == (opset >= 24) and ("ScatterND" in ops) == (opset < 24)
    session = ort.InferenceSession(str(tmp_path / "w.onnx"), providers=["CPUExecutionProvider"])
    for start in (0, 5, 13):
        want = kv_write(cache.clone(), update, torch.tensor(start), -2)
        got = cache.clone()
        b = _Binder(session, "cpu")
        b.bind_in("past", got)
        b.bind_out("present", got)
        b.bind_in("update", update)
        s = torch.tensor(start)
        b.bind_in("start", s)
        b.run()
        assert torch.equal(got, want)
