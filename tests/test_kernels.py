"""specc.kernels: each Triton kernel, run by Triton's interpreter on CPU tensors, against its torch
reference on random inputs; the custom ops' CPU dispatch, fake shapes and torch.export; and the
passes that put the ops into the graphs (tree_attention, compact_kv)."""
from __future__ import annotations

import os

# Before triton is first imported: @triton.jit decides at decoration time whether to interpret.
os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from tiny import tiny_model  # noqa: E402

import specc.kernels as K  # noqa: E402
from specc.drafters import get_kind  # noqa: E402
from specc.pipeline import capture  # noqa: E402
from specc.plans import build_program, graph_plans  # noqa: E402
from specc.target_module import NEG_INF, TargetModule, causal_mask  # noqa: E402
from specc.kernels import compact_kv as compact_mod  # noqa: E402
from specc.kernels import tree_accept as accept_mod  # noqa: E402
from specc.kernels import tree_attention as attention_mod  # noqa: E402
from specc.passes.tree_attention import SDPA, tree_attention  # noqa: E402
from specc.tree import chain, topk, tree_from_paths  # noqa: E402
from specc.acceptance import (accept_greedy, accept_sample, reference_accept_greedy, sampling_probs,  # noqa: E402
                          tree_depth)

ops = torch.ops.specc
IRREGULAR = tree_from_paths([[0], [1], [2], [0, 0], [0, 1], [2, 0], [0, 0, 0], [2, 0, 0], [2, 0, 1]])


def _interpreting() -> bool:
    if not K.HAS_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(attention_mod._tree_attention_kernel, InterpretedFunction)


# False when another test module of this session imported triton first, without TRITON_INTERPRET:
# then triton's own library functions are compile-only too, and the Triton tests below run in a
# fresh interpreter process instead (test_interpreter_subprocess).
INTERPRETING = _interpreting()
NO_TRITON = "triton is not installed; the Triton kernels cannot run here (pip install triton)"
# Triton 3.6's interpreter (the GPU machine's Triton, torch 2.11) passes a kernel's integer
# arguments as one-element arrays, which a runtime loop bound `range(n)` rejects; compiled kernels
# are unaffected. The interpreter tests need Triton >= 3.7 (what `make install` brings).
OLD_INTERPRETER = K.HAS_TRITON and tuple(int(x) for x in __import__("triton").__version__.split(".")[:2]) < (3, 7)
OLD_INTERPRETER_WHY = "Triton < 3.7: its interpreter cannot run runtime loop bounds (compiled kernels can)"


@pytest.fixture
def interpreted():
    """For the tests that launch Triton kernels on CPU tensors (their names contain `triton`)."""
    if not K.HAS_TRITON:
        pytest.skip(NO_TRITON)
    if OLD_INTERPRETER:
        pytest.skip(OLD_INTERPRETER_WHY)
    if not INTERPRETING:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; test_interpreter_subprocess runs this")


def test_interpreter_subprocess():
    if not K.HAS_TRITON:
        pytest.skip(NO_TRITON)
    if INTERPRETING:
        pytest.skip("the Triton kernels ran under the interpreter in this process")
    if OLD_INTERPRETER:
        pytest.skip(OLD_INTERPRETER_WHY)
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "triton and not subprocess"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- tree_attention


def tree_mask(T: int, S: int, base: int, g: torch.Generator) -> torch.Tensor:
    """[1, 1, T, S]: slots < base visible, then a random tree over slots base.. (each row sees itself
    and a random subset of the earlier tree rows), NEG_INF elsewhere -- the shape tree_inputs builds."""
    allowed = torch.zeros(T, S, dtype=torch.bool)
    allowed[:, :base] = True
    tri = torch.rand(T, T, generator=g) < 0.5
    allowed[:, base:base + T] = torch.tril(tri, -1) | torch.eye(T, dtype=torch.bool)
    return torch.where(allowed, 0.0, NEG_INF).view(1, 1, T, S)


def attention_inputs(KV, G, T, S, D, dtype, seed, broadcast_mask=False, strided_q=False):
    g = gen(seed)
    M = G * T
    if strided_q:  # rows interleaved with heads, as a transpose leaves them
        q = torch.randn(1, M, KV, D, generator=g).transpose(1, 2)
    else:
        q = torch.randn(1, KV, M, D, generator=g)
    k = torch.randn(1, KV, S, D, generator=g)
    v = torch.randn(1, KV, S, D, generator=g)
    if broadcast_mask:
        mask = torch.where(torch.rand(1, 1, 1, S, generator=g) < 0.7, 0.0, NEG_INF)
        mask[..., 0] = 0.0
    else:
        mask = tree_mask(T, S, S - T - int(torch.randint(0, S - T + 1, (), generator=g)), g).repeat(1, 1, G, 1)
    return q.to(dtype), k.to(dtype), v.to(dtype), mask.to(dtype), float(D) ** -0.5


TOL = {torch.float32: dict(atol=3e-5, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=3e-3),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
ATTENTION_CASES = [  # KV, G, T, S, D, dtype, broadcast mask, strided q
    (1, 1, 1, 1, 8, torch.float32, False, False),
    (3, 3, 1, 2048, 64, torch.float32, False, False),  # SmolLM2's heads, one decode row
    (3, 3, 5, 301, 64, torch.bfloat16, False, False),
    (2, 4, 5, 37, 24, torch.float16, False, True),
    (1, 2, 33, 130, 80, torch.float32, False, True),  # M = 66: two row blocks; D padded to 128
    (2, 1, 7, 200, 1, torch.float32, True, False),
    (2, 3, 3, 70, 48, torch.bfloat16, True, False),
]


def random_attention_case(seed: int):
    g = gen(1000 + seed)
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=g))  # noqa: E731
    T = r(1, 9)
    return r(1, 3), r(1, 4), T, r(T, 160), r(1, 96), torch.float32, bool(seed % 3 == 0), bool(seed % 2)


@pytest.mark.parametrize("case", ATTENTION_CASES + [random_attention_case(s) for s in range(6)], ids=str)
def test_tree_attention_triton_matches_reference(interpreted, case):
    KV, G, T, S, D, dtype, bmask, strided = case
    q, k, v, mask, scale = attention_inputs(KV, G, T, S, D, dtype, seed=S * D + T, broadcast_mask=bmask,
                                            strided_q=strided)
    got = K.tree_attention_triton(q, k, v, mask, scale)
    want = K.tree_attention_reference(q, k, v, mask, scale)
    assert got.shape == want.shape == (1, KV, G * T, D) and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


