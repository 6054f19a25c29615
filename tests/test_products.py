"""The one-row product chosen by timing (specc/products.py): compile lowers the plain graph with the
C++ product and with the reduction, times both, and lowers every graph under the faster."""
import json

import pytest
import torch

import specc
from specc import compiler, products
from specc.kernels import rows_linear
from specc.kernels.cpu_kernels import load_cpu_kernel
from test_engine import PROMPT, hf_greedy
from tiny import tiny_model


def test_plain_graph_timed_both_ways_and_the_faster_kept(tmp_path, monkeypatch):
    if not load_cpu_kernel():
        pytest.skip("the C++ CPU products do not build here")
    # the timing says the opposite of the rule (C++ at one row on AVX-512 CPUs), so the engine can
    # only follow it if the measurement decides
    faster = "reduction" if rows_linear.float32_kernel() else "cpp"
    model = tiny_model("llama", vocab=64, layers=2, seed=3)
    model.save_pretrained(tmp_path / "m")
    monkeypatch.setattr(products, "MIN_TIMED_BYTES", 0)  # a tiny target is timed too
    timed, lowered = [], []
    real_time = products.time_calls

    def time_calls(calls, device):  # really timed; then the test decides which one is "faster"
        ms = real_time(calls, device)
        assert len(ms) == 2 and all(t > 0 for t in ms)
        timed.append(ms)
        return [1.0, 2.0] if faster == "cpp" else [2.0, 1.0]

    def lower_graph(backend, ep, state, folder, name, *rest):
        lowered.append((name, rows_linear.ONE_ROW_KERNEL))
        return real_lower(backend, ep, state, folder, name, *rest)

    real_lower = compiler.lower_graph
    monkeypatch.setattr(products, "time_calls", time_calls)
    monkeypatch.setattr(compiler, "lower_graph", lower_graph)
    path = specc.compile(tmp_path / "m", drafter="ngram", tree="chain:2", backend="inductor", output_dir=tmp_path / "e",
                         max_len=64, prefill_chunk=8, progress=False, modes="greedy", ngram_corpus="none")
    m = json.loads((path / "specc.json").read_text())
    assert len(timed) == 1 and m["one_row"]["product"] == faster and set(m["one_row"]["ms"]) == {"cpp", "reduction"}
    # every graph of the engine was lowered under the faster product, and nothing outside the choice
    assert {n for n, _ in lowered} == set(m["graphs"]) and {v for _, v in lowered} == {faster == "cpp"}
    assert rows_linear.ONE_ROW_KERNEL is None
    engine = specc.load(path)
    assert engine.generate(PROMPT, max_new_tokens=20, stop_at_eos=False).token_ids == hf_greedy(model, PROMPT, 20)
    assert engine.generate(PROMPT, max_new_tokens=20, stop_at_eos=False, speculate=False).token_ids == \
        hf_greedy(model, PROMPT, 20)


def test_small_targets_and_other_backends_keep_the_rule():
    from specc.config import CompileConfig

    cfg = CompileConfig(model=None, backend="inductor", output_dir="x")
    assert products.applies(cfg, products.MIN_TIMED_BYTES, True)
    assert not products.applies(cfg, products.MIN_TIMED_BYTES - 1, True)  # the tiny test models
    assert not products.applies(cfg, products.MIN_TIMED_BYTES, False)  # no C++ product here
    for other in (dict(backend="eager"), dict(backend="onnx"), dict(quant="int8"), dict(dtype="bfloat16")):
        c = CompileConfig(model=None, output_dir="x", **{"backend": "inductor", **other})
        assert not products.applies(c, products.MIN_TIMED_BYTES, True), other


def test_the_choice_is_part_of_the_compile_cache_key():
    from specc.backends import kernel_sources

    keys = set()
    for on in (None, True, False):
        with rows_linear.one_row_kernel(on):
            keys.add(kernel_sources())
            assert rows_linear.kernel_rows(1, torch.float32) == (rows_linear.float32_kernel() if on is None else on)
            assert rows_linear.kernel_rows(1, torch.int8)  # int8 always takes the C++ product
    assert len(keys) == 3 and rows_linear.ONE_ROW_KERNEL is None
