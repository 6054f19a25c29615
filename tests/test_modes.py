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
    assert mtp_sampled.manifest.modes == ["greedy", "sample", "top_p"]
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
    # tokens, base_len | + temperature, uniforms (the generation's table) | + top_p; sampled children
    # add q in the sampling modes only.
    assert (inputs["plain_greedy"], inputs["plain_sample"], inputs["plain_top_p"]) == (2, 4, 5)
    assert (inputs["step_greedy"], inputs["step_sample"], inputs["step_top_p"]) == (2, 5, 6)
    assert (inputs["fused_greedy"], inputs["fused_sample"], inputs["fused_top_p"]) == (2, 5, 6)
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


# --------------------------------------------------------------------------- the device-resident loop

HOST_READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "numpy", "cpu")


class Watched(torch.Tensor):
    """A graph output that counts every read of its values by the host (and of anything computed
    from it): what a CUDA engine would pay as a device-to-host copy and a sync."""
    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            cls.reads.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs or {})


def watch(graph):
    def call(*args):
        plain = [a.as_subclass(torch.Tensor) if isinstance(a, Watched) else a for a in args]  # reads inside
        out = graph(*plain)                                                                 # a graph are its own
        return tuple(o.as_subclass(Watched) for o in out) if isinstance(out, tuple) else out.as_subclass(Watched)
    return call


@pytest.fixture
def watched():
    """Wrap an engine's graphs (and its drafter's) so that host reads of their outputs are counted."""
    saved = []

    def wrap(engine):
        graphs = {name: watch(g) for name, g in engine.graphs.items()}
        saved.append((engine, engine.graphs, getattr(engine.drafter, "graphs", None)))
        engine.graphs = graphs
        if saved[-1][2] is not None:
            engine.drafter.graphs = graphs
        Watched.reads = []
        return Watched.reads

    yield wrap
    for engine, graphs, drafter_graphs in saved:
        engine.graphs = graphs
        if drafter_graphs is not None:
            engine.drafter.graphs = drafter_graphs


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.9, 0.8)])
@pytest.mark.parametrize("path", ["fused", "unfused", "plain"])
def test_one_host_read_per_step(mtp_sampled, watched, path, temperature, top_p):
    """The plain and fused graphs return what the next call takes (committed length, root, next tree
    and its q); the host reads one report per step (plus prefill's first token). The unfused path
    with a hidden-state drafter keeps the drafts on the device too."""
    kw = dict(max_new_tokens=20, temperature=temperature, top_p=top_p, seed=2, stop_at_eos=False)
    want = mtp_sampled.generate(PROMPT, speculate=path != "plain", **kw).token_ids  # unwatched, fused
    reads = watched(mtp_sampled)
    mtp_sampled.use_fused = path == "fused"
    try:
        res = mtp_sampled.generate(PROMPT, speculate=path != "plain", **kw)
    finally:
        mtp_sampled.use_fused = True
    assert res.stats.steps > 0 and len(reads) == res.stats.steps + 1, reads
    if path != "unfused":
        assert res.token_ids == want


def test_one_host_read_per_step_with_host_drafts(tiny_model_dir, tmp_path, watched):
    """ngram drafts on the host from the text (which the report brings back): still one read a step."""
    engine = specc.load(specc.compile(tiny_model_dir, drafter="ngram", tree="chain:3", output_dir=tmp_path / "e",
                                      max_len=96, progress=False, modes="greedy"))
    # The tiny random model never repeats itself: propose the last token again, so every step
    # verifies host drafts through the step graph (a lookup that found nothing would run plain steps).
    engine.drafter.propose = lambda committed: ([committed[-1]] * 3, True)
    reads = watched(engine)
    res = engine.generate(PROMPT, max_new_tokens=24, stop_at_eos=False)
    assert len(res.stats.rank_paths) == res.stats.steps  # every step verified drafts
    assert len(reads) == res.stats.steps + 1, reads


def test_a_second_read_is_counted(mtp_sampled, watched, monkeypatch):
    """The counter's negative control: a runtime that reads the accepted count on its own (as the
    runtime before the device-resident loop did) fails the count."""
    from specc import strategies

    reads = watched(mtp_sampled)
    real = strategies.advance
    monkeypatch.setattr(strategies, "advance", lambda run, res: (int(res.report[0]), real(run, res))[1])
    res = mtp_sampled.generate(PROMPT, max_new_tokens=12, stop_at_eos=False)
    assert len(reads) == 2 * res.stats.steps + 1


def test_a_seed_draws_the_same_table_on_any_device_and_indexes_it_by_position(mtp_sampled):
    """The uniforms come from the seeded CPU generator, once per generation: the same seed gives the
    same tokens again, another seed other tokens."""
    kw = dict(max_new_tokens=24, temperature=1.0, stop_at_eos=False)
    a, b, c = (mtp_sampled.generate(PROMPT, seed=s, **kw).token_ids for s in (7, 7, 8))
    assert a == b and a != c