BOUNDED_CASES = [  # KV, G, T, S, D, dtype, base_len: keys at base_len + T and after are masked and never read
    (3, 3, 1, 2048, 64, torch.float32, 0),  # the first decode step: one key of 2048
    (3, 3, 4, 2048, 64, torch.float32, 300),  # SmolLM2's heads, 16 splits, most of them empty
    (2, 4, 8, 1000, 32, torch.bfloat16, 517),  # a split boundary inside the tree
    (1, 1, 16, 260, 64, torch.float16, 244),  # the tree ends at the cache's last slot
    (4, 2, 3, 129, 80, torch.float32, 125),
]


@pytest.mark.parametrize("case", BOUNDED_CASES, ids=str)
def test_tree_attention_triton_reads_no_key_past_kv_len(interpreted, case):
    """With kv_len = base_len + T (what the pass passes), keys from kv_len on are NaN here: a kernel
    that read one would return NaN. The reference sees the same cache with zeros there."""
    KV, G, T, S, D, dtype, base = case
    g = gen(S + T + base)
    q = torch.randn(1, KV, G * T, D, generator=g).to(dtype)
    k, v = (torch.randn(1, KV, S, D, generator=g).to(dtype) for _ in range(2))
    mask = tree_mask(T, S, base, g).repeat(1, 1, G, 1).to(dtype)
    k[:, :, base + T:], v[:, :, base + T:] = 0.0, 0.0
    want = K.tree_attention_reference(q, k, v, mask, D ** -0.5)
    k[:, :, base + T:], v[:, :, base + T:] = float("nan"), float("nan")
    got = K.tree_attention_triton(q, k, v, mask, D ** -0.5, torch.tensor(base + T))
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    if base + T < S:  # unbounded, it reads them
        assert K.tree_attention_triton(q, k, v, mask, D ** -0.5).isnan().any()


def test_combine_splits_equals_one_softmax():
    """Splitting the key range and combining the partials is the softmax over the whole range."""
    g = gen(7)
    scores, values = torch.randn(5, 300, generator=g) * 4, torch.randn(300, 8, generator=g)
    parts = []
    for lo in range(0, 300, 64):
        s = scores[:, lo:lo + 64]
        m = s.amax(-1)
        p = torch.exp(s - m[:, None])
        parts.append((m, p.sum(-1), p @ values[lo:lo + 64]))
    parts.append((torch.full((5,), float("-inf")), torch.zeros(5), torch.zeros(5, 8)))  # an empty split
    m, l, acc = (torch.stack(x, dim=1) for x in zip(*parts))
    torch.testing.assert_close(attention_mod.combine_splits(m, l, acc), torch.softmax(scores, -1) @ values, atol=1e-5, rtol=1e-5)


def test_tree_attention_reference_is_block_sdpa():
    """The reference is Block.forward's call: the same bits as SDPA on the folded rows, and the same
    values as plain attention per query head over K/V repeated per group."""
    KV, G, T, S, D = 2, 3, 4, 40, 16
    q, k, v, mask, scale = attention_inputs(KV, G, T, S, D, torch.float32, seed=3)
    out = K.tree_attention_reference(q, k, v, mask, scale)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale))
    # the op on CPU: the C++ kernel where it builds (each row in slot order), the same values
    torch.testing.assert_close(ops.tree_attention(q, k, v, mask, scale), out, atol=1e-6, rtol=1e-5)
    heads = q.reshape(1, KV * G, T, D)
    rep = lambda x: x.repeat_interleave(G, dim=1)  # noqa: E731
    plain = torch.softmax(heads @ rep(k).transpose(-1, -2) * scale + mask[:, :, :T], dim=-1) @ rep(v)
    torch.testing.assert_close(out.reshape(1, KV * G, T, D), plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_attention_triton_rows_alike_at_any_row_count(interpreted, dtype):
    """Row invariance of the CUDA kernel's arithmetic (ROW_BLOCK rows per program, splits by the cache
    length, a fixed-order combine): node i of a 6-node chain verified in one call gets the bits of the
    one-row call at its position (slots below base + i + 1 visible, kv_len = base + i + 1), across split
    boundaries."""
    KV, G, D, S, T = 2, 3, 64, 2048, 6
    g = gen(21)
    k = torch.randn(1, KV, S, D, generator=g).to(dtype)
    v = torch.randn(1, KV, S, D, generator=g).to(dtype)
    for base in (63, 640):  # the chain within one split of 128 keys, and across two
        q = torch.randn(1, KV, G * T, D, generator=g).to(dtype)
        cols = torch.arange(S)
        chain = torch.where(cols.view(1, S) <= (torch.arange(T).view(T, 1) + base), 0.0, NEG_INF)
        many = K.tree_attention_triton(q, k, v, chain.repeat(G, 1).view(1, 1, G * T, S).to(dtype), D ** -0.5,
                                       torch.tensor(base + T)).view(1, KV, G, T, D)
        for i in range(T):
            one = K.tree_attention_triton(q.view(1, KV, G, T, D)[:, :, :, i].contiguous(), k, v,
                                          chain[i:i + 1].repeat(G, 1).view(1, 1, G, S).to(dtype), D ** -0.5,
                                          torch.tensor(base + i + 1))
            assert torch.equal(one, many[:, :, :, i]), (base, i)


def test_combine_kernel_equals_combine_splits(interpreted):
    """The Triton combine of the splits against its torch reference, an empty split included."""
    g = gen(8)
    m = torch.randn(2, 5, 7, generator=g) * 3
    m[:, :, 4] = float("-inf")
    l = torch.rand(2, 5, 7, generator=g) + 0.5
    l[:, :, 4] = 0.0
    acc = torch.randn(2, 5, 7, 16, generator=g)
    acc[:, :, 4] = 0.0
    out = torch.empty(2, 5, 16)
    attention_mod.launch(attention_mod._combine_kernel, (10,), m, l, acc, out, SPLITS=7, BLOCK_S=8, BLOCK_D=16)
    torch.testing.assert_close(out, attention_mod.combine_splits(m, l, acc), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.int8])
