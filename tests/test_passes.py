"""Graph passes (tree_inputs, accept, compact_kv, sample_last) and the Pipeline, against plain references:
Hugging Face forwards over explicit token sequences and the plain-Python acceptance oracles."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from tiny import tiny_model  # noqa: E402

from specc.backends import EagerGraph  # noqa: E402
from specc.drafters import get_kind  # noqa: E402
from specc.pipeline import capture  # noqa: E402
from specc.plans import GraphPlan, build_program, graph_plans  # noqa: E402
from specc.target_module import NEG_INF, TargetModule, causal_mask, module_state  # noqa: E402
from specc.signature import MODES, mode_of, sampling_inputs, split_report  # noqa: E402
from specc.passes.compact_kv import compact_kv  # noqa: E402
from specc.passes.matvec import matvec  # noqa: E402
from specc.passes.tree_inputs import TreeInputs, tree_inputs  # noqa: E402
from specc.pipeline import Pipeline, uncaptured  # noqa: E402
from specc.tree import chain, topk, tree_from_paths  # noqa: E402
from specc.acceptance import reference_accept_greedy, reference_accept_sample  # noqa: E402

V = 64  # vocabulary of the tiny models
S = 48  # cache length
P = 6  # prompt length
ATOL = 1e-4
IRREGULAR = tree_from_paths([[0], [1], [2], [0, 0], [0, 1], [2, 0], [0, 0, 0], [2, 0, 0], [2, 0, 1]])
TREES = {"topk2x2": topk(2, 2), "irregular": IRREGULAR, "chain3": chain(3), "chain0": chain(0)}




@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=11)


def rand_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPT = rand_tokens(P, 100)


@torch.no_grad()
def hf_next(model, seq: list[int]) -> torch.Tensor:
    """HF logits for the token after seq (the plain reference)."""
    return model(torch.tensor([seq])).logits[0, -1]


def node_tokens(tree, tokens: list[int], i: int) -> list[int]:
    """Tokens from the root to node i, root included."""
    out = []
    while i >= 0:
        out.append(tokens[i])
        i = tree.parents[i]
    return out[::-1]


def hf_tree_logits(model, tree, tokens: list[int], prefix: list[int]) -> torch.Tensor:
    return torch.stack([hf_next(model, prefix + node_tokens(tree, tokens, i)) for i in range(tree.size)])


@torch.no_grad()
def prefill(tm: TargetModule, ids: list[int]) -> None:
    """A plain causal prefill of ids into tm's cache, slots 0..len-1, by calling the module directly."""
    T = len(ids)
    pos = torch.arange(T)
    tm(torch.tensor([ids]), pos.view(1, T).clone(), pos, causal_mask(T, 0, tm.cache_len))


def caches(tm: TargetModule) -> list[torch.Tensor]:
    return [t for b in tm.blocks for t in (b.k_cache, b.v_cache)]


def build(tm: TargetModule, T: int, pipeline: Pipeline, dump_dir=None, label="graph"):
    return build_program(GraphPlan(label, "target", T, pipeline), {"target": tm}, {}, chain(T - 1), dump_dir)


def force_path(model, tree, want: list[int], prefix: list[int], root: int, seed: int) -> list[int]:
    """Random tree tokens, changed so that greedy acceptance follows node path `want` exactly:
    each node on it carries the argmax after its parent, every other child of a node on the path
    (and every child of its last node) carries something else."""
    tokens = rand_tokens(tree.size, seed)
    tokens[0] = root
    for depth, node in enumerate(want):
        best = int(hf_next(model, prefix + node_tokens(tree, tokens, node)).argmax())
        nxt = want[depth + 1] if depth + 1 < len(want) else None
        for c in tree.children[node]:
            if c == nxt:
                tokens[c] = best
            elif tokens[c] == best:
                tokens[c] = (best + 1) % V
    return tokens


# --------------------------------------------------------------------------- tree_inputs


class Record(nn.Module):
    def forward(self, tokens, positions, cache_pos, mask):
        return tokens, positions, cache_pos, mask


