"""One graph per sampling mode: no graph branches on a run-time value (no torch.cond), greedy graphs
carry no sampling code and take no sampling inputs, the runtime picks the mode's graphs when a
generation starts, and an engine refuses a mode it was not compiled for in one sentence."""
from __future__ import annotations

import pytest
import torch
from torch.fx import GraphModule

import specc
from specc.config import CompileConfig
from specc.errors import SpeccError
from test_engine import PROMPT, mtp_checkpoint
from tiny import tiny_model

SAMPLING_OPS = ("softmax", "sort", "tree_accept_sample", "cumsum", "rand")


def called(module: torch.nn.Module) -> set[str]:
    """The call_function targets of a graph module and any subgraph it holds."""
    return {str(n.target) for sub in module.modules() if isinstance(sub, GraphModule)
            for n in sub.graph.nodes if n.op == "call_function"}


def subgraphs(module: torch.nn.Module) -> int:
    return sum(isinstance(sub, GraphModule) for sub in module.modules())


def user_inputs(module: GraphModule) -> int:
    return sum(1 for n in module.graph.nodes if n.op == "placeholder")


@pytest.fixture(scope="module")
def mtp_sampled(tmp_path_factory):
    """An eager MTP engine with sampled children and every mode: the widest set of mode graphs."""
    root = tmp_path_factory.mktemp("modes")
    model = tiny_model("llama", vocab=64, layers=1, seed=3)
    model.save_pretrained(root / "m")
    path = specc.compile(root / "m", drafter="mtp", drafter_path=mtp_checkpoint(model, root / "mtp", "copy")[0],
                         tree="topk:2,2", children="sampled", output_dir=root / "e", max_len=64, prefill_chunk=8,
                         progress=False)
    return specc.load(path)


def test_one_graph_per_mode_and_no_run_time_branch(mtp_sampled):
    graphs = mtp_sampled.graphs
    assert mtp_sampled.manifest["modes"] == ["greedy", "sample", "top_p"]
    for base in ("prefill", "plain", "step", "fused", "draft_prefill", "draft_step"):
        assert {f"{base}_{m}" for m in ("greedy", "sample", "top_p")} <= set(graphs), base
    for name, graph in graphs.items():
        module = graph.inner.module
        assert subgraphs(module) == 1, name  # no torch.cond branch bodies
        assert not any("cond" in c for c in called(module)), name
        ops = called(module)
        if name.endswith("_greedy"):  # greedy graphs: argmax only
            assert not any(op in c for c in ops for op in SAMPLING_OPS), (name, sorted(ops))
        else:
            assert any("softmax" in c for c in ops), name
            assert any("sort" in c for c in ops) == name.endswith("_top_p"), name


def test_greedy_graphs_take_no_sampling_inputs(mtp_sampled):
    inputs = {name: user_inputs(g.inner.module) for name, g in mtp_sampled.graphs.items()}
    # tokens, base_len | + temperature, uniforms | + top_p; sampled children add q (and the fused
    # step the next tree's uniforms) in the sampling modes only.
    assert (inputs["plain_greedy"], inputs["plain_sample"], inputs["plain_top_p"]) == (2, 4, 5)
    assert (inputs["step_greedy"], inputs["step_sample"], inputs["step_top_p"]) == (2, 5, 6)
    assert (inputs["fused_greedy"], inputs["fused_sample"], inputs["fused_top_p"]) == (2, 6, 7)
    assert (inputs["prefill_greedy"], inputs["prefill_sample"], inputs["prefill_top_p"]) == (3, 5, 6)
    assert (inputs["draft_step_greedy"], inputs["draft_step_sample"], inputs["draft_step_top_p"]) == (4, 6, 7)


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.9, 1.0), (0.9, 0.8)])
def test_each_mode_generates_and_fused_equals_unfused(mtp_sampled, temperature, top_p):
    """The runtime runs the mode's graphs; the fused and unfused paths of one mode agree token for
    token with the same seed (the same uniforms reach the same decisions)."""
    kw = dict(max_new_tokens=16, temperature=temperature, top_p=top_p, seed=5, stop_at_eos=False)
    fused = mtp_sampled.generate(PROMPT, **kw)
    mtp_sampled.use_fused = False
    try:
        unfused = mtp_sampled.generate(PROMPT, **kw)
    finally:
        mtp_sampled.use_fused = True
    assert fused.token_ids == unfused.token_ids
    assert len(fused.token_ids) == 16
    if temperature == 0:
        assert fused.token_ids == mtp_sampled.generate(PROMPT, speculate=False, **kw).token_ids


def test_an_engine_without_the_mode_refuses_in_one_sentence(tiny_model_dir, tmp_path):
    path = specc.compile(tiny_model_dir, drafter="ngram", tree="chain:2", output_dir=tmp_path / "e", max_len=64,
                         progress=False, modes="greedy")
    engine = specc.load(path)
    assert sorted(engine.graphs) == ["plain_greedy", "prefill_greedy", "step_greedy"]
    assert engine.generate(PROMPT, max_new_tokens=4).token_ids
    with pytest.raises(SpeccError, match=r"compiled with --modes greedy; compile it again with --modes greedy,sample\.$"):
        engine.generate(PROMPT, max_new_tokens=4, temperature=0.7)
    with pytest.raises(SpeccError, match=r"--modes greedy,top_p\.$"):
        engine.generate(PROMPT, max_new_tokens=4, temperature=0.7, top_p=0.9)


@pytest.mark.parametrize("modes,want", [("top_p,greedy", ("greedy", "top_p")), (("sample",), ("sample",)),
                                         (" greedy , sample ", ("greedy", "sample"))])
def test_modes_are_parsed_in_a_fixed_order(tmp_path, modes, want):
    assert CompileConfig(output_dir=tmp_path / "e", modes=modes).modes == want


@pytest.mark.parametrize("modes", ["", "greedy,beam", "nucleus"])
def test_bad_modes_are_refused_in_one_sentence(tmp_path, modes):
    with pytest.raises(SpeccError, match=r"^--modes .* is not a list of sampling modes; use one or more of "
                                         r"greedy,sample,top_p"):
        CompileConfig(output_dir=tmp_path / "e", modes=modes)