def test_rows_linear_triton_rows_alike(interpreted, wdtype):
    """The CUDA body of rows_linear: x @ w.T, and each row's bits the same at every row count (a width
    with a partial last block of K and of N)."""
    from specc.kernels.rows_linear import rows_linear_triton

    g = gen(31)
    K_, N = 200, 70
    w = torch.randn(N, K_, generator=g)
    x = torch.randn(1, 9, K_, generator=g)
    if wdtype == torch.int8:
        w = (w * 40).round().clamp(-127, 127).to(torch.int8)
    elif wdtype == torch.bfloat16:
        w, x = w.to(wdtype), x.to(wdtype)
    many = rows_linear_triton(x, w)
    ref = x.float() @ w.float().T
    tol = 1e-2 if x.dtype == torch.bfloat16 else 1e-5  # bf16: the output's own rounding
    torch.testing.assert_close(many.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    for r in range(9):
        assert torch.equal(rows_linear_triton(x[:, r: r + 1].contiguous(), w)[0, 0], many[0, r]), r


def test_tree_attention_triton_launcher_refuses_bad_shapes(interpreted):
    q, k, v, mask, scale = attention_inputs(2, 2, 3, 20, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="kv heads"):
        K.tree_attention_triton(q[:, :1], k, v, mask, scale)
    with pytest.raises(ValueError, match="broadcast"):
        K.tree_attention_triton(q, k, v, mask[..., :5], scale)
    with pytest.raises(ValueError, match="float mask"):
        K.tree_attention_triton(q, k, v, mask == 0, scale)


# --------------------------------------------------------------------------- tree acceptance


def random_tree(seed: int, nodes: int, extra_width: int = 0):
    """Random parents (parents[i] < i) and the rank-ordered child table, -1 padded (maybe wider)."""
    g = gen(seed)
    parents = [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, nodes)]
    kids = [[c for c in range(nodes) if parents[c] == i] for i in range(nodes)]
    W = max(1, max(len(k) for k in kids)) + extra_width
    table = torch.full((nodes, W), -1, dtype=torch.int64)
    for i, k in enumerate(kids):
        table[i, :len(k)] = torch.tensor(k, dtype=torch.int64)
    return tuple(parents), table


def named_tree(name):
    t = {"topk2x2": topk(2, 2), "topk3x2": topk(3, 2), "topk2x3": topk(2, 3), "irregular": IRREGULAR,
         "chain3": chain(3), "chain0": chain(0)}[name]
    return t.parents, t.child_table()


TREES = ["topk2x2", "topk3x2", "irregular", "chain3", "chain0", 11, 12, 13]


def tree(name):
    return named_tree(name) if isinstance(name, str) else random_tree(name, 6 + name % 7, extra_width=name % 2)


def draft_tokens(parents, table, scores: torch.Tensor, seed: int, follow: float = 0.7) -> torch.Tensor:
    """Random tokens, where with probability `follow` one child of each node carries the node's
    highest-scoring token (so paths get accepted) and sometimes two siblings share a token."""
    g = gen(seed)
    T, V = scores.shape
    tokens = torch.randint(0, V, (T,), generator=g)
    best = scores.argmax(-1)
    for i in range(T):
        kids = [c for c in table[i].tolist() if c >= 0]
        if kids and float(torch.rand((), generator=g)) < follow:
            tokens[kids[int(torch.randint(0, len(kids), (), generator=g))]] = best[i]
        if len(kids) > 1 and float(torch.rand((), generator=g)) < 0.2:
            tokens[kids[1]] = tokens[kids[0]]
    return tokens


def as_tuple(res):
    n, path, out = res
    return int(n), path.tolist(), out.tolist()