@pytest.mark.parametrize("name", list(TREES))
def test_tree_inputs_positions_slots_mask(name):
    tree = TREES[name]
    T = tree.size
    mod = TreeInputs(Record(), tree, S)
    for base in (0, 5, S - T):
        toks = torch.arange(T)
        tokens, positions, slots, mask = mod(toks, torch.tensor(base))
        assert tokens.shape == (1, T) and tokens[0].tolist() == toks.tolist()
        assert positions[0].tolist() == [base + d for d in tree.depths]
        assert slots.tolist() == [base + i for i in range(T)]
        assert mask.shape == (1, 1, T, S)
        for i in range(T):
            anc = set()
            j = i
            while j >= 0:  # i, its parent, ..., the root, walked independently of Tree.ancestor_mask
                anc.add(base + j)
                j = tree.parents[j]
            allowed = {s for s in range(S) if s < base} | anc
            row = mask[0, 0, i]
            assert {s for s in range(S) if row[s] == 0} == allowed, (name, base, i)
            assert all(row[s] == NEG_INF for s in range(S) if s not in allowed)


@pytest.mark.parametrize("name", list(TREES))
@torch.no_grad()
def test_tree_inputs_logits_match_hf_on_each_path(model, name):
    tree = TREES[name]
    tm = TargetModule(model, S)
    ep = build(tm, tree.size, Pipeline().wrap("tree_inputs", lambda p: tree_inputs(p, tree, S)))
    assert not any(c.any() for c in caches(tm))  # capture and the passes do not write the cache
    prefill(tm, PROMPT)
    prefix_cache = [c[:, :, :P].clone() for c in caches(tm)]
    graph = EagerGraph(ep, module_state(tm))
    # Twice at the same base length with different tokens (a rejected step is redone over stale slots).
    for seed in (1, 2):
        tokens = rand_tokens(tree.size, seed)
        logits = graph(torch.tensor(tokens), torch.tensor(P))[0]
        assert logits.shape == (1, tree.size, V)
        torch.testing.assert_close(logits[0], hf_tree_logits(model, tree, tokens, PROMPT), atol=ATOL, rtol=0)
        for c, before in zip(caches(tm), prefix_cache):
            assert torch.equal(c[:, :, :P], before)  # the committed prefix is never written


# --------------------------------------------------------------------------- accept + compact_kv


@pytest.fixture(scope="module", params=["topk2x2", "irregular"])
def step(request, model, tmp_path_factory):
    """The decode-step programs of graph_plans (matvec -> tree_attention -> tree_inputs -> accept -> compact_kv),
    one per mode over one capture, dumped; called as one graph that picks the mode's program."""
    tree = TREES[request.param]
    plans = [p for p in graph_plans(get_kind("ngram"), tree, 8, S) if p.name.startswith("step_")]
    assert [p.mode for p in plans] == list(MODES)
    for plan in plans:
        assert plan.T == tree.size and plan.passes == ["matvec", "tree_attention", "tree_inputs", "accept", "compact_kv"]
    tm = TargetModule(model, S)
    dump = tmp_path_factory.mktemp("dump")
    built = {}
    graphs = {p.mode: EagerGraph(build_program(p, {"target": tm}, built, tree, dump), module_state(tm))
              for p in plans}
    assert len(built) == 1  # the modes share the capture and the mode-free passes

    def graph(tokens, base_len, temperature, top_p, uniforms):
        """(n, path, out), with `uniforms` [T+1] put in the table's row base_len (where the graph reads)."""
        mode = mode_of(float(temperature), float(top_p))
        table = torch.rand(S, tree.size + 1)
        table[int(base_len)] = uniforms
        report, next_base, root = graphs[mode](tokens, base_len, *sampling_inputs(mode, temperature, top_p, table))
        n, path, out = split_report(report)
        assert int(next_base) == int(base_len) + int(n) + 1 and root.tolist() == [int(out[n])]  # the next call's
        return n, path, out

    return request.param, tree, tm, graph, dump


