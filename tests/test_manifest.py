"""specc.json as a typed object (specc/manifest.py): the JSON layout engines have always had survives a
read and a write unchanged, older engines' keys are mapped in one place, and every unreadable
manifest is refused in one sentence."""
import json

import pytest
import torch

from specc.errors import SpeccError
from specc.manifest import FORMAT_VERSION, MANIFEST, Graph, Manifest, read, write


def engine_json() -> dict:
    """A manifest as the compiler writes it (the keys of a small onnx engine, abridged)."""
    return {
        "format_version": FORMAT_VERSION, "specc_version": "0.1.0", "torch_version": "2.13.0", "triton_version": None,
        "transformers_version": "4.57.0", "platform": "x86_64",
        "target": {"name": "tiny-llama", "source": "/m", "arch": "llama", "num_layers": 2, "vocab_size": 64,
                   "eos_token_ids": [2], "config": {"hidden_size": 32}, "weights_sha256": "ab"},
        "drafter": {"kind": "ngram", "max_ngram": 3, "min_ngram": 1},
        "tree": {"spec": "chain:3", "paths": [[], [0]], "parents": [-1, 0], "depths": [0, 1]},
        "backend": "onnx", "device": "cpu", "dtype": "float32", "modes": ["greedy"], "max_len": 64,
        "prefill_chunk": 8, "prefill_chunks": [32, 8], "cache_len": 72,
        "graphs": {"step_greedy": {"module": "target", "tokens": 4, "inputs": [[[1, 4], "torch.int64"]],
                                   "mode": "greedy", "passes": ["matvec"], "file": "graphs/step_greedy.onnx",
                                   "caches": ["k_cache"], "outputs": 3, "tuple": True, "compact": None}},
        "compile_s": {"step_greedy": 1.5},
        "quant": {"target": "int8", "drafter": "none", "bytes_per_token": {"target": 100, "drafter": 0}},
        "cpu_kernels": False, "prefill_ms": {"1": 1.0, "8": 2.0}, "files": {"target/model.safetensors": "ab"},
    }


def test_round_trip_keeps_the_layout(tmp_path):
    d = engine_json()
    m = Manifest.from_json(d)
    assert m.target.vocab_size == 64 and m.quant.target == "int8" and m.prefill_chunks == [32, 8]
    g = m.graphs["step_greedy"]
    assert isinstance(g, Graph) and g.tokens == 4 and g.lowering == []
    assert g.lowered == {"file": "graphs/step_greedy.onnx", "caches": ["k_cache"], "outputs": 3, "tuple": True,
                         "compact": None}  # the backend's own fields, for it alone
    assert g.input_specs() == [((1, 4), torch.int64)]
    assert m.to_json() == d  # nothing added, nothing lost, absent sections stay absent
    write(tmp_path, m)
    assert json.loads((tmp_path / MANIFEST).read_text()) == d and read(tmp_path) == m
    assert not list(tmp_path.glob(".*tmp"))  # written whole, then renamed


def test_older_keys_are_mapped_here():
    d = engine_json()
    for k in ("device", "modes", "prefill_chunks", "cpu_kernels"):
        del d[k]
    d["quant"]["cpu_kernel"] = True  # where engines before `cpu_kernels` kept the flag
    m = Manifest.from_json(d)
    assert m.device == "cpu" and m.modes == ["greedy", "sample", "top_p"] and m.prefill_chunks == [8]
    assert m.cpu_kernels and "cpu_kernel" not in m.to_json()["quant"]


@pytest.mark.parametrize("damage,words", [
    (None, "is not a specc engine directory"),
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "engine format None is not the format this specc reads"),
    (json.dumps({**engine_json(), "format_version": 99}), "engine format 99 is not the format"),
    (json.dumps({k: v for k, v in engine_json().items() if k != "target"}), "lacks what an engine manifest holds"),
])
def test_unreadable_manifests_are_refused_in_one_sentence(tmp_path, damage, words):
    if damage is not None:
        (tmp_path / MANIFEST).write_text(damage)
    with pytest.raises(SpeccError, match=words):
        read(tmp_path)