def test_row_argmax_and_sum_triton_over_splits(interpreted):
    """The vocabulary passes split each row (tree_accept.vocab_splits): ties across splits go to the first
    index, an all -inf row gives 0, NaN is skipped; the sums of the splits equal the row sums."""
    from specc.kernels.tree_accept import row_argmax_triton, row_sum_triton, vocab_splits

    V, block = 100, 16
    assert vocab_splits(V, block) == (16, 7)
    x = torch.randn(5, V, generator=gen(3))
    x[0, 20] = x[0, 90] = 50.0  # a tie in two splits: the first wins
    x[1] = float("-inf")
    x[2, 3], x[2, 70] = float("nan"), 40.0
    x[3, 99] = 60.0  # in the last, partial split
    got = row_argmax_triton(x, block_v=block)
    assert got.tolist() == [20, 0, 70, 99, int(x[4].argmax())]
    for dtype in (torch.float32, torch.bfloat16):
        y = torch.randn(3, V, generator=gen(4)).to(dtype)
        assert torch.equal(row_argmax_triton(y, block_v=block), y.argmax(-1))
    p = torch.rand(4, V, generator=gen(5))
    torch.testing.assert_close(row_sum_triton(p, block_v=block), p.sum(-1), atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("name", TREES)
@pytest.mark.parametrize("V,dtype", [(37, torch.float32), (2500, torch.float32), (300, torch.bfloat16)])
def test_tree_accept_greedy_triton_matches_reference(interpreted, name, V, dtype):
    parents, table = tree(name)
    depth = tree_depth(parents)
    T = len(parents)
    seen = set()
    for seed in range(3):
        logits = torch.randn(T, V, generator=gen(seed)).to(dtype)  # continuous: no ties in fp32
        tokens = draft_tokens(parents, table, logits.float(), seed)
        ref = as_tuple(K.accept_greedy_reference(logits, tokens, table, depth))
        assert ref == as_tuple(accept_greedy(logits, tokens, parents, table))
        assert ref == reference_accept_greedy(logits, tokens, parents, table)
        # A small block makes several blocks of a small vocabulary (the interpreter is slow on many).
        for block in (1024, 16) if V < 100 else (1024,):
            assert as_tuple(K.accept_greedy_triton(logits, tokens, table, depth, block_v=block)) == ref
        seen.add(ref[0])
    if depth > 0:
        assert max(seen) > 0  # some draft was accepted


def sample_case(name, V, seed):
    parents, table = tree(name)
    T = len(parents)
    g = gen(100 + seed)
    logits = 3 * torch.randn(T, V, generator=g)  # peaked: drafts of the top token get accepted
    temperature = (0.7, 1.0, 1.5)[seed % 3]
    top_p = (1.0, 0.9, 0.5)[seed % 3]
    probs = sampling_probs(logits, torch.tensor(temperature), torch.tensor(top_p))
    tokens = draft_tokens(parents, table, logits, seed, follow=0.8)
    u = torch.rand(T + 1, generator=g)
    if seed % 2:
        u[:T] *= 0.2
    return parents, table, logits, probs, tokens, u, temperature, top_p


@pytest.mark.parametrize("name", TREES)
@pytest.mark.parametrize("V", [37, 2500])
def test_tree_accept_sample_triton_matches_reference(interpreted, name, V):
    seen = set()
    for seed in range(4):
        parents, table, logits, probs, tokens, u, temp, top_p = sample_case(name, V, seed)
        depth = tree_depth(parents)
        ref = as_tuple(K.accept_sample_reference(probs, tokens, table, depth, u))
        # The reference is accept_sample's rule on the processed probabilities, bit for bit.
        assert ref == as_tuple(accept_sample(logits, tokens, parents, table, torch.tensor(temp),
                                             torch.tensor(top_p), u))
        for block in (1024, 16) if V < 100 else (1024,):
            assert as_tuple(K.accept_sample_triton(probs, tokens, table, depth, u, block_v=block)) == ref
        seen.add(ref[0])
    if tree_depth(tree(name)[0]) > 0:
        assert len(seen) > 1  # short and long acceptances


def test_tree_accept_sample_triton_rejected_duplicates_and_residual(interpreted):
    """Two siblings with one token: after the first is rejected its probability is 0, so the second is
    rejected too, and the residual draw never returns it; the guard keeps a draw at u ~ 1 on mass."""
    parents, table = named_tree("topk2x3")
    T, V = len(parents), 50
    probs = torch.zeros(T, V)
    probs[:, :10] = torch.softmax(torch.randn(T, 10, generator=gen(5)), -1)  # mass on tokens 0..9 only
    kids = table[0].tolist()
    tokens = torch.zeros(T, dtype=torch.int64)
    tokens[kids[0]] = tokens[kids[1]] = int(probs[0].argmax())
    tokens[kids[2]] = 49  # probability 0: always rejected
    for u_last in (0.0, 0.3, 0.999999):
        u = torch.full((T + 1,), 0.9999)
        u[T] = u_last
        ref = as_tuple(K.accept_sample_reference(probs, tokens, table, 2, u))
        assert ref[0] == 0 and ref[2][0] not in (int(tokens[kids[0]]), 49) and ref[2][0] < 10
        assert as_tuple(K.accept_sample_triton(probs, tokens, table, 2, u, block_v=16)) == ref


# --------------------------------------------------------------------------- compact_kv_


def padded_paths(parents):
    """Every accepted path the walk can return, padded to depth + 1 by repeating its last node."""
    depth = tree_depth(parents)
    out = []
    for node in range(len(parents)):
        path = []
        while node >= 0:
            path.append(node)
            node = parents[node]
        path = path[::-1]
        out.append(path + [path[-1]] * (depth + 1 - len(path)))
    return out


def sequential_compact(cache, src, dst):
    """The op's definition, one slot after the other."""
    for i, s in enumerate(src.tolist()):
        cache[:, :, int(dst) + i] = cache[:, :, s]


@pytest.mark.parametrize("name", ["topk2x2", "irregular", "chain3", 12])
@pytest.mark.parametrize("KV,D", [(1, 1), (3, 5), (2, 64), (1, 200)])
def test_compact_kv_triton_matches_reference(interpreted, name, KV, D):
    parents, _ = tree(name)
    T = len(parents)
    for base in (0, 7):
        S = base + T + 3
        cache = torch.randn(1, KV, S, D, generator=gen(base + D))
        for path in padded_paths(parents):
            src = base + torch.tensor(path)
            dst = torch.tensor(base)
            want = cache.clone()
            sequential_compact(want, src, dst)
            ref = cache.clone()
            K.compact_kv_reference(ref, src, dst)
            assert torch.equal(ref, want)
            got = cache.clone()
            K.compact_kv_triton(got, src, dst, block_d=64)
            assert torch.equal(got, want), path


# --------------------------------------------------------------------------- custom ops


def op_inputs():
    q, k, v, mask, scale = attention_inputs(2, 3, 4, 40, 16, torch.float32, seed=1)
    parents, table, logits, probs, tokens, u, _, _ = sample_case("irregular", 64, 1)
    depth = tree_depth(parents)
    cache = torch.randn(1, 2, 20, 8, generator=gen(2))
    src = 4 + torch.tensor(padded_paths(parents)[-1])
    return dict(attention=(q, k, v, mask, scale), greedy=(logits, tokens, table, depth),
                sample=(probs, tokens, table, depth, u), compact=(cache, src, torch.tensor(4)))


def test_custom_ops_on_cpu_run_the_references():
    """On CPU each op runs its reference, except attention where specc's C++ kernel builds: it runs that
    kernel (rows summed in slot order, tree_attention.rows_kernel), whose values are the reference's."""
    from specc.kernels.tree_attention import rows_kernel

    a = op_inputs()
    q, k, v, mask, scale = a["attention"]
    got = ops.tree_attention(q, k, v, mask, scale)
    if rows_kernel(q, mask):
        assert torch.equal(got, torch.ops.specc_cpu.rows_attention(q, k, v, mask, scale))
        torch.testing.assert_close(got, K.tree_attention_reference(q, k, v, mask, scale), atol=1e-6, rtol=1e-5)
    else:
        assert torch.equal(got, K.tree_attention_reference(q, k, v, mask, scale))
    assert as_tuple(ops.tree_accept_greedy(*a["greedy"])) == as_tuple(K.accept_greedy_reference(*a["greedy"]))
    assert as_tuple(ops.tree_accept_sample(*a["sample"])) == as_tuple(K.accept_sample_reference(*a["sample"]))
    cache, src, dst = a["compact"]
    want = cache.clone()
    sequential_compact(want, src, dst)
    assert ops.compact_kv_(cache, src, dst) is None
    assert torch.equal(cache, want)  # in place


@pytest.mark.parametrize("name,op", [("attention", "tree_attention"), ("greedy", "tree_accept_greedy"),
                                     ("sample", "tree_accept_sample"), ("compact", "compact_kv_")])
def test_custom_ops_opcheck(name, op):
    """Schema (including the declared mutation of compact_kv_'s cache) and fake implementation."""
    args = op_inputs()[name]
    torch.library.opcheck(getattr(ops, op).default, args, test_utils=("test_schema", "test_faketensor"))


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v, mask = torch.empty(1, 3, 15, 64), torch.empty(1, 3, 2048, 64), torch.empty(1, 3, 2048, 64), \
            torch.empty(1, 1, 15, 2048)
        out = ops.tree_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.125)
        assert out.shape == (1, 3, 15, 64) and out.dtype == torch.bfloat16
        table = torch.empty(9, 3, dtype=torch.int64)
        for res in (ops.tree_accept_greedy(torch.empty(9, 49152), torch.empty(9, dtype=torch.int64), table, 3),
                    ops.tree_accept_sample(torch.empty(9, 49152), torch.empty(9, dtype=torch.int64), table, 3,
                                           torch.empty(10))):
            assert [tuple(t.shape) for t in res] == [(), (4,), (4,)] and all(t.dtype == torch.int64 for t in res)
        assert ops.compact_kv_(torch.empty(1, 3, 64, 64), torch.empty(4, dtype=torch.int64),
                               torch.empty((), dtype=torch.int64)) is None
        with pytest.raises(ValueError, match="broadcast"):
            ops.tree_attention(q, k, v, torch.empty(1, 1, 15, 7), 0.125)


