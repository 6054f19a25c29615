"""Few-row products chosen by timing (specc/products.py): compile lowers the plain graph and the whole
tree's step graph with the C++ product and with the reduction, times each pair, and lowers every
graph under the faster."""
import json

import pytest
import torch

import specc
from specc import compiler, products
from specc.cli import main as cli_main
from specc.kernels import rows_linear
from specc.kernels.cpu_kernels import load_cpu_kernel
from test_engine import PROMPT, hf_greedy
from tiny import tiny_model


def test_graphs_timed_both_ways_and_the_faster_kept(tmp_path, monkeypatch, capsys):
    if not load_cpu_kernel():
        pytest.skip("the C++ CPU products do not build here")
    model = tiny_model("llama", vocab=64, layers=1, seed=3)  # one layer: five Inductor compiles here
    model.save_pretrained(tmp_path / "m")
    monkeypatch.setattr(products, "MIN_TIMED_BYTES", 0)  # a tiny target is timed too
    monkeypatch.setattr(products, "timings_dir", lambda: tmp_path / "timings")  # none timed before this test
    # The timing says the opposite of the rule (the C++ product at one row and at many rows on AVX-512
    # CPUs), so the engine can only follow it if the measurement decides.
    faster = "reduction" if rows_linear.float32_kernel() else "cpp"
    timed, lowered = [], []
    real_time, real_lower = products.time_calls, compiler.lower_graph

    def time_calls(calls, device):  # really timed; then the test says which one is "faster"
        ms = real_time(calls, device)
        assert len(ms) == 2 and all(t > 0 for t in ms)
        timed.append((rows_linear.ONE_ROW_KERNEL, rows_linear.MANY_ROWS_KERNEL))
        return [1.0, 2.0] if faster == "cpp" else [2.0, 1.0]

    def lower_graph(backend, ep, state, folder, name, *rest):
        lowered.append((name, rows_linear.ONE_ROW_KERNEL, rows_linear.MANY_ROWS_KERNEL))
        return real_lower(backend, ep, state, folder, name, *rest)

    monkeypatch.setattr(products, "time_calls", time_calls)
    monkeypatch.setattr(compiler, "lower_graph", lower_graph)
    # chain:4: a 5-node step graph; with a budget this small its rows are many, so those are timed too
    monkeypatch.setattr(rows_linear, "REDUCTION_ROWS_BYTES", 4 * 4 * 32)
    path = specc.compile(tmp_path / "m", drafter="ngram", tree="chain:4", backend="inductor", output_dir=tmp_path / "e",
                         max_len=64, prefill_chunk=8, progress=False, modes="greedy", ngram_corpus="none")
    m = json.loads((path / "specc.json").read_text())
    assert {k: (v["product"], v["graph"]) for k, v in m["products"].items()} == {
        "one_row": (faster, "plain_greedy"), "many_rows": (faster, "step_greedy")}
    assert all(set(v["ms"]) == {"cpp", "reduction"} for v in m["products"].values())
    # the timing's own lowerings are graphs of the compile's time split, beside the engine's
    timed_graphs = {f"{g} ({k} products, timed)" for g in ("plain_greedy", "step_greedy") for k in ("cpp", "reduction")}
    assert set(m["compile_split"]["graphs"]) == set(m["graphs"]) | timed_graphs
    assert m["compile_split"]["phases"]["products"] > 0
    # many rows here: 32-wide rows from 5 (640 bytes > 512), 64-wide from 3; inspect says so
    assert m["products"]["many_rows"]["from_rows"] == {"32": 5, "64": 3}
    # the step graph was timed with the one-row choice already made; the timing restored the rule after
    assert len(timed) == 2 and rows_linear.ONE_ROW_KERNEL is None and rows_linear.MANY_ROWS_KERNEL is None
    # every graph of the engine was lowered under the faster products, nothing outside the choice
    on = faster == "cpp"
    assert {n for n, *_ in lowered} == set(m["graphs"]) and {tuple(c) for _, *c in lowered} == {(on, on)}
    assert cli_main(["inspect", str(path)]) == 0
    assert f"float32 at 5+ rows of 32 inputs, 3+ rows of 64 inputs: {faster}" in capsys.readouterr().out
    engine = specc.load(path)
    for speculate in (True, False):
        res = engine.generate(PROMPT, max_new_tokens=20, stop_at_eos=False, speculate=speculate)
        assert res.token_ids == hf_greedy(model, PROMPT, 20)
    # compiled again on this machine: the choices timed above are taken, nothing is lowered twice or timed
    lowered.clear()
    again = specc.compile(tmp_path / "m", drafter="ngram", tree="chain:4", backend="inductor",
                          output_dir=tmp_path / "e2", max_len=64, prefill_chunk=8, progress=False, modes="greedy",
                          ngram_corpus="none")
    m2 = json.loads((again / "specc.json").read_text())
    assert len(timed) == 2 and {n for n, *_ in lowered} == set(m2["graphs"])
    assert m2["products"] == {k: {**v, "timed_before": True} for k, v in m["products"].items()}
    assert "products" not in m2["compile_split"]["phases"] or m2["compile_split"]["phases"]["products"] < 1


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
    for one in (None, True, False):
        for many in (None, True, False):
            with rows_linear.kernel_choice(one, many):
                keys.add(kernel_sources())
                rule = rows_linear.float32_kernel()
                assert rows_linear.kernel_rows(1, 576, torch.float32) == (rule if one is None else one)
                # many rows: past the reduction's cache budget, so fewer of wider rows (SmolLM2's widths)
                for rows, inputs in ((7, 576), (3, 1536)):
                    assert rows_linear.kernel_rows(rows, inputs, torch.float32) == (rule if many is None else many)
                for rows, inputs in ((2, 576), (6, 576), (2, 1536)):  # the reduction, whatever was chosen
                    assert not rows_linear.kernel_rows(rows, inputs, torch.float32)
                assert rows_linear.kernel_rows(1, 576, torch.int8)  # int8 always takes the C++ product
                assert rows_linear.kernel_rows(3, 64, torch.int8)
    assert len(keys) == 9 and rows_linear.ONE_ROW_KERNEL is None and rows_linear.MANY_ROWS_KERNEL is None


