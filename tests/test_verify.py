"""Tests for specc.acceptance: vectorised == reference, losslessness, export."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from specc.acceptance import (
    accept,
    accept_greedy,
    accept_sample,
    accept_sample_sampled,
    reference_accept_greedy,
    reference_accept_sample,
    reference_accept_sample_sampled,
    reference_sampling_probs,
    sampling_probs,
    tree_depth,
)
from specc.signature import MODES, mode_of

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ---------------------------------------------------------------------------
# tree helpers
# ---------------------------------------------------------------------------


def build_tree(paths, order: str = "bfs", extra_width: int = 0):
    """Tree from a prefix-closed set of label paths.

    The last label of a path is the node's sibling rank key.  ``order`` picks
    the node numbering (always parents before children): ``bfs``, ``dfs`` or
    ``rbfs`` (breadth-first with siblings numbered against their rank, so
    index order and rank order differ).  Returns (parents, children, depths).
    """
    nodes = {()}
    for p in paths:
        for k in range(1, len(p) + 1):
            nodes.add(tuple(p[:k]))
    if order == "bfs":
        key = lambda p: (len(p), p)  # noqa: E731
    elif order == "dfs":
        key = lambda p: p  # noqa: E731
    elif order == "rbfs":
        key = lambda p: (len(p), tuple(-x for x in p))  # noqa: E731
    else:
        raise ValueError(order)
    ordered = sorted(nodes, key=key)
    index = {p: i for i, p in enumerate(ordered)}
    parents = tuple(-1 if not p else index[p[:-1]] for p in ordered)
    kids = [[] for _ in ordered]
    for p in ordered:
        if p:
            kids[index[p[:-1]]].append(p)
    width = max(1, max(len(k) for k in kids)) + extra_width
    children = torch.full((len(ordered), width), -1, dtype=torch.int64)
    for i, ks in enumerate(kids):
        for r, p in enumerate(sorted(ks)):  # sibling rank = label order
            children[i, r] = index[p]
    depths = tuple(len(p) for p in ordered)
    return parents, children, depths


@st.composite
def tree_strategy(draw, max_nodes: int = 12):
    n_paths = draw(st.integers(0, 6))
    paths = []
    size = 1
    for _ in range(n_paths):
        p = tuple(draw(st.lists(st.integers(0, 2), min_size=1, max_size=4)))
        new = {p[:k] for k in range(1, len(p) + 1)}
        existing = {q[:k] for q in paths for k in range(1, len(q) + 1)}
        if size + len(new - existing) > max_nodes:
            break
        size += len(new - existing)
        paths.append(p)
    order = draw(st.sampled_from(["bfs", "dfs", "rbfs"]))
    extra = draw(st.integers(0, 1))
    return build_tree(paths, order, extra)


def test_build_tree_sanity():
    parents, children, depths = build_tree([(0, 1), (2,), (0, 0, 1)], "rbfs")
    assert parents[0] == -1
    assert all(parents[i] < i for i in range(1, len(parents)))
    assert tree_depth(parents) == max(depths) == 3
    for i, row in enumerate(children.tolist()):
        for c in row:
            if c >= 0:
                assert parents[c] == i


# ---------------------------------------------------------------------------
# sampling_probs
# ---------------------------------------------------------------------------


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    v=st.integers(1, 10),
    temperature=st.sampled_from([0.5, 1.0, 2.0, 1e-7]),
    top_p=st.sampled_from([0.0, 0.5, 0.9, 1.0, 1.5]),
)
def test_sampling_probs_matches_reference(seed, v, temperature, top_p):
    rng = np.random.default_rng(seed)
    logits = torch.tensor(rng.normal(size=(2, 3, v)) * 3, dtype=torch.float32)
    got = sampling_probs(logits, torch.tensor(temperature), torch.tensor(top_p))
    assert got.dtype == torch.float32 and got.shape == logits.shape
    assert torch.isfinite(got).all()
    flat_l = logits.reshape(-1, v)
    flat_g = got.reshape(-1, v)
    for r in range(flat_l.shape[0]):
        ref = reference_sampling_probs(flat_l[r].tolist(), temperature, top_p)
        np.testing.assert_allclose(flat_g[r].numpy(), ref, rtol=1e-5, atol=1e-6)
        # the support is decided identically (no boundary case with random data); below
        # 1e-30 float32 may underflow to 0 or keep a denormal (seed 6902, T = 1e-7: 1.04e-39)
        for g, f in zip(flat_g[r].tolist(), ref):
            assert g > 0 if f > 1e-30 else g <= 1e-30, (g, f)


def test_sampling_probs_top_p_edges():
    logits = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3]))
    one = torch.tensor(1.0)
    p = sampling_probs(logits, one, torch.tensor(0.5))  # {0.4, 0.3} reach 0.7
    torch.testing.assert_close(p, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))
    p = sampling_probs(logits, one, torch.tensor(0.4))  # 0.4 alone is enough
    torch.testing.assert_close(p, torch.tensor([0.0, 1.0, 0.0, 0.0]))
    p = sampling_probs(logits, one, torch.tensor(0.0))  # top token always kept
    torch.testing.assert_close(p, torch.tensor([0.0, 1.0, 0.0, 0.0]))
    p = sampling_probs(logits, one, torch.tensor(1.0))
    torch.testing.assert_close(p, torch.tensor([0.1, 0.4, 0.2, 0.3]))
    # ties keep the lower index first
    tied = torch.zeros(4)
    p = sampling_probs(tied, one, torch.tensor(0.5))
    torch.testing.assert_close(p, torch.tensor([0.5, 0.5, 0.0, 0.0]))
    # tiny temperature is clamped, not inf/nan
    p = sampling_probs(torch.tensor([1.0, 2.0, 0.0]), torch.tensor(0.0), one)
    torch.testing.assert_close(p, torch.tensor([0.0, 1.0, 0.0]))


# ---------------------------------------------------------------------------
# vectorised == reference
# ---------------------------------------------------------------------------


def _as_tuple(res):
    n, path, out = res
    assert n.dtype == torch.int64 and n.dim() == 0
    assert path.dtype == torch.int64 and out.dtype == torch.int64
    return int(n), path.tolist(), out.tolist()


def _check_structure(res, parents, tokens, depth):
    n, path, out = res
    assert len(path) == len(out) == depth + 1
    assert path[0] == 0
    for k in range(1, n + 1):
        assert parents[path[k]] == path[k - 1]
        assert out[k - 1] == tokens[path[k]]
    assert all(x == path[n] for x in path[n:])
    assert all(x == out[n] for x in out[n:])


@SETTINGS
@given(tree=tree_strategy(), data=st.data())
def test_greedy_matches_reference(tree, data):
    parents, children, _ = tree
    t = len(parents)
    v = data.draw(st.integers(1, 10))
    # small integer logits: many argmax ties (first index wins in both)
    logits = torch.tensor(
        data.draw(st.lists(st.lists(st.integers(-2, 2), min_size=v, max_size=v),
                           min_size=t, max_size=t)),
        dtype=torch.float32,
    )
    tokens = [data.draw(st.integers(0, v - 1))]
    for i in range(1, t):
        if data.draw(st.booleans()):
            tokens.append(int(torch.argmax(logits[parents[i]])))
        else:
            tokens.append(data.draw(st.integers(0, v - 1)))
    tokens_t = torch.tensor(tokens, dtype=torch.int64)
    got = _as_tuple(accept_greedy(logits, tokens_t, parents, children))
    ref = reference_accept_greedy(logits, tokens_t, parents, children)
    assert got == ref
    _check_structure(got, parents, tokens, tree_depth(parents))
    # the switch picks greedy for temperature <= 0
    uniforms = torch.rand(t + 1)
    for temp in (0.0, -1.0):
        sw = _as_tuple(accept(logits, tokens_t, parents, children, torch.tensor(temp),
                              torch.tensor(0.9), uniforms))
        assert sw == ref


def _random_sampling_case(tree, seed):
    parents, children, _ = tree
    t = len(parents)
    rng = np.random.default_rng(seed)
    v = int(rng.integers(1, 11))
    scale = float(rng.choice([0.5, 2.0, 4.0]))
    logits = torch.tensor(rng.normal(size=(t, v)) * scale, dtype=torch.float32)
    tokens = [int(rng.integers(0, v))]
    for i in range(1, t):
        row = logits[parents[i]].double()
        mode = rng.integers(0, 3)
        if mode == 0:
            tokens.append(int(torch.argmax(row)))
        elif mode == 1:
            pr = torch.softmax(row, -1).numpy()
            tokens.append(int(rng.choice(v, p=pr / pr.sum())))
        else:
            tokens.append(int(rng.integers(0, v)))
    uniforms = torch.tensor(rng.random(t + 1), dtype=torch.float32)
    return logits, torch.tensor(tokens, dtype=torch.int64), uniforms


@SETTINGS
@given(
    tree=tree_strategy(),
    seed=st.integers(0, 2**32 - 1),
    temperature=st.sampled_from([0.5, 1.0, 2.0]),
    top_p=st.sampled_from([0.5, 0.9, 1.0]),
)
def test_sample_matches_reference(tree, seed, temperature, top_p):
    parents, children, _ = tree
    logits, tokens, uniforms = _random_sampling_case(tree, seed)
    args = (torch.tensor(temperature), torch.tensor(top_p), uniforms)
    got = _as_tuple(accept_sample(logits, tokens, parents, children, *args))
    ref = reference_accept_sample(logits, tokens, parents, children, temperature, top_p, uniforms)
    assert got == ref
    _check_structure(got, parents, tokens.tolist(), tree_depth(parents))
    # the final token has positive probability in the target distribution
    final_node = got[1][got[0]]
    p = sampling_probs(logits[final_node], args[0], args[1])
    assert p[got[2][got[0]]] > 0
    # the switch picks sampling for temperature > 0
    assert _as_tuple(accept(logits, tokens, parents, children, *args)) == got


def test_root_only_tree():
    parents, children, _ = build_tree([])
    assert parents == (-1,) and tree_depth(parents) == 0
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    tokens = torch.tensor([2])
    n, path, out = accept_greedy(logits, tokens, parents, children)
    assert (int(n), path.tolist(), out.tolist()) == (0, [0], [1])
    # p = softmax([0, 3, 1]) ~ [0.042, 0.844, 0.114]; inverse CDF with u[T]
    for u_t, want in [(0.0, 0), (0.5, 1), (0.99, 2)]:
        u = torch.tensor([0.5, u_t])
        for fn in (accept_sample, accept):
            n, path, out = fn(logits, tokens, parents, children, torch.tensor(1.0),
                              torch.tensor(1.0), u)
            assert (int(n), path.tolist(), out.tolist()) == (0, [0], [want])
        assert reference_accept_sample(logits, tokens, parents, children, 1.0, 1.0, u) == (
            0, [0], [want])


def test_sample_edge_uniforms():
    # chain root -> a; the residual after rejection has a zero tail (top-p),
    # u[T] just below 1 must never pick a zero-probability token
    parents, children, _ = build_tree([(0,)])
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]]))
    tokens = torch.tensor([0, 1])
    top = float(np.nextafter(np.float32(1.0), np.float32(0.0)))
    for u_a, u_t in [(0.999, top), (0.999, 0.0), (0.0, top), (0.999, 0.5)]:
        u = torch.tensor([0.3, u_a, u_t], dtype=torch.float32)
        res = _as_tuple(accept_sample(logits, tokens, parents, children, torch.tensor(1.0),
                                      torch.tensor(0.5), u))
        ref = reference_accept_sample(logits, tokens, parents, children, 1.0, 0.5, u)
        assert res == ref
        if u_a == 0.0:  # p(1)/sum = 3/7 > 0: accepted
            assert res[0] == 1
        else:  # rejected -> residual keeps only token 0 (token 1 zeroed)
            assert res == (0, [0, 0], [0, 0])
    # a rejected token of probability 0 is never accepted even with u = 0
    tokens = torch.tensor([0, 3])  # token 3 is outside the top-p set
    for u_t in (0.7, top):  # residual [4/7, 3/7, 0, 0]
        u = torch.tensor([0.3, 0.0, u_t], dtype=torch.float32)
        res = _as_tuple(accept_sample(logits, tokens, parents, children, torch.tensor(1.0),
                                      torch.tensor(0.5), u))
        assert res == (0, [0, 0], [1, 1])
        assert res == reference_accept_sample(logits, tokens, parents, children, 1.0, 0.5, u)


def test_duplicate_siblings_rejected_automatically():
    # root has three children with tokens 1, 1, 2 (duplicate 1)
    parents, children, _ = build_tree([(0,), (1,), (2,)])
    logits = torch.zeros(4, 3)
    tokens = torch.tensor([0, 1, 1, 2])
    # first child rejected (u=0.9 > 1/3); duplicate has p=0 -> rejected even with u=0;
    # third: p(2)/sum = 0.5, u=0.2 -> accepted
    u = torch.tensor([0.5, 0.9, 0.0, 0.2, 0.5])
    res = _as_tuple(accept_sample(logits, tokens, parents, children, torch.tensor(1.0),
                                  torch.tensor(1.0), u))
    assert res == (1, [0, 3], [2, 1])
    assert res == reference_accept_sample(logits, tokens, parents, children, 1.0, 1.0, u)


# ---------------------------------------------------------------------------
# losslessness: output distribution == target distribution
# ---------------------------------------------------------------------------

# root -> a (token 1), b (token 3), c (token 1, duplicate of a); a -> d (token 2)
EXACT_PATHS = [(0, 0), (1,), (2,)]
EXACT_V = 5
EXACT_TEMPERATURE = 0.8
EXACT_TOP_P = 0.9


def _exact_case():
    parents, children, _ = build_tree(EXACT_PATHS, "bfs")
    # bfs numbering: 0 root, 1 a=(0,), 2 b=(1,), 3 c=(2,), 4 d=(0,0)
    assert parents == (-1, 0, 0, 0, 1)
    logits = torch.tensor(
        [
            [0.3, 1.0, -2.5, 1.4, 0.6],
            [1.1, 0.2, 0.9, -0.4, 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0],
            [0.5, 0.1, 0.3, 0.2, 0.4],
        ]
    )
    tokens = torch.tensor([0, 1, 3, 1, 2])
    return parents, children, logits, tokens


def _chi2_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit; zero-probability categories must be empty."""
    counts = np.bincount(samples, minlength=len(probs)).astype(np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    zero = probs <= 0
    if counts[zero].sum() > 0:
        return 0.0
    probs = probs[~zero] / probs[~zero].sum()
    counts = counts[~zero]
    if len(counts) == 1:
        return 1.0
    return float(stats.chisquare(counts, probs * counts.sum()).pvalue)


def _wrong_rule_first_token(logits, tokens, children, temperature, top_p, uniforms):
    """Deliberately wrong: rejected tokens are NOT removed from p."""
    rows = logits.tolist()
    kids = [[c for c in r if c >= 0] for r in children.tolist()]
    toks = tokens.tolist()
    p = reference_sampling_probs(rows[0], temperature, top_p)
    for c in kids[0]:
        if uniforms[c] < p[toks[c]] / sum(p):
            return toks[c]
        # bug: p[toks[c]] = 0.0 missing
    u = uniforms[len(rows)]
    cum = 0.0
    for i, v in enumerate(p):
        cum += v / sum(p)
        if cum > u:
            return i
    return max(i for i, v in enumerate(p) if v > 0)


def _reference_first_tokens(rule, n_samples, seed):
    parents, children, logits, tokens = _exact_case()
    rng = np.random.default_rng(seed)
    us = rng.random((n_samples, len(parents) + 1))
    out = []
    for u in us:
        u = u.tolist()
        if rule == "wrong":
            out.append(_wrong_rule_first_token(logits, tokens, children, EXACT_TEMPERATURE,
                                               EXACT_TOP_P, u))
        else:
            out.append(reference_accept_sample(logits, tokens, parents, children,
                                               EXACT_TEMPERATURE, EXACT_TOP_P, u)[2][0])
    return np.array(out)


def _target_first():
    _, _, logits, _ = _exact_case()
    return sampling_probs(logits[0], torch.tensor(EXACT_TEMPERATURE),
                          torch.tensor(EXACT_TOP_P)).double().numpy()


def test_lossless_vectorised_monte_carlo():
    parents, children, logits, tokens = _exact_case()
    temp, top_p = torch.tensor(EXACT_TEMPERATURE), torch.tensor(EXACT_TOP_P)
    n_samples = 200_000
    gen = torch.Generator().manual_seed(1234)
    us = torch.rand(n_samples, len(parents) + 1, generator=gen)
    run = torch.vmap(lambda u: accept_sample(logits, tokens, parents, children, temp, top_p, u))
    n, path, out = run(us)
    target0 = _target_first()
    assert target0.min() == 0.0  # top-p removes a token in this case
    first = out[:, 0].numpy()
    assert _chi2_pvalue(first, target0) > 1e-3
    # second token given the first was token 1 (only reachable through node a,
    # since the duplicate c is rejected automatically): target is logits[a]
    sel = first == 1
    assert sel.sum() > 10_000
    assert (path[torch.from_numpy(sel), 1] == 1).all()
    target1 = sampling_probs(logits[1], temp, top_p).double().numpy()
    assert _chi2_pvalue(out[torch.from_numpy(sel), 1].numpy(), target1) > 1e-3
    # acceptance did happen through several branches
    assert set(path[:, 1].tolist()) >= {0, 1, 2}


def test_lossless_reference_vs_wrong_rule():
    target0 = _target_first()
    good = _reference_first_tokens("good", 20_000, seed=7)
    bad = _reference_first_tokens("wrong", 20_000, seed=7)
    assert _chi2_pvalue(good, target0) > 1e-3
    assert _chi2_pvalue(bad, target0) < 1e-12  # negative control must fail


def test_lossless_exact_integration_single_child():
    # chain root -> a: P(first = y) integrates exactly over u[a], u[T]:
    # accept with prob p(x); otherwise residual (p with x removed) sampled.
    # Check the vectorised rule on a stratified grid of uniforms.
    parents, children, _ = build_tree([(0,)])
    logits = torch.tensor([[0.2, 1.3, -0.7, 0.5], [0.0, 0.0, 0.0, 0.0]])
    tokens = torch.tensor([0, 3])
    temp, top_p = torch.tensor(1.0), torch.tensor(1.0)
    grid = 400
    g = (torch.arange(grid, dtype=torch.float32) + 0.5) / grid
    ua, ut = torch.meshgrid(g, g, indexing="ij")
    us = torch.stack([torch.zeros_like(ua), ua, ut], dim=-1).reshape(-1, 3)
    run = torch.vmap(lambda u: accept_sample(logits, tokens, parents, children, temp, top_p, u))
    out = run(us)[2][:, 0]
    freq = torch.bincount(out, minlength=4).double() / us.shape[0]
    target = sampling_probs(logits[0], temp, top_p).double()
    # each decision boundary misclassifies at most one grid row/column
    assert torch.allclose(freq, target, atol=4.0 / grid)


# ---------------------------------------------------------------------------
# torch.export
# ---------------------------------------------------------------------------


class AcceptModule(torch.nn.Module):
    def __init__(self, parents, mode=None):
        super().__init__()
        self.parents, self.mode = tuple(parents), mode

    def forward(self, logits, tokens, children, temperature, top_p, uniforms):
        return accept(logits, tokens, self.parents, children, temperature, top_p, uniforms, mode=self.mode)


def export_per_mode(make, example) -> dict:
    """One exported program per mode (what an engine holds): none holds a run-time branch."""
    out = {}
    for mode in MODES:
        ep = torch.export.export(make(mode), example, strict=False)
        targets = {str(n.target) for n in ep.graph_module.graph.nodes}
        assert not any("cond" in s for s in targets), mode  # the mode is static: no torch.cond
        assert any("sort" in s for s in targets) == (mode == "top_p"), mode
        out[mode] = ep
    return out


@pytest.mark.parametrize("paths", [[(0, 0, 1), (0, 1), (1,), (2, 0)], []])
def test_export_matches_eager(paths):
    parents, children, _ = build_tree(paths, "rbfs")
    t = len(parents)
    v = 7
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(t, v, generator=gen) * 2
    tokens = torch.zeros(t, dtype=torch.int64)
    for i in range(1, t):
        tokens[i] = torch.argmax(logits[parents[i]])
    uniforms = torch.rand(t + 1, generator=gen)
    mod = AcceptModule(parents)
    example = (logits, tokens, children, torch.tensor(1.0), torch.tensor(0.9), uniforms)
    programs = export_per_mode(lambda mode: AcceptModule(parents, mode), example)
    for temp, top_p in [(0.0, 1.0), (1.0, 0.9), (0.7, 1.0), (2.0, 0.5)]:
        exported = programs[mode_of(temp, top_p)].module()
        for trial in range(3):
            u = torch.rand(t + 1, generator=gen)
            args = (logits, tokens, children, torch.tensor(temp), torch.tensor(top_p), u)
            got = exported(*args)
            want = mod(*args)
            for a, b in zip(got, want):
                assert a.dtype == b.dtype and torch.equal(a, b)
            if temp > 0:
                ref = reference_accept_sample(logits, tokens, parents, children, temp, top_p, u)
            else:
                ref = reference_accept_greedy(logits, tokens, parents, children)
            assert _as_tuple(got) == ref
    if len(paths) > 0:
        # greedy with argmax drafts accepts a full path
        n = programs["greedy"].module()(logits, tokens, children, torch.tensor(0.0), torch.tensor(1.0), uniforms)[0]
        assert int(n) == tree_depth(parents)


# ---------------------------------------------------------------------------
# sampled children (draft distribution q, i.i.d. siblings)
# ---------------------------------------------------------------------------


def _random_sampled_case(tree, seed, temperature, top_p):
    """Random logits, draft rows q and children drawn from them (mostly)."""
    parents, children, _ = tree
    t = len(parents)
    rng = np.random.default_rng(seed)
    v = int(rng.integers(1, 11))
    scale = float(rng.choice([0.5, 2.0, 4.0]))
    logits = torch.tensor(rng.normal(size=(t, v)) * scale, dtype=torch.float32)
    p = sampling_probs(logits, torch.tensor(temperature), torch.tensor(top_p))
    has_kids = (children >= 0).any(dim=1).tolist()
    q = torch.empty(t, v, dtype=torch.float32)
    for i in range(t):
        mode = int(rng.integers(0, 6))
        if not has_kids[i] and mode == 0:
            q[i] = float("nan")  # leaf rows are ignored
        elif mode <= 1:  # a different distribution, zeros included
            w = np.exp(rng.normal(size=v) * scale) * (rng.random(v) < 0.7)
            w[int(rng.integers(0, v))] += 0.1
            q[i] = torch.tensor(w, dtype=torch.float32)  # unnormalised on purpose
        elif mode == 2:  # q == p exactly (rejection has probability 0)
            q[i] = p[i]
        elif mode == 3:  # one-hot (deterministic draft)
            q[i] = 0.0
            q[i, int(rng.integers(0, v))] = 1.0
        elif mode == 4:  # uniform
            q[i] = 1.0 / v
        else:  # near p: a small perturbation
            q[i] = p[i] * torch.tensor(np.exp(rng.normal(size=v) * 0.1), dtype=torch.float32)
    tokens = [int(rng.integers(0, v))]
    for i in range(1, t):
        qp = q[parents[i]].double().numpy()
        mode = int(rng.integers(0, 4))
        if mode <= 1 and np.isfinite(qp).all() and qp.sum() > 0:
            tokens.append(int(rng.choice(v, p=qp / qp.sum())))  # x ~ q
        elif mode == 2:
            tokens.append(int(torch.argmax(p[parents[i]])))
        else:  # anything, q(x) == 0 included (a void draw)
            tokens.append(int(rng.integers(0, v)))
    uniforms = torch.tensor(rng.random(t + 1), dtype=torch.float32)
    return logits, torch.tensor(tokens, dtype=torch.int64), q, uniforms


@SETTINGS
@given(
    tree=tree_strategy(),
    seed=st.integers(0, 2**32 - 1),
    temperature=st.sampled_from([0.5, 1.0, 2.0]),
    top_p=st.sampled_from([0.5, 0.9, 1.0]),
)
def test_sampled_matches_reference(tree, seed, temperature, top_p):
    parents, children, _ = tree
    logits, tokens, q, uniforms = _random_sampled_case(tree, seed, temperature, top_p)
    args = (torch.tensor(temperature), torch.tensor(top_p), uniforms)
    got = _as_tuple(accept_sample_sampled(logits, tokens, parents, children, q, *args))
    ref = reference_accept_sample_sampled(logits, tokens, parents, children, q, temperature,
                                          top_p, uniforms)
    assert got == ref
    _check_structure(got, parents, tokens.tolist(), tree_depth(parents))
    # the final token has positive probability in the target distribution
    final_node = got[1][got[0]]
    p = sampling_probs(logits[final_node], args[0], args[1])
    assert p[got[2][got[0]]] > 0
    # every accepted draft had q(x) > 0 at its parent and p(x) > 0
    for k in range(1, got[0] + 1):
        par, x = got[1][k - 1], got[2][k - 1]
        qrow = q[par]
        assert qrow[x] > 0
        assert sampling_probs(logits[par], args[0], args[1])[x] > 0
    # the switch picks the sampled rule for temperature > 0 when q is given ...
    assert _as_tuple(accept(logits, tokens, parents, children, *args, draft_probs=q)) == got
    # ... and argmax matching for temperature <= 0
    greedy = reference_accept_greedy(logits, tokens, parents, children)
    for temp in (0.0, -1.0):
        sw = accept(logits, tokens, parents, children, torch.tensor(temp), args[1], uniforms,
                    draft_probs=q)
        assert _as_tuple(sw) == greedy


@SETTINGS
@given(
    depth=st.integers(0, 5),
    seed=st.integers(0, 2**32 - 1),
    temperature=st.sampled_from([0.5, 1.0, 2.0]),
    top_p=st.sampled_from([0.5, 0.9, 1.0]),
)
def test_sampled_one_hot_chain_is_deterministic_rule(depth, seed, temperature, top_p):
    # q one-hot at the child's token on a chain: the sampled rule IS the
    # deterministic rule (accept with p(x), residual p without x)
    parents, children, _ = build_tree([tuple([0] * depth)] if depth else [])
    tree = (parents, children, None)
    logits, tokens, _ = _random_sampling_case(tree, seed)
    t, v = logits.shape
    q = torch.zeros(t, v)
    for i in range(1, t):
        q[parents[i], tokens[i]] = 1.0
    rng = np.random.default_rng(seed + 1)
    uniforms = torch.tensor(rng.random(t + 1), dtype=torch.float32)
    args = (torch.tensor(temperature), torch.tensor(top_p), uniforms)
    got = _as_tuple(accept_sample_sampled(logits, tokens, parents, children, q, *args))
    assert got == _as_tuple(accept_sample(logits, tokens, parents, children, *args))


def test_sampled_degenerate_cases():
    one, half = torch.tensor(1.0), torch.tensor(0.5)
    # root -> three children; p = softmax(0) over 4 tokens = 1/4 each
    parents, children, _ = build_tree([(0,), (1,), (2,)])
    logits = torch.zeros(4, 4)

    def run(tokens, q, u, top_p=one):
        tokens = torch.tensor(tokens)
        u = torch.tensor(u, dtype=torch.float32)
        got = _as_tuple(accept_sample_sampled(logits, tokens, parents, children, q, one, top_p, u))
        ref = reference_accept_sample_sampled(logits, tokens, parents, children, q, 1.0,
                                              float(top_p), u)
        assert got == ref
        return got

    # p == q: always accepted, even with u just below 1
    top = float(np.nextafter(np.float32(1.0), np.float32(0.0)))
    q = torch.full((4, 4), 0.25)
    assert run([0, 2, 1, 3], q, [0.5, top, top, top, 0.5]) == (1, [0, 1], [2, 2])
    # q(x) == 0 for the drawn token: void (neither accepted nor subtracted),
    # even when p(x) > 0 and u == 0; the next sibling is tested against p itself
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0]] + [[0.25] * 4] * 3)
    # child 1 token 2 void; child 2 token 0: u=0.6 < p/q = 0.5 false -> rejected,
    # residual max(p - q, 0) = [0, 0, 1/2, 1/2]; child 3 token 1: p = 0 -> rejected,
    # residual unchanged; final from [0, 0, 1/2, 1/2] with u=0.3 -> token 2
    assert run([0, 2, 0, 1], q, [0.5, 0.0, 0.6, 0.0, 0.3]) == (0, [0, 0], [2, 2])
    # void draw then accepted sibling (u*q = 0.4*0.5 < 1/4)
    assert run([0, 3, 1, 0], q, [0.5, 0.0, 0.4, 0.0, 0.3]) == (1, [0, 2], [1, 1])
    # duplicate siblings: a rejected token has residual 0 and its duplicate is
    # rejected even with u = 0 (the residual update is applied again: unchanged)
    assert run([0, 0, 0, 1], q, [0.5, 0.9, 0.0, 0.9, 0.99]) == (0, [0, 0], [3, 3])
    # a token outside the target's top-p set (p(x) = 0) is never accepted;
    # logits make p = [0, 0, 1, 0] after top-p 0.5
    logits = torch.tensor([[0.0, 0.0, 3.0, 0.0]] + [[0.0] * 4] * 3)
    q = torch.tensor([[0.25] * 4] * 4)
    assert run([0, 0, 1, 3], q, [0.5, 0.0, 0.0, 0.0, 0.9], top_p=half) == (0, [0, 0], [2, 2])
    # an all-zero q row: every draw is void, the final token comes from p
    logits = torch.zeros(4, 4)
    q = torch.zeros(4, 4)
    assert run([0, 0, 1, 2], q, [0.5, 0.0, 0.0, 0.0, 0.6]) == (0, [0, 0], [2, 2])


