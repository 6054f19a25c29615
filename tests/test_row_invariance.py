"""Row-invariant numerics: each row of a T-node verify gets the bits the 1-row plain step gets.

Greedy speculation reproduces plain decoding token for token only if the verify computes every row
exactly as the plain step does; a last-bit difference flips an argmax on a near tie (common in bf16).
Checked here piece by piece (products, attention) and whole (the engine's verify programs, eager and
compiled, in float32, bfloat16 and float16), with negative controls that show the checks can fail."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specc.kernels.cpu_kernels import load_cpu_kernel
from specc.kernels.rows_linear import rows_linear, rows_linear_reference, same_order
from specc.passes.attend_prefix import KEY_BLOCK, keys_read
from specc.pipeline import capture
from specc.row_check import compare_rows, diverging_node, first_divergence, random_text, verify_program
from specc.target_module import TargetModule, module_state
from specc.tree import chain, topk
from conftest import cli_env
from tiny import tiny_model

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.skipif(not load_cpu_kernel() or not same_order(),
                    reason="the C++ product is not built here, or sums in other lanes than Inductor's vector")
@pytest.mark.parametrize("K", [576, 100, 37])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.int8])
def test_cpp_product_sums_in_inductors_order(K, wdtype):
    """The two bodies of rows_linear on CPU float32, the C++ product and Inductor's compiled reduction,
    give the same bits for every row at every row count (widths with a partial last vector too), so the
    choice between them by row count (specc/products.py) cannot make a row's bits depend on T."""
    w = torch.randn(72, K, generator=gen(K))
    w = (w * 40).round().clamp(-127, 127).to(torch.int8) if wdtype == torch.int8 else w
    x = torch.randn(1, 16, K, generator=gen(1))
    from specc.backends import inductor_configs  # the engine's Inductor settings (contraction on)

    compiled = torch.compile(lambda r: rows_linear_reference(r, w), fullgraph=True, dynamic=False,
                             options=dict(inductor_configs()))(x)
    for rows in (1, 2, 3, 5, 8, 9, 16):
        got = torch.ops.specc_cpu.dense_matvec(x[:, :rows].contiguous(), w)
        assert torch.equal(bits(got), bits(compiled[:, :rows])), rows


@pytest.mark.parametrize("K", [256, 576])
def test_inductors_reduction_gives_a_row_its_bits_at_every_row_count(K):
    """Inductor's compiled reduction (rows_linear's reference body, the float32 products of every CPU
    without AVX-512) compiled at 1 row and at T rows gives row 0 the same bits: the compiler contracts
    each `acc + w * x` alike in every graph (GCC tuned for an AVX2 AMD EPYC fused the T-row graph's chains
    but not the 1-row graph's single chain until specc turned its heuristic off; backends.inductor_configs)."""
    from specc.backends import inductor_configs

    w = torch.randn(96, K, generator=gen(K))
    x = torch.randn(7, K, generator=gen(2))
    outs = {T: torch.compile(lambda r: rows_linear_reference(r, w), fullgraph=True, dynamic=False,
                             options=dict(inductor_configs()))(x[:T].contiguous()) for T in (1, 4, 7)}
    for T in (4, 7):
        assert torch.equal(bits(outs[T][:1]), bits(outs[1])), T


@pytest.mark.parametrize("dtype", DTYPES)
def test_eager_products_rows_alike(dtype):
    """rows_linear run eagerly (an eager engine's products): a row of a T-row call equals the 1-row
    call's bits, for float and int8 weights."""
    w = torch.randn(96, 64, generator=gen(0)).to(dtype)
    x = torch.randn(1, 9, 64, generator=gen(1)).to(dtype)
    for weight in (w, (w.float() * 40).round().clamp(-127, 127).to(torch.int8)):
        many = rows_linear(x, weight)
        for r in range(x.shape[1]):
            assert torch.equal(bits(rows_linear(x[:, r: r + 1].clone(), weight)[0, 0]), bits(many[0, r])), r