def test_many_rows_is_a_cache_budget_of_input_rows(monkeypatch):
    """The rows the reduction handles are those whose float32 inputs fit REDUCTION_ROWS_BYTES (14 KB);
    one row is never "many" (it has its own choice); the manifest says from how many rows each width
    is; the step graph's products are timed only where it has many rows; the budget keys the cache."""
    from specc.backends import kernel_sources
    from specc.drafters import get_kind
    from specc.plans import graph_plans
    from specc.tree import parse_tree

    assert rows_linear.REDUCTION_ROWS_BYTES == 14 << 10
    many = rows_linear.many_rows
    assert not many(6, 576) and many(7, 576) and not many(2, 1536) and many(3, 1536)
    assert not many(1, 10 ** 6) and many(2, 4096) and not many(56, 64) and many(57, 64)
    assert products.rows_from({4096}, 9) == {4096: 2}
    widths = products.weight_widths({"w": torch.zeros(3, 576), "v": torch.zeros(576, 1536),
                                     "cache": torch.zeros(2, 3, 4, 5), "ids": torch.zeros(3, 7, dtype=torch.long)})
    assert widths == {576, 1536}
    # the step graph is timed where some width has many rows at its node count, else only plain
    plans = graph_plans(get_kind("ngram"), parse_tree("chain:4"), 8, 40, "inductor", modes=("greedy",))  # + 5-node step
    assert set(products.timed_plans(plans, {576})) == {"one_row"}
    assert set(products.timed_plans(plans, {576, 1536})) == {"one_row", "many_rows"}
    key = kernel_sources()
    monkeypatch.setattr(rows_linear, "REDUCTION_ROWS_BYTES", 16 << 10)
    assert kernel_sources() != key


def test_a_build_killed_midway_does_not_hang_later_loads():
    """torch's extension build marks "building" with a lock file; a build killed midway leaves it, and a
    later load would wait for ever. load_cpu_kernel removes it under its own lock, which the OS drops
    with its process (another process loading meanwhile holds that lock: the file is never pulled from
    under a build)."""
    import subprocess
    import sys

    from conftest import cli_env
    from specc.kernels.cpu_kernels import build_dir

    if not load_cpu_kernel():
        pytest.skip("the C++ CPU products do not build here")
    (build_dir() / "lock").touch()  # what a killed build leaves
    code = "from specc.kernels.cpu_kernels import load_cpu_kernel; print(load_cpu_kernel())"
    proc = subprocess.run([sys.executable, "-P", "-c", code], env=cli_env(), capture_output=True, text=True,
                          timeout=240)
    assert proc.stdout.strip() == "True", proc.stderr[-2000:]
    assert not (build_dir() / "lock").exists()