GREEDY_PATHS = {
    "topk2x2": [[0, 2, 5], [0, 2, 6], [0, 1, 3], [0, 2], [0]],
    "irregular": [[0, 3, 6, 8], [0, 1, 4, 7], [0, 1, 5], [0, 3], [0]],
}


def assert_cache_is_plain_prefill(model, tm: TargetModule, committed: list[int]) -> None:
    ref = TargetModule(model, S)
    prefill(ref, committed)
    L = len(committed)
    for got, want in zip(caches(tm), caches(ref)):
        torch.testing.assert_close(got[:, :, :L], want[:, :, :L], atol=1e-5, rtol=0)


@torch.no_grad()
def test_accept_greedy_and_compact_kv(model, step):
    name, tree, tm, graph, _ = step
    D = tree.max_depth
    for k, want in enumerate(GREEDY_PATHS[name]):
        root = rand_tokens(1, 50 + k)[0]
        prefill(tm, PROMPT)
        tokens = force_path(model, tree, want, PROMPT, root, seed=k)
        n, path, out = graph(torch.tensor(tokens), torch.tensor(P), torch.tensor(0.0), torch.tensor(1.0),
                             torch.rand(tree.size + 1))
        logits = hf_tree_logits(model, tree, tokens, PROMPT)
        ref = reference_accept_greedy(logits, tokens, tree.parents, tree.child_table())
        assert (int(n), path.tolist(), out.tolist()) == ref
        assert int(n) == len(want) - 1 and path.tolist()[: len(want)] == want
        assert path.shape == (D + 1,) and out.shape == (D + 1,)
        accepted = [tokens[i] for i in want[1:]]
        assert out.tolist()[:n] == accepted
        assert out.tolist()[n] == int(hf_next(model, PROMPT + [root] + accepted).argmax())

        # compact_kv: slots P .. P+n hold the K/V of root + accepted tokens, exactly as a plain
        # causal prefill of the committed sequence writes them.
        assert_cache_is_plain_prefill(model, tm, PROMPT + [root] + accepted)

        # The compacted cache supports the next step: from base P+n+1 with the bonus as root.
        committed = PROMPT + [root] + accepted
        bonus = out.tolist()[n]
        tokens2 = force_path(model, tree, [0, tree.children[0][-1]], committed, bonus, seed=90 + k)
        n2, _, out2 = graph(torch.tensor(tokens2), torch.tensor(len(committed)), torch.tensor(0.0),
                            torch.tensor(1.0), torch.rand(tree.size + 1))
        logits2 = hf_tree_logits(model, tree, tokens2, committed)
        ref2 = reference_accept_greedy(logits2, tokens2, tree.parents, tree.child_table())
        assert int(n2) == ref2[0] >= 1 and out2.tolist() == ref2[2]
        assert_cache_is_plain_prefill(model, tm, committed + [bonus] + ref2[2][: ref2[0]])


@torch.no_grad()
def test_accept_sampling_matches_reference(model, step):
    name, tree, tm, graph, _ = step
    T = tree.size
    seen_n = set()
    for k in range(6):
        root = rand_tokens(1, 70 + k)[0]
        # Drafts along the argmax make acceptance likely; small uniforms make it likelier still.
        tokens = force_path(model, tree, GREEDY_PATHS[name][0], PROMPT, root, seed=k)
        u = torch.rand(T + 1, generator=torch.Generator().manual_seed(k))
        if k % 2:
            u[:T] *= 0.05
        top_p = 1.0 if k < 4 else 0.8
        temp = 1.0 if k != 3 else 0.7
        prefill(tm, PROMPT)
        n, path, out = graph(torch.tensor(tokens), torch.tensor(P), torch.tensor(temp), torch.tensor(top_p), u)
        logits = hf_tree_logits(model, tree, tokens, PROMPT)
        ref = reference_accept_sample(logits, tokens, tree.parents, tree.child_table(), temp, top_p, u)
        assert (int(n), path.tolist(), out.tolist()) == ref, k
        seen_n.add(int(n))
        accepted = [tokens[i] for i in ref[1][1:ref[0] + 1]]
        assert_cache_is_plain_prefill(model, tm, PROMPT + [root] + accepted)
    assert len(seen_n) > 1  # both short and long acceptances were exercised