def test_keys_read_are_whole_blocks():
    S = 1056
    for kv_len in (1, 2, 63, 64, 65, 700, 1024, 1025, 1056):
        n = keys_read(kv_len, S)
        assert kv_len <= n <= S and (n % KEY_BLOCK == 0 or n == S) and n - kv_len < KEY_BLOCK


def _attention(q, k, v, mask, n):
    return F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], attn_mask=mask[..., :n], scale=0.125)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_over_whole_key_blocks_is_row_invariant(dtype):
    """attend_prefix's attention without the C++ kernel: a tree node's G grouped query rows, in a call of
    their own over keys_read(base + T) keys, get the plain step's bits over keys_read(base + 1), for
    contexts across the 512-key blocks of the CPU kernel and trees up to 16 nodes. Negative control:
    reading exactly kv_len keys changes some rows' bits. (One call for all G * T rows is not row
    invariant on every CPU: measured on an AMD EPYC, from 2 nodes, where the library GEMM's blocking
    follows the row count.)"""
    KV, G, D, S = 3, 3, 64, 1056
    k = torch.randn(1, KV, S, D, generator=gen(0)).to(dtype)
    v = torch.randn(1, KV, S, D, generator=gen(1)).to(dtype)
    cols = torch.arange(S)
    exact_differs = 0
    for case, (L, T) in enumerate([(5, 2), (40, 8), (100, 4), (300, 4), (300, 8), (511, 2), (600, 16),
                                   (700, 4), (700, 8), (1000, 16), (1040, 16)]):
        rows = torch.arange(T).view(T, 1) + L
        mask = torch.zeros(T, S).masked_fill(cols.view(1, S) > rows, -1e9).to(dtype)
        q = torch.randn(1, KV, G * T, D, generator=gen(10 + case)).to(dtype)
        q_root = q.view(1, KV, G, T, D)[:, :, :, 0]
        root_mask = mask[:1].repeat(G, 1).view(1, 1, G, S)
        for read, expect_same in ((keys_read, True), (lambda n, S: n, False)):
            plain = _attention(q_root.contiguous(), k, v, root_mask, read(L + 1, S))
            step = _attention(q_root, k, v, root_mask, read(L + T, S))  # the pass's call for node 0
            same = torch.equal(bits(plain), bits(step))
            if expect_same:
                assert same, (L, T)
            else:
                exact_differs += not same
    if dtype != torch.float16:  # measured: bf16 and fp32 rows differ when the keys read follow kv_len exactly
        assert exact_differs > 0


def test_attend_prefix_without_the_cpp_kernel_gives_chain_rows_the_plain_bits(monkeypatch):
    """Where the C++ attention is not built (SPECC_CPU_KERNELS=0), the inductor verify program of a chain
    still gives every node the plain program's logits bit for bit (float32): attend_prefix calls SDPA
    once per node with the plain step's shape."""
    import specc.kernels.tree_attention as ta

    monkeypatch.setattr(ta, "rows_kernel", lambda q, mask: False)
    model = tiny_model("llama", vocab=128, layers=2, hidden=384, heads=6, kv_heads=2, seed=5)  # G = 3
    target = TargetModule(model, 160)
    tree = chain(4)
    context, drafts = random_text(128, 70, 1), random_text(128, tree.size, 2)
    report = compare_rows(target, tree, context, drafts, "inductor")
    assert report.identical, report


