"""CompileConfig (one sentence per bad field, frozen, derived with dataclasses.replace) and the drafter
registry (a new kind is one module and one registry entry)."""
from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest

import specc
from specc.config import CompileConfig
from specc.drafters import KINDS, get_kind
from specc.errors import SpeccError

BAD = {  # field values -> words the one-sentence message must contain
    "no-output": (dict(output_dir=None), ["output directory"]),
    "drafter": (dict(drafter="magic"), ["--drafter", "magic", "ngram"]),
    "dspark-no-path": (dict(drafter="dspark", model="some/model"), ["--drafter dspark needs --drafter-path"]),
    "backend": (dict(backend="cuda-magic"), ["--backend", "cuda-magic"]),
    "device": (dict(device="tpu"), ["--device", "tpu"]),
    "dtype": (dict(dtype="float7"), ["float7"]),
    "children": (dict(drafter="mtp", children="random"), ["--children", "random"]),
    "children-ngram": (dict(drafter="ngram", children="sampled"), ["--children sampled", "mtp or dflash"]),
    "max-len": (dict(max_len=1), ["--max-len 1"]),
    "prefill-chunk": (dict(prefill_chunk=0), ["--prefill-chunk 0"]),
    "prefill-chunks": (dict(prefill_chunk="128,x"), ["--prefill-chunk '128,x'", "e.g. 128,32"]),
    "drafter-path": (dict(drafter="ngram", drafter_path="x"), ["--drafter-path only applies", "draft-model"]),
    "drafter-layers": (dict(drafter="mtp", drafter_layers=2, drafter_path="x"), ["--drafter-layers", "draft-model"]),
    "block-size": (dict(drafter="mtp", block_size=3, drafter_path="x"), ["--block-size only applies", "dflash"]),
    "tree": (dict(drafter="ngram", tree="chain:x"), ["chain:x", "malformed"]),
    "tree-no-drafter": (dict(tree="chain:3"), ["chain:3", "drafter"]),
    "tree-no-drafts": (dict(drafter="ngram", tree="chain:0"), ["chain:0", "no draft tokens"]),
    "tree-not-chain": (dict(drafter="draft-model", tree="topk:2,2"), ["draft-model", "chain:K"]),
    "measured-none": (dict(tree="sequoia:4"), ["sequoia:4", "--drafter ngram, mtp, dflash or dspark"]),
    "mtp-no-path": (dict(drafter="mtp", model="some/model"), ["--drafter mtp needs --drafter-path"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_field_is_one_sentence(tmp_path, case):
    fields, words = BAD[case]
    with pytest.raises(SpeccError) as e:
        CompileConfig(**{"output_dir": tmp_path / "out", **fields})
    msg = str(e.value)
    assert "\n" not in msg and msg.endswith(".")
    for w in words:
        assert w in msg, (w, msg)


def test_frozen_and_replace_validates(tmp_path):
    cfg = CompileConfig(output_dir=tmp_path / "out", drafter="ngram")
    assert cfg.tree_spec == get_kind("ngram").DEFAULT_TREE and cfg.parsed_tree.size == 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_len = 5
    other = dataclasses.replace(cfg, tree="topk:2,2")
    assert other.parsed_tree.size == 7 and cfg.parsed_tree.size == 5
    with pytest.raises(SpeccError, match="--max-len 0"):
        dataclasses.replace(cfg, max_len=0)
    # prefill chunks: largest first, those past --max-len left out, all kept through replace
    assert (cfg.prefill_chunk, cfg.prefill_chunks) == ((128, 32), (128, 32))
    short = dataclasses.replace(cfg, max_len=100, prefill_chunk="32, 8,32")
    assert (short.prefill_chunk, short.prefill_chunks) == ((32, 8), (32, 8))
    assert dataclasses.replace(short, max_len=16).prefill_chunks == (8,)
    assert dataclasses.replace(short, max_len=4).prefill_chunks == (8,)  # the smallest stays
    assert dataclasses.replace(dataclasses.replace(cfg, max_len=64), tree="chain:2").prefill_chunk == (128, 32)


def test_refuses_to_overwrite_other_content(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SpeccError, match="refusing to overwrite"):
        CompileConfig(output_dir=tmp_path)


def test_config_and_keywords_compile_the_same_engine(tiny_model_dir, tmp_path):
    a = specc.compile(tiny_model_dir, drafter="ngram", tree="chain:2", output_dir=tmp_path / "a", max_len=64,
                      progress=False, modes="greedy")
    cfg = CompileConfig(drafter="ngram", tree="chain:2", output_dir=tmp_path / "b", max_len=64, progress=False,
                        modes="greedy")
    b = specc.compile(tiny_model_dir, cfg)
    ma, mb = (json.loads((p / "specc.json").read_text()) for p in (a, b))
    for key in ("drafter", "tree", "graphs", "cache_len", "backend"):
        assert ma[key] == mb[key]
    assert ma["files"] == mb["files"]  # the same bytes


KIND_MODULE = '''
"""A new drafter kind in one module: prompt lookup that already drafts from a 1-token match."""
from specc.drafters import ngram

NAME = "ngram-eager"
DEFAULT_TREE = "chain:3"
DRAFTS, FILLS_TREES, MEASURED_TREES, SAMPLED_CHILDREN, ADAPTIVE = True, True, False, False, False
OPTIONS = frozenset()
TRAINER = None  # not trained
check, save, load_saved, taps, module, plans = (ngram.check, ngram.save, ngram.load_saved, ngram.taps,
                                               ngram.module, ngram.plans)


def load(cfg, target_hf, tokenizer=None):
    return None


def entry(cfg, weights, tree):
    return {"kind": NAME, "max_ngram": 2, "min_ngram": 1}


def runtime(graphs, tree, entry, chunk, device, weights=None):
    return ngram.NgramDrafter(tree, entry["max_ngram"], entry["min_ngram"])
'''


def test_a_new_kind_is_one_module_and_one_registry_line(tiny_model_dir, tmp_path, monkeypatch):
    path = tmp_path / "ngram_eager.py"
    path.write_text(KIND_MODULE)
    spec = importlib.util.spec_from_file_location("ngram_eager", path)
    kind = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kind)
    monkeypatch.setitem(KINDS, kind.NAME, kind)  # the registry line
    out = specc.compile(tiny_model_dir, drafter="ngram-eager", output_dir=tmp_path / "e", max_len=64, progress=False,
                        modes="greedy")
    engine = specc.load(out)
    prompt = "the a of the a of the a of"
    res = engine.generate(prompt, max_new_tokens=16, stop_at_eos=False)
    plain = engine.generate(prompt, max_new_tokens=16, stop_at_eos=False, speculate=False)
    assert res.token_ids == plain.token_ids
    assert res.stats.steps < plain.stats.steps  # it drafted, and some drafts were accepted
    assert engine.manifest.drafter == {"kind": "ngram-eager", "max_ngram": 2, "min_ngram": 1}
