"""The tensorrt backend. Here (no TensorRT on any machine of this project): compile writes the ONNX
graphs, lint-clean, and a manifest that marks the engines unbuilt; load and build refuse in one
sentence and change nothing. Where `tensorrt` imports on a CUDA machine, the built engine must give
the target's greedy tokens (skipped elsewhere: it has not run on this project's machines)."""
import json

import pytest
import torch

import specc
from specc.errors import SpeccError
from test_engine import PROMPT, hf_greedy
from tiny import tiny_model

pytest.importorskip("onnxruntime")


def have_tensorrt() -> bool:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("trt") / "m"
    model = tiny_model("llama", vocab=64, layers=2, seed=0)
    model.save_pretrained(d)
    return d, model


@pytest.mark.skipif(have_tensorrt(), reason="TensorRT is installed here: the built path is tested below")
def test_compile_without_tensorrt_writes_unbuilt_graphs(model_dir, tmp_path, capfd, specc_cli):
    d, _ = model_dir
    out = specc.compile(d, backend="tensorrt", drafter="ngram", tree="topk:2,2", output_dir=tmp_path / "e",
                        max_len=64, prefill_chunk=8, progress=False, modes="greedy")
    err = capfd.readouterr().err
    assert "wrote the ONNX graphs but not the TensorRT engines (TensorRT is not installed here)" in err
    assert f"run `specc build {out}`" in err
    m = json.loads((out / "specc.json").read_text())
    assert m["backend"] == "tensorrt" and m["device"] == "cuda"
    assert m["tensorrt"] == {"built": False, "tensorrt_version": None, "gpu": None, "plans": []}
    assert not list(out.rglob("*.plan"))
    assert {g["file"] for g in m["graphs"].values()} <= set(m["files"])
    before = (out / "specc.json").read_bytes()
    with pytest.raises(SpeccError, match="no TensorRT engines yet; run `specc build"):
        specc.load(out)
    with pytest.raises(SpeccError, match="TensorRT is not installed here"):
        specc.build(out, progress=False)
    assert (out / "specc.json").read_bytes() == before and not list(out.rglob("*.plan"))

    lint = specc_cli("inspect", out, "--trt-lint", "--json")
    assert lint.returncode == 0, lint.stderr
    report = json.loads(lint.stdout)["trt_lint"]
    assert report["tensorrt"] == "10.15" and report["errors"] == 0
    assert report["graphs"] == len(m["graphs"]) + sum(1 for g in m["graphs"].values() if g["compact"])
    text = specc_cli("inspect", out, "--trt-lint")
    assert "0 error(s)" in text.stdout
    build = specc_cli("build", out)
    assert build.returncode == 2 and build.stderr.startswith("specc: error: TensorRT is not installed here")


def test_tensorrt_refusals(model_dir, tmp_path, specc_cli):
    d, _ = model_dir
    with pytest.raises(SpeccError, match="TensorRT engines run on CUDA GPUs"):
        specc.compile(d, backend="tensorrt", device="cpu", output_dir=tmp_path / "e", progress=False)
    with pytest.raises(SpeccError, match="measured by running candidate engines"):
        specc.compile(d, backend="tensorrt", drafter="ngram", tree="sequoia:4", output_dir=tmp_path / "e",
                      progress=False)
    assert not (tmp_path / "e").exists()
    eager = specc.compile(d, backend="eager", output_dir=tmp_path / "eager", max_len=32, prefill_chunk=4,
                          progress=False, modes="greedy")
    with pytest.raises(SpeccError, match="is a eager engine; `specc build` builds"):
        specc.build(eager, progress=False)
    lint = specc_cli("inspect", eager, "--trt-lint")
    assert lint.returncode == 2 and "--trt-lint reads an engine's ONNX graphs" in lint.stderr


def test_a_graph_tensorrt_would_refuse_is_not_written(model_dir, tmp_path, monkeypatch):
    """The lint gates compile: a lowered graph with an error stops it, and nothing is left."""
    import specc.onnx_backend as ob

    d, _ = model_dir
    real = ob.to_onnx

    def with_random(ep, input_names, output_names, opset=ob.OPSET):
        import onnx_ir as ir

        model = real(ep, input_names, output_names, opset)
        g = model.graph
        node = ir.node("RandomUniform", [], attributes={"shape": [2], "dtype": 1})
        g.append(node)
        node.outputs[0].name = "noise"
        node.outputs[0].shape, node.outputs[0].dtype = ir.Shape([2]), ir.DataType.FLOAT
        g.outputs.append(node.outputs[0])
        return model

    monkeypatch.setattr(ob, "to_onnx", with_random)
    with pytest.raises(SpeccError, match=r"would not build in TensorRT 10\.15: RandomUniform"):
        specc.compile(d, backend="tensorrt", output_dir=tmp_path / "e", max_len=32, prefill_chunk=4, progress=False,
                      modes="greedy")
    assert not (tmp_path / "e").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".e.")]


@pytest.mark.skipif(not have_tensorrt(), reason="TensorRT does not import here (no machine of this project has it)")
def test_tensorrt_engine_greedy_equals_target(model_dir, tmp_path):
    d, model = model_dir
    out = specc.compile(d, backend="tensorrt", drafter="ngram", tree="topk:2,2", output_dir=tmp_path / "e",
                        max_len=64, prefill_chunk=8, progress=False, modes="greedy")
    assert json.loads((out / "specc.json").read_text())["tensorrt"]["built"]
    engine = specc.load(out)
    r = engine.generate(PROMPT, max_new_tokens=24, stop_at_eos=False)
    assert r.token_ids == hf_greedy(model, PROMPT, 24)
    assert engine.generate(PROMPT, max_new_tokens=24, stop_at_eos=False, speculate=False).token_ids == r.token_ids