@pytest.mark.skipif(not load_cpu_kernel(), reason="the C++ kernels are not built here")
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_attention_sums_each_row_in_slot_order(dtype):
    """The C++ attention of the decode graphs: values as SDPA's (up to rounding); a row's bits equal
    whatever the other rows, the keys read past kv_len (never read: NaN there changes nothing) and where
    the masked slots sit: a tree node whose parent sits two slots up (node 4 of a 2x2 tree) gets the
    bits of plain decoding, where the parent sits right before it."""
    KV, G, D, S, base = 2, 3, 64, 160, 70
    op = torch.ops.specc_cpu.rows_attention
    k = torch.randn(1, KV, S, D, generator=gen(0)).to(dtype)
    v = torch.randn(1, KV, S, D, generator=gen(1)).to(dtype)
    q = torch.randn(1, KV, G, D, generator=gen(2)).to(dtype)  # one token's query rows

    def mask_for(visible: list[int], rows: int = 1):
        allowed = torch.zeros(S, dtype=torch.bool)
        allowed[:base] = True
        allowed[visible] = True
        return torch.zeros(S).masked_fill(~allowed, -1e9).to(dtype).view(1, 1, 1, S).expand(1, 1, G * rows, S)

    # plain decoding: root at base, parent at base + 1, the node at base + 2; the tree: parent at base + 2,
    # the node at base + 4 (slots base + 1 and base + 3 hold siblings, masked for this row)
    path_k, path_v = k.clone(), v.clone()
    tree_k, tree_v = k.clone(), v.clone()
    for (src, dst) in ((base + 1, base + 2), (base + 2, base + 4)):
        tree_k[:, :, dst], tree_v[:, :, dst] = path_k[:, :, src], path_v[:, :, src]
    tree_k[:, :, base + 5:], tree_v[:, :, base + 5:] = float("nan"), float("nan")  # past kv_len: never read
    plain = op(q, path_k, path_v, mask_for([base, base + 1, base + 2]).contiguous(), 0.125, torch.tensor(base + 3))
    node = op(q, tree_k, tree_v, mask_for([base, base + 2, base + 4]).contiguous(), 0.125, torch.tensor(base + 5))
    assert torch.equal(bits(plain), bits(node))
    ref = F.scaled_dot_product_attention(q.float(), path_k[:, :, :base + 3].float(), path_v[:, :, :base + 3].float(),
                                         scale=0.125)
    torch.testing.assert_close(plain.float(), ref, atol=2e-2 if dtype != torch.float32 else 1e-5, rtol=1e-2)
    # the same row among others (a tree's four nodes: other queries, other masks)
    qs = torch.randn(1, KV, G * 4, D, generator=gen(3)).to(dtype)
    qs.view(1, KV, G, 4, D)[:, :, :, 2] = q
    rows = torch.cat([mask_for([base, base + 2, base + 4]) if t == 2 else mask_for([base + t])
                      for t in range(4)], dim=2).view(1, 1, 4, G, S).transpose(2, 3).reshape(1, 1, G * 4, S)
    many = op(qs, tree_k, tree_v, rows.contiguous(), 0.125, torch.tensor(base + 5))
    assert torch.equal(bits(many.view(1, KV, G, 4, D)[:, :, :, 2]), bits(node))


@pytest.mark.parametrize("dtype,backend", [(d, "eager") for d in DTYPES] + [
    (torch.float32, "inductor"), (torch.bfloat16, "inductor")])  # fp16 inductor: the bf16 code paths; compile time
def test_verify_rows_equal_the_plain_step(dtype, backend):
    """The row-equality contract on an engine's own verify programs (the passes and lowering passes of
    the backend; inductor: both compiled by AOTInductor): every node of a tree gets the logits, bit for
    bit, that the plain program computes along the node's path, on a random tiny model (head size 64,
    like SmolLM2's) over a context that crosses key blocks."""
    model = tiny_model("llama", vocab=128, layers=2, hidden=256, heads=4, kv_heads=2, seed=5).to(dtype)
    target = TargetModule(model, 160)
    tree = topk(2, 2)
    context, drafts = random_text(128, 70, 1), random_text(128, tree.size, 2)
    report = compare_rows(target, tree, context, drafts, backend)
    assert report.identical, report
    assert first_divergence(target, tree, context, drafts, backend) is None