@torch.no_grad()
def test_compact_kv_is_identity_on_chains(model):
    tm = TargetModule(model, S)
    for k in (0, 3):
        t = chain(k)
        prev = uncaptured(build(tm, t.size, Pipeline().wrap("tree_inputs", lambda p, t=t: tree_inputs(p, t, S))))
        assert compact_kv(prev, t) is prev


# --------------------------------------------------------------------------- sample_last


@pytest.fixture(scope="module")
def prefill_program(model):
    plans = [p for p in graph_plans(get_kind("none"), chain(0), 8, S, modes=("greedy", "sample"))
             if p.name.startswith("prefill_")]
    assert [p.T for p in plans] == [8, 8] and plans[0].passes == ["tree_inputs", "sample_last", "last_row_head"]
    tm = TargetModule(model, S)
    built = {}
    programs = [build_program(p, {"target": tm}, built, chain(0)) for p in plans]
    for ep in programs:  # last_row_head: the LM head's product runs on one row
        assert [product_rows(n) for n in linears(ep)][-1] == 1
        assert max(product_rows(n) for n in linears(ep)) == 8
    graphs = [EagerGraph(ep, module_state(tm)) for ep in programs]

    def graph(tokens, base_len, n_valid, temperature, top_p, uniforms):  # top_p 1 here: greedy or sample
        if float(temperature) == 0:
            return graphs[0](tokens, base_len, n_valid)
        table = torch.rand(S, 2)
        table[int(base_len + n_valid - 1)] = uniforms  # the row of the chunk's last token
        return graphs[1](tokens, base_len, n_valid, temperature, table)

    return tm, graph


def linears(ep) -> list:
    return [n for n in ep.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.linear.default]


def product_rows(node) -> int:
    return node.args[0].meta["val"].shape[:-1].numel()


@pytest.mark.parametrize("length", [1, 5, 8, 13])
@torch.no_grad()
def test_sample_last_padded_chunks(model, prefill_program, length):
    tm, graph = prefill_program
    C = 8
    ids = rand_tokens(length, 200 + length)
    for temp in (0.0, 1.0):
        u = torch.rand(2, generator=torch.Generator().manual_seed(length))
        for start in range(0, length, C):
            piece = ids[start:start + C]
            toks = torch.tensor(piece + [7] * (C - len(piece)))  # padding with a real token id
            out = graph(toks, torch.tensor(start), torch.tensor(len(piece)), torch.tensor(temp),
                        torch.tensor(1.0), u)
        first = out[0]
        assert first.dim() == 0
        last = hf_next(model, ids)
        if temp == 0:
            assert int(first) == int(last.argmax())
        else:
            ref = reference_accept_sample(last[None], [ids[-1]], (-1,), [[-1]], temp, 1.0, u)
            assert int(first) == ref[2][0]
        assert_cache_is_plain_prefill(model, tm, ids)


# --------------------------------------------------------------------------- matvec


def op_count(ep, op) -> int:
    return sum(1 for n in ep.graph.nodes if n.op == "call_function" and n.target is op)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: the q/k/v bias path
