"""Sampled children, checked statistically without a model.

A Markov "target" p(. | position, previous token) and a different "draft"
q(. | position, previous token) over V = 6 tokens, a width-2 depth-2 tree.
Each trial builds the tree by drawing every node's children i.i.d. from q,
verifies it with fresh uniforms and records the first two committed tokens
(when the first pass commits only one token, a second pass rooted at it gives
the second).  Their frequencies must match the exact two-token distribution
under p (G-test).

Negative controls, which must fail the same test: a rule that keeps p
unchanged after a rejection (no ``max(p - q, 0)``), and the sampled rule
misapplied to top-k children (which are not draws from q).

The deterministic one-hot rule (accept_sample) is NOT a negative control
here: it is exact for any child tokens chosen independently of the
uniforms, so sampled children are a mixture of exact cases and it passes.
What it loses is acceptance: on the same sampled trees it commits far fewer
draft tokens than the sampled rule, which is the reason the sampled rule
exists.  It also passes in its own setting (children = top-2 of q).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from specc.acceptance import accept, accept_sample, accept_sample_sampled, sampling_probs

V = 6
N = 20_000
PARENTS = (-1, 0, 0, 1, 1, 2, 2)
DEPTHS = (0, 1, 1, 2, 2, 2, 2)
CHILDREN = torch.tensor([[1, 2], [3, 4], [5, 6], [-1, -1], [-1, -1], [-1, -1], [-1, -1]])
T = len(PARENTS)
POSITIONS = 4  # pass 1 covers positions 0..2, a pass rooted at position 1 covers 1..3
ROOT_TOKEN = 0
TEMPERATURE, TOP_P = 0.9, 0.9  # the target's sampling parameters
DRAFT_TEMPERATURE, DRAFT_TOP_P = 1.0, 0.95  # the drafter's own (zeros in q)
TEMP_T, TOP_P_T = torch.tensor(TEMPERATURE), torch.tensor(TOP_P)


def _tables():
    gen = torch.Generator().manual_seed(2024)
    target_logits = torch.randn(POSITIONS, V, V, generator=gen) * 1.5
    draft_logits = target_logits + torch.randn(POSITIONS, V, V, generator=gen) * 1.2
    q = sampling_probs(draft_logits, torch.tensor(DRAFT_TEMPERATURE), torch.tensor(DRAFT_TOP_P))
    return target_logits, q


TARGET_LOGITS, Q = _tables()


def _exact_two_tokens() -> np.ndarray:
    p1 = sampling_probs(TARGET_LOGITS[0, ROOT_TOKEN], TEMP_T, TOP_P_T).double()
    p2 = sampling_probs(TARGET_LOGITS[1], TEMP_T, TOP_P_T).double()  # [prev, V]
    return (p1[:, None] * p2).numpy()


def _g_test(x1: torch.Tensor, x2: torch.Tensor, probs: np.ndarray) -> float:
    """G-test p-value; a sample in a zero-probability cell fails outright."""
    counts = np.bincount((x1 * V + x2).numpy(), minlength=V * V).astype(np.float64)
    expected = probs.ravel() * len(x1)
    if counts[expected <= 0].sum() > 0:
        return 0.0
    big = expected >= 5  # pool sparse cells
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    nz = obs > 0
    g = 2.0 * np.sum(obs[nz] * np.log(obs[nz] / exp[nz]))
    return float(chi2.sf(g, len(obs) - 1))


# ---------------------------------------------------------------------------
# trees and rules (batched over trials)
# ---------------------------------------------------------------------------


def _build(root: torch.Tensor, start: int, mode: str, gen: torch.Generator):
    """Tokens [M, T], logits [M, T, V], draft rows [M, T, V] for trees rooted
    at tokens ``root`` at position ``start``."""
    m = root.shape[0]
    tok = torch.empty(m, T, dtype=torch.int64)
    tok[:, 0] = root
    for i in range(1, T):
        par = PARENTS[i]
        rows = Q[start + DEPTHS[par], tok[:, par]]  # [M, V]
        if mode == "sampled":  # i.i.d. draw per child
            tok[:, i] = torch.multinomial(rows, 1, generator=gen).squeeze(1)
        else:  # top-k of q, in rank order
            rank = CHILDREN[par].tolist().index(i)
            tok[:, i] = torch.topk(rows, 2, dim=-1).indices[:, rank]
    pos = torch.tensor([start + d for d in DEPTHS])
    logits = TARGET_LOGITS[pos, tok]  # [M, T, V]
    draft = Q[pos, tok]  # [M, T, V]
    return tok, logits, draft


def _rule_sampled(logits, tok, draft, u):
    return torch.vmap(lambda lg, tk, q, uu: accept_sample_sampled(
        lg, tk, PARENTS, CHILDREN, q, TEMP_T, TOP_P_T, uu))(logits, tok, draft, u)


def _rule_deterministic(logits, tok, draft, u):
    return torch.vmap(lambda lg, tk, uu: accept_sample(
        lg, tk, PARENTS, CHILDREN, TEMP_T, TOP_P_T, uu))(logits, tok, u)


def _rule_no_subtract(logits, tok, draft, u):
    """Wrong: min(1, p/q) acceptance, but p is NOT replaced by
    norm(max(p - q, 0)) after a rejection."""
    probs = sampling_probs(logits, TEMP_T, TOP_P_T).tolist()
    draft, tok, u = draft.tolist(), tok.tolist(), u.tolist()
    kids = [[c for c in r if c >= 0] for r in CHILDREN.tolist()]
    ns, outs = [], []
    for b in range(len(tok)):
        cur, out = 0, []
        while True:
            p, q, nxt = probs[b][cur], draft[b][cur], -1
            for c in kids[cur]:
                x = tok[b][c]
                if q[x] > 0 and u[b][c] * q[x] < p[x]:
                    nxt = c
                    break
            if nxt < 0:
                break
            out.append(tok[b][nxt])
            cur = nxt
        p, cum, final = probs[b][cur], 0.0, None
        for i, v in enumerate(p):
            cum += v / sum(p)
            if cum > u[b][T] and v > 0:
                final = i
                break
        if final is None:
            final = max(i for i, v in enumerate(p) if v > 0)
        ns.append(len(out))
        out.append(final)
        outs.append(out + [final] * (3 - len(out)))
    return torch.tensor(ns), None, torch.tensor(outs)


def _two_tokens(rule, mode: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    tok, logits, draft = _build(torch.full((N,), ROOT_TOKEN), 0, mode, gen)
    u = torch.rand(N, T + 1, generator=gen)
    n, _, out = rule(logits, tok, draft, u)
    x1, x2 = out[:, 0].clone(), out[:, 1].clone()
    short = n == 0  # only one token committed: a second pass from it
    if short.any():
        tok2, logits2, draft2 = _build(x1[short], 1, mode, gen)
        u2 = torch.rand(int(short.sum()), T + 1, generator=gen)
        x2[short] = rule(logits2, tok2, draft2, u2)[2][:, 0]
    return x1, x2, n


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target():
    probs = _exact_two_tokens()
    assert (probs == 0).any()  # top-p removes tokens from the target
    assert (Q == 0).any()  # and from the draft
    return probs


def test_sampled_rule_matches_target(target):
    x1, x2, n = _two_tokens(_rule_sampled, "sampled", seed=11)
    # the rule was exercised: no-accept, one and two accepts all happen
    counts = torch.bincount(n, minlength=3)
    assert (counts > N // 20).all(), counts
    p = _g_test(x1, x2, target)
    assert p > 1e-3, f"sampled-children rule differs from the target (p={p:.2e})"


def test_accept_switch_uses_sampled_rule():
    gen = torch.Generator().manual_seed(5)
    tok, logits, draft = _build(torch.full((2000,), ROOT_TOKEN), 0, "sampled", gen)
    u = torch.rand(2000, T + 1, generator=gen)
    want = _rule_sampled(logits, tok, draft, u)
    got = torch.vmap(lambda lg, tk, q, uu: accept(
        lg, tk, PARENTS, CHILDREN, TEMP_T, TOP_P_T, uu, draft_probs=q))(logits, tok, draft, u)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_deterministic_rule_on_sampled_children_exact_but_accepts_less(target):
    # exact (see the module docstring) ...
    x1, x2, n_det = _two_tokens(_rule_deterministic, "sampled", seed=11)
    p = _g_test(x1, x2, target)
    assert p > 1e-3, f"deterministic rule on sampled children differs (p={p:.2e})"
    # ... but on the same trees and uniforms it accepts less than min(1, p/q)
    gen = torch.Generator().manual_seed(17)
    tok, logits, draft = _build(torch.full((N,), ROOT_TOKEN), 0, "sampled", gen)
    u = torch.rand(N, T + 1, generator=gen)
    mean_det = _rule_deterministic(logits, tok, draft, u)[0].double().mean()
    mean_sampled = _rule_sampled(logits, tok, draft, u)[0].double().mean()
    assert mean_sampled > mean_det + 0.3, (mean_sampled, mean_det)


def test_no_subtract_rule_on_sampled_children_fails(target):
    x1, x2, _ = _two_tokens(_rule_no_subtract, "sampled", seed=11)
    p = _g_test(x1, x2, target)
    assert p < 1e-6, f"negative control not detected (p={p:.2e})"


def test_deterministic_rule_on_topk_children_matches_target(target):
    x1, x2, n = _two_tokens(_rule_deterministic, "topk", seed=13)
    assert (torch.bincount(n, minlength=3) > N // 20).all()
    p = _g_test(x1, x2, target)
    assert p > 1e-3, f"deterministic rule on top-k children differs (p={p:.2e})"


def test_sampled_rule_on_topk_children_fails(target):
    # top-k children are not draws from q: min(1, p/q) is then biased
    x1, x2, _ = _two_tokens(_rule_sampled, "topk", seed=13)
    p = _g_test(x1, x2, target)
    assert p < 1e-6, f"negative control not detected (p={p:.2e})"