def test_sampled_residual_fallback():
    from specc.kernels.tree_accept import sampled_residual

    p = torch.tensor([0.25, 0.5, 0.25, 0.0])
    # max(p - q, 0) == 0 (p == q, or q above p everywhere): keep p
    assert torch.equal(sampled_residual(p, p.clone()), p)
    assert torch.equal(sampled_residual(p, torch.tensor([0.3, 0.6, 0.3, 0.1])), p)
    got = sampled_residual(p, torch.tensor([0.5, 0.25, 0.0, 0.25]))
    torch.testing.assert_close(got, torch.tensor([0.0, 0.5, 0.5, 0.0]))


def test_sampled_leaf_rows_ignored():
    parents, children, _ = build_tree([(0, 0), (0, 1), (1,)], "rbfs")
    t, v = len(parents), 5
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(t, v, generator=gen)
    q = torch.softmax(torch.randn(t, v, generator=gen), -1)
    tokens = torch.randint(0, v, (t,), generator=gen)
    leaves = ~(children >= 0).any(dim=1)
    q_nan = q.clone()
    q_nan[leaves] = float("nan")
    for _ in range(20):
        u = torch.rand(t + 1, generator=gen)
        a = accept_sample_sampled(logits, tokens, parents, children, q, torch.tensor(1.0),
                                  torch.tensor(1.0), u)
        b = accept_sample_sampled(logits, tokens, parents, children, q_nan, torch.tensor(1.0),
                                  torch.tensor(1.0), u)
        assert _as_tuple(a) == _as_tuple(b)