class CallOps(nn.Module):
    """Each op once; the cache is a buffer, as in the captured models."""

    def __init__(self, cache):
        super().__init__()
        self.register_buffer("cache", cache.clone())

    def forward(self, q, k, v, mask, logits, probs, tokens, table, u, src, dst):
        att = ops.tree_attention(q, k, v, mask, 0.25)
        n, path, out = ops.tree_accept_greedy(logits, tokens, table, 3)
        n2, path2, out2 = ops.tree_accept_sample(probs, tokens, table, 3, u)
        ops.compact_kv_(self.cache, src, dst)
        return att * 2, n + n2, path, out2


def test_export_keeps_the_ops_and_the_cache_mutation():
    a = op_inputs()
    q, k, v, mask, _ = a["attention"]
    logits, tokens, table, depth = a["greedy"]
    probs, _, _, _, u = a["sample"]
    cache, src, dst = a["compact"]
    assert depth == 3
    args = (q, k, v, mask, logits, probs, tokens, table, u, src, dst)
    ep = torch.export.export(CallOps(cache), args, strict=False)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {"specc.tree_attention.default", "specc.tree_accept_greedy.default", "specc.tree_accept_sample.default",
            "specc.compact_kv_.default"} <= targets
    # What AOTInductor lowers: the functional form, the cache write a buffer mutation of the program.
    dec = ep.run_decompositions()
    mutated = [s.target for s in dec.graph_signature.output_specs if s.kind.name == "BUFFER_MUTATION"]
    assert mutated == ["cache"]
    assert any("compact_kv_" in str(n.args) + str(n.kwargs)
               for n in dec.graph.nodes if "auto_functionalized" in str(n.target))
    mod = CallOps(cache)
    want = mod(*args)
    want_cache = mod.cache.clone()
    for program in (ep, dec):
        m = program.module()
        m.cache.copy_(cache)
        got = m(*args)
        for x, y in zip(got, want):
            assert torch.equal(x, y)
        assert torch.equal(m.cache, want_cache)  # the exported program still writes its buffer


# --------------------------------------------------------------------------- passes


S = 40


def count(ep, pred) -> int:
    return sum(1 for n in ep.graph.nodes if n.op == "call_function" and pred(n.target))


@pytest.mark.parametrize("arch,heads,kv", [("llama", 4, 2), ("qwen3", 4, 4)])
@torch.no_grad()
def test_tree_attention_pass_replaces_sdpa_and_keeps_values(arch, heads, kv):
    model = tiny_model(arch, seed=4, heads=heads, kv_heads=kv)
    T = 5
    args = (torch.randint(0, 64, (1, T), generator=gen(0)), (torch.arange(T) + 3).view(1, T), torch.arange(T) + 3,
            causal_mask(T, 3, S))
    before = capture(TargetModule(model, S), args)
    n_layers = model.config.num_hidden_layers
    assert count(before, lambda t: t is SDPA) == n_layers  # what capture leaves in the graph
    after = tree_attention(capture(TargetModule(model, S), args))
    assert count(after, lambda t: t is SDPA) == 0
    assert count(after, lambda t: t is ops.tree_attention.default) == n_layers
    assert after.graph_signature.user_inputs == before.graph_signature.user_inputs
    # Each op reads keys below 1 + the last slot the call writes (here 3 + T), never the whole cache;
    # one kv_len serves every layer.
    (kv_len,) = {n.args[5] for n in after.graph.nodes if n.op == "call_function" and n.target is ops.tree_attention.default}
    assert kv_len.target is torch.ops.aten.add.Tensor and kv_len.args[1] == 1
    assert kv_len.args[0].target is torch.ops.aten.amax.default and kv_len.args[0].args[0].name == "cache_pos"
    a, b = before.module(), after.module()
    for call in range(2):  # twice: the second call attends over the first call's cache writes
        x = tuple(t.clone() for t in args)  # the op on CPU: SDPA's values (the C++ kernel's sums, in slot order)
        torch.testing.assert_close(b(*x)[0], a(*x)[0], atol=1e-5, rtol=1e-5, msg=str(call))
    # A retrace (what later passes do) keeps the op.
    again = capture(after.module(), args)
    assert count(again, lambda t: t is ops.tree_attention.default) == n_layers