def test_cuda_verify_of_a_large_tree_keeps_every_product_row_invariant():
    """On CUDA (lowering_passes), a verify of more nodes than matvec.MAX_ROWS still computes every product
    over a stored weight with rows_linear's one-tile-shape kernel (not cuBLAS, whose kernel changes with
    the row count); on CPU those stay library GEMMs; prefill graphs are left alone."""
    from specc.passes.matvec import MAX_ROWS, decode_products

    model = tiny_model("llama", vocab=64, layers=1, hidden=64, heads=4, kv_heads=2, seed=7)
    target = TargetModule(model, 96)

    def products(ep):
        ops = [n.target for n in ep.graph.nodes if n.op == "call_function"]
        return ops.count(torch.ops.aten.linear.default), ops.count(torch.ops.specc.rows_linear.default)

    big = chain(MAX_ROWS + 3)
    cpu, cuda = (verify_program(target, big, 96, "inductor", device) for device in ("cpu", "cuda"))
    assert products(cpu)[0] > 0  # 20 rows: GEMMs on CPU
    assert products(cuda) == (0, products(cpu)[0] + products(cpu)[1])
    small = verify_program(target, chain(3), 96, "inductor", "cuda")
    assert products(small)[0] == 0
    prefill = capture(target, (torch.zeros(1, 20, dtype=torch.long), torch.arange(20).view(1, 20),
                               torch.arange(20), torch.zeros(1, 1, 20, 96)))
    assert products(decode_products(prefill)) == products(prefill)


def _scale_product(ep, index: int, factor: float) -> str:
    """Multiply the output of the program's index-th product by `factor` (a new node); its name."""
    products = [n for n in ep.graph.nodes if n.op == "call_function" and n.target is torch.ops.specc.rows_linear.default]
    node = products[index]
    with ep.graph.inserting_after(node):
        scaled = ep.graph.call_function(torch.ops.aten.mul.Tensor, (node, factor))
    node.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)
    scaled.meta["val"] = node.meta["val"]
    ep.graph_module.recompile()
    return scaled.name


def test_first_divergence_finds_a_row_dependent_op():
    """Negative control for the tool: programs whose third product is scaled by 1 in the plain step and
    by 1 + 2^-10 in the tree's verify (an op whose rows depend on the row count) are reported at that
    very node."""
    model = tiny_model("llama", vocab=64, layers=2, hidden=64, heads=4, kv_heads=2, seed=6)
    target = TargetModule(model, 96)
    tree = chain(3)
    plain = verify_program(target, chain(0), 96, "eager")
    step = verify_program(target, tree, 96, "eager")
    name = _scale_product(plain, 2, 1.0)
    assert _scale_product(step, 2, 1.0 + 2 ** -10) == name
    found = diverging_node(plain, step, module_state(target), random_text(64, 20, 3), random_text(64, tree.size, 4))
    assert found is not None and found.node == name and found.op == "aten.mul.Tensor" and found.differing > 0, found


def _script(name: str, *args) -> subprocess.CompletedProcess:
    path = Path(__file__).resolve().parents[1] / "examples" / name
    return subprocess.run([sys.executable, "-P", str(path), *map(str, args)], env=cli_env(), capture_output=True,
                          text=True, timeout=300)


def test_row_divergence_script(tmp_path):
    """examples/row_divergence.py on a tiny model dir: every row identical, JSON out, exit 0; a bad model
    path is one sentence and exit 2."""
    tiny_model("llama", vocab=64, layers=1, hidden=64, heads=4, kv_heads=2, seed=8).save_pretrained(tmp_path / "m")
    proc = _script("row_divergence.py", tmp_path / "m", "--dtypes", "bfloat16", "--backend", "eager",
                   "--tree", "topk:2,2", "--context", "20", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert [r["dtype"] for r in out] == ["bfloat16"]
    assert all(r["rows"]["identical"] and r["rows"]["rows"] == 7 and r["first_op"] is None for r in out)
    bad = _script("row_divergence.py", tmp_path / "missing", "--dtypes", "float32")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "error:" in bad.stderr


@pytest.mark.skipif(not load_cpu_kernel(), reason="the C++ kernels are not built here")
def test_bench_attention_script():
    proc = _script("bench_attention.py", "--dtypes", "float32", "--contexts", "16", "--Ts", "1,2", "--calls", "2",
                   "--rounds", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)["attention"]
    assert [(r["context"], r["T"]) for r in rows] == [(16, 1), (16, 2)] and all(r["rows_us"] > 0 for r in rows)