def test_sampled_bad_draft_shape():
    parents, children, _ = build_tree([(0,)])
    with pytest.raises(ValueError):
        accept_sample_sampled(torch.zeros(2, 3), torch.tensor([0, 1]), parents, children,
                              torch.zeros(2, 4), torch.tensor(1.0), torch.tensor(1.0),
                              torch.rand(3))


class AcceptSampledModule(torch.nn.Module):
    def __init__(self, parents, mode=None):
        super().__init__()
        self.parents, self.mode = tuple(parents), mode

    def forward(self, logits, tokens, children, draft_probs, temperature, top_p, uniforms):
        return accept(logits, tokens, self.parents, children, temperature, top_p, uniforms,
                      draft_probs=draft_probs, mode=self.mode)


@pytest.mark.parametrize("paths", [[(0, 0, 1), (0, 1), (1,), (2, 0)], []])
def test_export_sampled_matches_eager(paths):
    parents, children, _ = build_tree(paths, "rbfs")
    t, v = len(parents), 7
    depth = tree_depth(parents)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(t, v, generator=gen) * 2
    q = torch.softmax(torch.randn(t, v, generator=gen), -1)
    tokens = torch.zeros(t, dtype=torch.int64)
    for i in range(1, t):
        tokens[i] = torch.multinomial(q[parents[i]], 1, generator=gen)[0]
    uniforms = torch.rand(t + 1, generator=gen)
    mod = AcceptSampledModule(parents)
    example = (logits, tokens, children, q, torch.tensor(1.0), torch.tensor(0.9), uniforms)
    programs = export_per_mode(lambda mode: AcceptSampledModule(parents, mode), example)
    for ep in programs.values():
        # static shapes: no symbolic size anywhere in the graph
        for node in ep.graph_module.graph.nodes:
            val = node.meta.get("val")
            vals = val if isinstance(val, (tuple, list)) else [val]
            for item in vals:
                if isinstance(item, torch.Tensor):
                    assert all(isinstance(d, int) for d in item.shape), node
        out_shapes = [tuple(x.meta["val"].shape) for x in
                      next(iter(n for n in ep.graph.nodes if n.op == "output")).args[0]]
        assert out_shapes == [(), (depth + 1,), (depth + 1,)]
    for temp, top_p in [(0.0, 1.0), (1.0, 0.9), (0.7, 1.0), (2.0, 0.5)]:
        exported = programs[mode_of(temp, top_p)].module()
        for trial in range(3):
            u = torch.rand(t + 1, generator=gen)
            args = (logits, tokens, children, q, torch.tensor(temp), torch.tensor(top_p), u)
            got = exported(*args)
            want = mod(*args)
            for a, b in zip(got, want):
                assert a.dtype == b.dtype and torch.equal(a, b)
            if temp > 0:
                ref = reference_accept_sample_sampled(logits, tokens, parents, children, q,
                                                      temp, top_p, u)
            else:
                ref = reference_accept_greedy(logits, tokens, parents, children)
            assert _as_tuple(got) == ref