@pytest.mark.parametrize("T,op,kernel", [(3, True, False), (3, True, True), (8, False, True)])
def test_attend_prefix_slices_the_cache_and_keeps_values(tmp_path, monkeypatch, T, op, kernel):
    """The CPU lowering pass: each attention reads keys [0, n) only, n = kv_len in whole KEY_BLOCKs (K, V
    and mask sliced to one unbacked length for all layers), with the values of the whole-cache op, in
    eager and compiled by AOTInductor, while the slots past kv_len hold garbage (the mask hides them).
    Plain SDPA over a just-written cache (prefill's) is sliced the same way. A step's ops become one SDPA
    per tree node; those that the C++ kernel serves (`kernel`, where it builds) stay ops: the kernel reads
    keys below kv_len itself."""
    import specc.passes.attend_prefix as ap
    from specc.kernels.cpu_kernels import load_cpu_kernel
    from specc.passes.attend_prefix import attend_prefix

    if kernel and not (op and load_cpu_kernel()):
        kernel = False
        if op:
            pytest.skip("the C++ kernels are not built here")
    if not kernel:
        monkeypatch.setattr(ap, "rows_kernel_here", lambda ep: False)
    model = tiny_model("llama", seed=4, heads=4, kv_heads=2)
    n_layers = model.config.num_hidden_layers
    args = (torch.randint(0, 64, (1, T), generator=gen(0)), (torch.arange(T) + 5).view(1, T), torch.arange(T) + 5,
            causal_mask(T, 5, S))
    ref = tree_attention(capture(TargetModule(model, S), args))
    captured = capture(TargetModule(model, S), args)
    ep = attend_prefix(tree_attention(captured) if op else captured)
    assert count(ep, lambda t: t is ops.tree_attention.default) == (n_layers if kernel else 0)
    attn = [n for n in ep.graph.nodes if n.op == "call_function" and n.target is SDPA]
    # a step's op (`op`): one SDPA per tree node (the plain step's call for its grouped rows); prefill's: one
    assert len(attn) == (0 if kernel else n_layers * (T if op else 1))
    if not kernel:
        lengths = {n.args[1].args[3] for n in attn}  # slice(k, 2, None, n): one n for every layer
        assert len(lengths) == 1 and next(iter(lengths)).target is torch.ops.aten.item.default
        assert not isinstance(attn[0].args[1].meta["val"].shape[2], int)  # the key length is data-dependent
    assert ep.graph_signature.user_inputs == ref.graph_signature.user_inputs
    garbage = {name: torch.randn(ref.state_dict[name].shape, generator=gen(1)) * 50
               for name in ref.state_dict if name.endswith("_cache")}
    want, got = ref.module(), ep.module()
    for m in (want, got):
        for key, value in garbage.items():
            m.get_buffer(key).copy_(value)
    # the compiled package keeps its own (zeroed) caches: compare it with a fresh reference
    pkg = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "prefix.pt2"))
    pairs = [(want, got), (ref.module(), torch._inductor.aoti_load_package(pkg))]
    for start in (5, 8, 20):  # later calls attend over the earlier ones' writes
        x = (args[0], (torch.arange(T) + start).view(1, T), torch.arange(T) + start, causal_mask(T, start, S))
        for i, (a, b) in enumerate(pairs):
            torch.testing.assert_close(b(*x)[0], a(*x)[0], atol=1e-5, rtol=1e-5, msg=f"pair {i} at {start}")


def test_graph_plans_run_the_kernel_passes():
    tr = topk(2, 2)
    plans = {p.name: p for p in graph_plans(get_kind("ngram"), tr, 8, S)}
    for mode in ("greedy", "sample", "top_p"):  # eager: matvec gives each row one product (rows_linear)
        assert plans[f"step_{mode}"].passes == ["matvec", "tree_attention", "tree_inputs", "accept", "compact_kv"]
        assert plans[f"plain_{mode}"].passes == ["matvec", "tree_attention", "tree_inputs", "accept", "compact_kv"]
        assert "tree_attention" not in plans[f"prefill_{mode}"].passes
    ind = {p.name: p for p in graph_plans(get_kind("ngram"), tr, 8, S, backend="inductor")}
    assert ind["step_greedy"].passes == ["matvec", "tree_attention", "tree_inputs", "accept", "compact_kv"]
    tm = TargetModule(tiny_model("llama", seed=2), S)
    built = {}
    n_layers = len(tm.blocks)
    for mode, accept_op in (("greedy", "specc.tree_accept_greedy.default"),
                            ("sample", "specc.tree_accept_sample.default"),
                            ("top_p", "specc.tree_accept_sample.default")):
        ep = build_program(plans[f"step_{mode}"], {"target": tm}, built, tr)
        assert count(ep, lambda t: t is ops.tree_attention.default) == n_layers
        assert count(ep, lambda t: t is ops.compact_kv_.default) == 2 * n_layers  # one per k and v cache
        assert count(ep, lambda t: t is SDPA) == 0
        # One graph per mode: no run-time branch (torch.cond), only this mode's acceptance op, and
        # the sort of top-p only where top-p is on.
        modules = [m for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
        assert len(modules) == 1
        called = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
        assert not any("cond" in c for c in called), called
        assert {c for c in called if c.startswith("specc.tree_accept")} == {accept_op}
        assert any(c.startswith("aten.sort") for c in called) == (mode == "top_p")


def test_aoti_inlines_the_ops(tmp_path):
    """The ops are triton_ops: AOTInductor traces into their bodies, so the compiled CPU graph runs
    native code for them (no call back into Python through the proxy executor) and gives the
    eager values."""
    import zipfile

    a = op_inputs()
    q, k, v, mask, _ = a["attention"]
    logits, tokens, table, _ = a["greedy"]
    probs, _, _, _, u = a["sample"]
    cache, src, dst = a["compact"]
    args = (q, k, v, mask, logits, probs, tokens, table, u, src, dst)
    ep = torch.export.export(CallOps(cache), args, strict=False)
    pkg = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "ops.pt2"))
    files = zipfile.ZipFile(pkg)
    code = "".join(files.read(n).decode(errors="ignore") for n in files.namelist() if n.endswith(".cpp"))
    assert "specc::" not in code
    # What goes through the proxy executor is C++ only: attention's CPU body, specc's C++ kernel where it
    # builds (registered in C++, no Python per call); nothing else.
    externs = "".join(files.read(n).decode(errors="ignore") for n in files.namelist() if n.endswith(".json"))
    from specc.kernels.tree_attention import rows_kernel

    calls = code.count("proxy_executor_call_function")
    assert calls == (1 if rows_kernel(q, mask) else 0)
    if calls:
        assert "specc_cpu::rows_attention" in externs
    want = CallOps(cache)(*args)
    got = torch._inductor.aoti_load_package(pkg)(*args)
    assert torch.allclose(got[0], want[0], atol=1e-5)
    for x, y in zip(got[1:], want[1:]):
        assert torch.equal(x, y)