@pytest.mark.parametrize("T", [1, 3, 5, 6])
@torch.no_grad()
def test_matvec_rewrites_few_row_linears_only(arch, T):
    model = tiny_model(arch, seed=3)
    tm = TargetModule(model, S)
    args = (torch.tensor([rand_tokens(T, T)]), (torch.arange(T) + 2).view(1, T), torch.arange(T) + 2,
            causal_mask(T, 2, S))
    ref = capture(tm, args).module()(*[a.clone() for a in args])[0]
    ep = matvec(capture(tm, args), max_rows=5)
    linear, rows_linear = torch.ops.aten.linear.default, torch.ops.specc.rows_linear.default
    n_linear = 4 * len(tm.blocks) + 1
    if T <= 5:  # the weights are parameters: one node each
        assert op_count(ep, linear) == 0 and op_count(ep, rows_linear) == n_linear
    else:
        assert op_count(ep, linear) == n_linear
    out = ep.module()(*[a.clone() for a in args])[0]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    # The program still lowers through the graph's own rewrite and retrace path.
    again = capture(ep.module(), args)
    torch.testing.assert_close(again.module()(*[a.clone() for a in args])[0], ref, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_matvec_reads_int8_weights_in_rows_linear():
    """An int8 weight cast in the graph (--quant int8) goes to rows_linear as the int8 tensor, the cast
    with it; a weight computed otherwise keeps the reduction in the graph, its rows stored once."""
    mod, x = HeadThenRow(), torch.randn(1, 3, 16)
    ep = matvec(capture(mod, (x, torch.tensor(3))))
    assert op_count(ep, torch.ops.specc.rows_linear.default) == 1 and op_count(ep, torch.ops.aten.linear.default) == 0
    (node,) = [n for n in ep.graph.nodes if n.target is torch.ops.specc.rows_linear.default]
    assert node.args[1].op == "placeholder" and node.args[1].meta["val"].dtype == torch.int8
    assert op_count(ep, torch.ops.aten.to.dtype) == 1  # the logits' own cast; the weight's is gone
    for n in (1, 3):
        torch.testing.assert_close(ep.module()(x, torch.tensor(n))[0], mod(x, torch.tensor(n))[0], rtol=1e-5, atol=1e-3)

    class Doubled(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(V, 16))

        def forward(self, x):
            return nn.functional.linear(x, self.w * 2)

    mod = Doubled().requires_grad_(False)
    ep = matvec(capture(mod, (x,)))
    assert op_count(ep, torch.ops.specc.rows_linear.default) == 0 and op_count(ep, torch.ops.aten.linear.default) == 0
    assert op_count(ep, torch.ops.aten.sum.dim_IntList) == 3
    assert op_count(ep, torch.ops.prims.inductor_force_stride_order.default) == 1
    torch.testing.assert_close(ep.module()(x), mod(x), rtol=1e-5, atol=1e-4)


# --------------------------------------------------------------------------- last_row_head


class HeadThenRow(nn.Module):
    """A chunk's head (int8-style: a cast weight, a scale after the product) and one row of it."""

    def __init__(self, also_return_all: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.register_buffer("q", torch.randint(-127, 128, (V, 16), generator=g, dtype=torch.int8))
        self.register_buffer("scale", torch.rand(V, generator=g))
        self.also_return_all = also_return_all

    def forward(self, x, n_valid):
        logits = (nn.functional.linear(x, self.q.to(x.dtype)) * self.scale).float()
        last = logits[0].index_select(0, (n_valid - 1).view(1))
        return (last, logits) if self.also_return_all else (last,)


@pytest.mark.parametrize("also_return_all", [False, True])
@torch.no_grad()
def test_last_row_head_runs_the_product_on_the_selected_row(also_return_all):
    from specc.passes.last_row_head import last_row_head

    mod = HeadThenRow(also_return_all)
    x = torch.randn(1, 12, 16)
    ep = last_row_head(capture(mod, (x, torch.tensor(12))))
    # Where all rows are returned too, the product must stay whole.
    assert product_rows(linears(ep)[0]) == (12 if also_return_all else 1)
    for n in range(1, 13):
        out, ref = ep.module()(x, torch.tensor(n)), mod(x, torch.tensor(n))
        assert len(out) == len(ref)
        for a, b in zip(out, ref):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-3)  # a GEMV and a GEMM sum in different orders


# --------------------------------------------------------------------------- Pipeline


def test_pipeline_dumps_every_pass(step):
    _, _, _, _, dump = step
    names = ["00-capture", "01-matvec", "02-tree_attention", "03-tree_inputs", "04-accept", "05-compact_kv"]
    files = sorted(p.name for p in dump.iterdir() if p.is_file())
    assert files == sorted(f"step_{mode}.{n}.txt" for mode in MODES for n in names)
    for mode in MODES:
        for n in names:
            text = (dump / f"step_{mode}.{n}.txt").read_text()
            assert "# input" in text and "# output" in text and "def forward" in text
        assert "index_copy" in (dump / f"step_{mode}.00-capture.txt").read_text()
        assert "USER_INPUT" in (dump / f"step_{mode}.03-tree_inputs.txt").read_text()
    # The greedy graph takes no sampling inputs; the sample graph no top-p.
    inputs = lambda mode: (dump / f"step_{mode}.05-compact_kv.txt").read_text().count("USER_INPUT")  # noqa: E731
    assert (inputs("greedy"), inputs("sample"), inputs("top_p")) == (2, 4, 5)


def test_pipeline_run_order_and_labels(model, tmp_path):
    tm = TargetModule(model, S)
    calls = []

    def tag(name):
        def fn(ep):
            calls.append(name)
            return ep
        return fn

    pipe = Pipeline().add("a", tag("a")).add("b", tag("b"))
    assert pipe.names == ["a", "b"]
    args = (torch.zeros(1, 2, dtype=torch.int64), torch.arange(2).view(1, 2), torch.arange(2), causal_mask(2, 0, S))
    ep = capture(tm, args)
    assert pipe.run(ep, dump_dir=tmp_path / "d", label="x") is ep
    assert calls == ["a", "b"]
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["x.00-capture.txt", "x.01-a.txt", "x.02-b.txt"]
    assert all((tmp_path / "d" / f).stat().st_size > 0 for f in ("x.00-capture.txt", "x.01-a.txt", "x.02-b.txt"))
    assert pipe.run(ep) is ep  # no dump_dir: nothing written, still runs


def test_wrapping_passes_are_captured_once_together(model, monkeypatch):
    """Consecutive wrapping passes cost one capture (before the next graph pass, or at the end), and
    the program equals the one captured after every pass: same outputs and cache writes."""
    import specc.pipeline as pipeline

    tree = TREES["topk2x2"]
    plan = next(p for p in graph_plans(get_kind("ngram"), tree, 8, S) if p.name == "step_top_p")
    tm = TargetModule(model, S)
    count = []
    real_capture = pipeline.capture
    monkeypatch.setattr(pipeline, "capture", lambda *a: count.append(1) or real_capture(*a))
    lazy = build_program(plan, {"target": tm}, {}, tree)
    # graph_plans' step: capture, tree_attention | tree_inputs, accept, compact_kv: captured at the end
    assert len(count) == 1  # (build_program's first capture goes through plans.capture: not counted)
    every = Pipeline()
    for name, fn, wraps in plan.base.pipeline.passes + plan.pipeline.passes:
        every = every.wrap(name, fn).add(f"{name} captured", lambda ep: ep) if wraps else every.add(name, fn)
    count.clear()
    eager_each = build(tm, tree.size, every)
    assert len(count) == 3  # one capture after each wrapping pass
    prefill(tm, PROMPT)
    start = [c.clone() for c in caches(tm)]
    outs = {}
    for name, ep in (("lazy", lazy), ("every", eager_each)):
        for c, s0 in zip(caches(tm), start):
            c.copy_(s0)
        graph = EagerGraph(ep, module_state(tm))
        table = torch.rand(S, tree.size + 1, generator=torch.Generator().manual_seed(0))
        tokens = torch.tensor(rand_tokens(tree.size, 3))
        out = graph(tokens, torch.tensor(P), *sampling_inputs("top_p", torch.tensor(0.9), torch.tensor(0.8), table))
        outs[name] = ([o.clone() for o in out], [c.clone() for c in caches(tm)])
    for a, b in zip(outs["lazy"][0] + outs["lazy"][1], outs["every"][0] + outs["every"][1]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