# -- gguf_linear: products with GGUF block-quantized weights -------------------------------------

GGUF_32_FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]  # the formats of 32-value blocks (gguf_cpu.cpp)

def gguf_weight(fmt: str, N: int = 40, K: int = 96, seed: int = 0):
    """A random weight quantized by gguf-py (what llama.cpp's tools write), as the file's bytes and
    as gguf-py dequantises them."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[fmt]
    w = torch.randn(N, K, generator=gen(seed)).numpy() * np.linspace(0.01, 3, N, dtype=np.float32)[:, None]
    raw = gguf.quants.quantize(w, qtype)
    return torch.from_numpy(np.array(raw)), torch.from_numpy(gguf.quants.dequantize(raw, qtype)).float()


@pytest.mark.parametrize("fmt", GGUF_32_FORMATS)
def test_gguf_blocks_decode_as_gguf_py_and_the_product_matches(fmt):
    from specc.kernels.gguf_linear import dequantize, gguf_linear_reference, split_blocks

    raw, want = gguf_weight(fmt)
    qs, d, m = split_blocks(raw, fmt)
    assert torch.equal(dequantize(qs, d, m, fmt), want)  # bit for bit: the model transformers loads
    assert d.dtype == torch.float16 and (m.numel() > 0) == (fmt in ("Q4_1", "Q5_1"))
    for rows in (1, 3, 20):  # 20: past MAX_ROWS, the dequantise-then-GEMM path
        x = torch.randn(1, rows, want.shape[1], generator=gen(rows))
        torch.testing.assert_close(gguf_linear_reference(x, qs, d, m, fmt), x @ want.T, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(ops.gguf_linear(x, qs, d, m, fmt), x @ want.T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("fmt", GGUF_32_FORMATS)
def test_gguf_linear_triton_matches_reference(interpreted, fmt):
    from specc.kernels.gguf_linear import gguf_linear_reference, gguf_linear_triton, split_blocks

    raw, _ = gguf_weight(fmt, N=70, K=64, seed=3)  # 70: a partial block of outputs
    qs, d, m = split_blocks(raw, fmt)
    x = torch.randn(3, 64, generator=gen(4))
    torch.testing.assert_close(gguf_linear_triton(x, qs, d, m, fmt, block_n=32), gguf_linear_reference(x, qs, d, m, fmt),
                               atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("fmt", GGUF_32_FORMATS)
def test_gguf_cpu_product_matches_the_weights(fmt):
    """gguf_cpu.cpp's product (built here: this machine has Inductor's compiler) against the float64
    product with gguf-py's weights, for 1..16 rows (groups of 4 and the rest), odd output counts and 10
    blocks a row (the AVX2 path converts the scales 8 blocks at a time); a weight that does not fit x is refused."""
    from specc.kernels.cpu_kernels import load_cpu_kernel, load_error
    from specc.kernels.gguf_linear import FORMATS, split_blocks

    assert load_cpu_kernel(), load_error()
    raw, want = gguf_weight(fmt, N=37, K=320, seed=7)
    qs, d, m = split_blocks(raw, fmt)
    code = FORMATS.index(fmt)
    x16 = torch.randn(1, 16, 320, generator=gen(16))
    all16 = torch.ops.specc_cpu.gguf_matvec(x16, qs, d, m, code)
    for rows in (1, 2, 3, 4, 5, 7, 16):
        x = torch.randn(1, rows, 320, generator=gen(rows))
        out = torch.ops.specc_cpu.gguf_matvec(x, qs, d, m, code)
        assert out.shape == (1, rows, 37)
        torch.testing.assert_close(out.double(), x.double() @ want.double().T, atol=2e-5, rtol=1e-6)
        assert torch.equal(ops.gguf_linear(x, qs, d, m, fmt), out)  # the op's CPU body calls it
        # a row's bits do not depend on the rows beside it (a verify row = the plain step's)
        assert torch.equal(torch.ops.specc_cpu.gguf_matvec(x16[:, :rows].contiguous(), qs, d, m, code), all16[:, :rows])
    with pytest.raises(RuntimeError, match="inputs"):
        torch.ops.specc_cpu.gguf_matvec(torch.randn(2, 64), qs, d, m, code)


@pytest.mark.parametrize("k", [16, 96, 577])  # 577: a masked tail of 1
def test_dense_cpu_product_matches_float64(k, monkeypatch):
    """dense_cpu.cpp's product against float64 for 1..17 rows (past a tile of 8) and odd output
    counts, over float32 and int8 weights; each row's result is the same bit for bit alone and among
    others; rows_linear's CPU body calls it (float32: at 1 row and at many rows on AVX-512, forced on
    here so that every machine checks it; without AVX-512 never); bad shapes are refused."""
    from specc.kernels import rows_linear
    from specc.kernels.cpu_kernels import load_cpu_kernel, load_error
    from specc.kernels.rows_linear import kernel_rows, many_rows

    assert load_cpu_kernel(), load_error()
    monkeypatch.setattr(rows_linear, "FLOAT32_KERNEL", False)
    assert not any(kernel_rows(r, k, torch.float32) for r in range(1, 17)) and kernel_rows(1, k, torch.int8)
    monkeypatch.setattr(rows_linear, "FLOAT32_KERNEL", None)  # read from the CPU
    assert rows_linear.float32_kernel() == torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    monkeypatch.setattr(rows_linear, "FLOAT32_KERNEL", True)
    assert not many_rows(17, 96) and many_rows(7, 577) and not many_rows(6, 577)  # the budget, 14 KB
    monkeypatch.setattr(rows_linear, "REDUCTION_ROWS_BYTES", 0)  # every row count "many": the op's body at each
    w = torch.randn(67, k, generator=gen(k))
    for rows in (1, 2, 3, 8, 9, 17):
        x = torch.randn(1, rows, k, generator=gen(rows))
        out = torch.ops.specc_cpu.dense_matvec(x, w)
        assert out.shape == (1, rows, 67)
        torch.testing.assert_close(out.double(), x.double() @ w.double().T, atol=1e-4, rtol=1e-5)
        for r in {0, rows - 1}:
            assert torch.equal(torch.ops.specc_cpu.dense_matvec(x[:, r:r + 1], w), out[:, r:r + 1])
        assert kernel_rows(rows, k, torch.float32) and torch.equal(ops.rows_linear(x, w), out)
        torch.testing.assert_close(K.rows_linear_reference(x, w), out, atol=1e-4, rtol=1e-5)
    w8 = torch.randint(-127, 128, (67, k), generator=gen(k + 1), dtype=torch.int8)
    for rows in (1, 2, 5, 9):
        x = torch.randn(1, rows, k, generator=gen(rows))
        out = torch.ops.specc_cpu.dense_matvec(x, w8)
        torch.testing.assert_close(out.double(), x.double() @ w8.double().T, atol=1e-3, rtol=1e-5)
        assert torch.equal(torch.ops.specc_cpu.dense_matvec(x[:, :1], w8), out[:, :1])
        torch.testing.assert_close(ops.rows_linear(x, w8), out, atol=1e-3, rtol=1e-5)
        torch.testing.assert_close(K.rows_linear_reference(x, w8), out, atol=1e-3, rtol=1e-5)
    with pytest.raises(RuntimeError, match="inputs"):
        torch.ops.specc_cpu.dense_matvec(torch.randn(2, k + 1), w)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.specc_cpu.dense_matvec(torch.randn(2, k, dtype=torch.float64), w)


@pytest.mark.parametrize("level,needs,flags", [
    ("AVX2", "avx512f", "-mno-avx512f"),                               # an AVX-512 machine builds the AVX2 path
    ("portable", "avx2", "-mno-avx512f -mno-avx -mno-avx2 -mno-fma"),  # every x86 machine the portable loops
])
def test_cpu_products_other_instruction_sets_subprocess(level, needs, flags):
    """The products above ran the code this machine's build picks; the same tests in a process whose
    build leaves the wider instruction sets out run the paths of lesser CPUs (AVX2's 8-lane tiles, or
    the portable loops), where this machine can run them."""
    if os.environ.get("SPECC_CPU_KERNEL_FLAGS"):
        pytest.skip("this process already builds with extra flags")
    if needs not in Path("/proc/cpuinfo").read_text(errors="ignore").split():
        pytest.skip(f"no {needs} here: the {level} path is what the tests above ran, or cannot be told apart")
    env = dict(os.environ, SPECC_CPU_KERNEL_FLAGS=flags, OMP_NUM_THREADS="2")
    attention = Path(__file__).with_name("test_row_invariance.py")  # the attention of the decode graphs
    proc = subprocess.run([sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                           str(attention), "-k", "gguf_cpu_product or dense_cpu_product or rows_attention_sums"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"{len(GGUF_32_FORMATS) + 3 + 3} passed" in proc.stdout


@pytest.mark.parametrize("cpu_kernel", [True, False])
def test_gguf_linear_compiles_to_native_cpu_code(tmp_path, monkeypatch, cpu_kernel):
    """Exported as one node; AOTInductor compiles its body to the same values: the C++ product through
    the proxy executor, or without it the reference as native code (no call out of the graph)."""
    import zipfile

    from specc.kernels import cpu_kernels
    from specc.kernels.gguf_linear import split_blocks

    if not cpu_kernel:
        monkeypatch.setitem(cpu_kernels._state, "loaded", False)

    raw, want = gguf_weight("Q4_1", N=48, K=64, seed=5)
    qs, d, m = split_blocks(raw, "Q4_1")

    class Product(nn.Module):
        def forward(self, x, qs, d, m):
            return ops.gguf_linear(x, qs, d, m, "Q4_1")

    x = torch.randn(1, 2, 64, generator=gen(6))
    ep = torch.export.export(Product(), (x, qs, d, m), strict=False)
    assert count(ep, lambda t: t is ops.gguf_linear.default) == 1
    pkg = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "gguf.pt2"))
    code = "".join(zipfile.ZipFile(pkg).read(n).decode(errors="ignore")
                   for n in zipfile.ZipFile(pkg).namelist() if n.endswith(".cpp"))
    assert ("proxy_executor_call_function" in code and "gguf_matvec" in code) == cpu_kernel
    torch.testing.assert_close(torch._inductor.aoti_load_package(pkg)(x, qs, d, m), x @ want.T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("cpu_kernel,rows,inputs", [(True, 1, 40), (True, 3, 40), (True, 6, 40), (False, 3, 1300),
                                                     (True, 3, 1300), (True, 2, 1300)])
def test_rows_linear_compiles_to_native_cpu_code(tmp_path, monkeypatch, cpu_kernel, rows, inputs):
    """The matvec pass's op for a parameter weight: AOTInductor compiles the C++ product through the
    proxy executor at 1 row and at many rows (on AVX-512; forced here so that every machine compiles
    it): more input rows than the reduction keeps in cache, so 3 rows of 1300 inputs (15.2 KB) but not
    2 (10.2 KB) nor 6 of 40. Else (or without it, even at many rows) the reference's reduction as
    native code."""
    import zipfile

    from specc.kernels import cpu_kernels, rows_linear
    from specc.kernels.rows_linear import REDUCTION_ROWS_BYTES
    from specc.passes.matvec import matvec

    assert 2 * 1300 * 4 <= REDUCTION_ROWS_BYTES < 3 * 1300 * 4  # the cases above straddle the budget
    monkeypatch.setattr(rows_linear, "FLOAT32_KERNEL", True)
    if not cpu_kernel:
        monkeypatch.setitem(cpu_kernels._state, "loaded", False)
    lin = nn.Linear(inputs, 24).requires_grad_(False)
    x = torch.randn(1, rows, inputs, generator=gen(8))
    ep = matvec(capture(lin, (x,)))
    assert count(ep, lambda t: t is ops.rows_linear.default) == 1
    pkg = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "rows.pt2"))
    code = "".join(zipfile.ZipFile(pkg).read(n).decode(errors="ignore")
                   for n in zipfile.ZipFile(pkg).namelist() if n.endswith(".cpp"))
    native = cpu_kernel and (rows == 1 or (rows == 3 and inputs == 1300))
    assert ("proxy_executor_call_function" in code and "dense_matvec" in code) == native
    torch.testing.assert_close(torch._inductor.aoti_load_package(pkg)(x), lin(x), atol=1e-5, rtol=1e-5)
