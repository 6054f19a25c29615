"""GGUF K-quants (Q4_K, Q5_K, Q6_K: what Q4_K_M / Q5_K_M / Q6_K files hold) in specc::gguf_linear:
the reference decodes random super-blocks bit for bit as gguf-py does; the torch product, the C++
product (AVX2 and portable builds) and the Triton kernel (interpreted) compute it, each row's bits
independent of the rows beside it; read_gguf_blocks reads a tiny Q4_K_M-style llama file (Q4_K
beside a Q6_K attn_v and ffn_down), whose fused products mix formats, into blocks that decode to
gguf-py's weights, round-trip through an engine's file and compute the float model; an engine
compiled from such a file samples its model's exact distribution."""
from __future__ import annotations

import os

# Before triton is first imported: @triton.jit decides at decoration time whether to interpret.
os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from tiny import tiny_model  # noqa: E402

import specc.kernels as K  # noqa: E402
from specc.errors import SpeccError  # noqa: E402
from specc.kernels import gguf_linear as gl  # noqa: E402
from specc.kernels.gguf_linear import (BLOCK_BYTES, FORMATS, K_FORMATS, dequantize, gguf_linear_reference,  # noqa: E402
                                       split_blocks)

ops = torch.ops.specc


def _interpreting() -> bool:
    if not K.HAS_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(gl._gguf_kquant_kernel, InterpretedFunction)


INTERPRETING = _interpreting()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def half_offsets(fmt: str) -> list[int]:
    """Byte offsets of a super-block's float16 scales: d, dmin (Q4_K, Q5_K) or d (Q6_K, at the end)."""
    return [208] if fmt == "Q6_K" else [0, 2]


def random_blocks(fmt: str, N: int, n_super: int, seed: int, scale: float | None = None) -> torch.Tensor:
    """[N, n_super * block bytes] uint8: random bytes are valid super-blocks; the float16 scales are made
    finite (an all-ones exponent loses its top bit), or, given `scale`, uniform in [0, scale)."""
    g = gen(seed)
    raw = torch.randint(0, 256, (N, n_super, BLOCK_BYTES[fmt]), generator=g, dtype=torch.uint8)
    for at in half_offsets(fmt):
        if scale is None:
            hi = raw[..., at + 1]
            raw[..., at + 1] = torch.where((hi & 0x7C) == 0x7C, hi & 0xBF, hi)
        else:
            h = (torch.rand(N, n_super, generator=g) * scale).to(torch.float16)
            raw[..., at:at + 2] = h.view(torch.uint8).reshape(N, n_super, 2)
    return raw.reshape(N, -1)


def gguf_py(raw: torch.Tensor, fmt: str) -> torch.Tensor:
    import gguf

    return torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[fmt]))


def assert_product_close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """out = x @ w.T up to float32 sums: within 1e-5 of the sum of |x| |w| (random scales span float16's
    whole range, so an absolute tolerance would mean nothing)."""
    want = x.double() @ w.double().T
    bound = x.double().abs() @ w.double().abs().T
    err = (out.double() - want).abs()
    assert (err <= 1e-5 * bound + 1e-30).all(), (err / bound.clamp_min(1e-30)).max()


# -- the reference ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", K_FORMATS)
def test_kquant_blocks_decode_bit_for_bit_as_gguf_py(fmt):
    raw = random_blocks(fmt, N=9, n_super=3, seed=1)
    qs, d, m = split_blocks(raw, fmt)
    assert qs.shape == (9, 3, BLOCK_BYTES[fmt]) and qs.dtype == torch.uint8 and d.numel() == m.numel() == 0
    assert gl.weight_shape(qs, fmt) == (9, 768)
    got, want = dequantize(qs, d, m, fmt), gguf_py(raw, fmt)
    assert got.dtype == want.dtype == torch.float32 and not torch.isnan(got).any()
    assert torch.equal(got, want) and torch.equal(got.view(torch.int32), want.view(torch.int32))  # signed zeros too


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_kquant_reference_product(fmt):
    raw = random_blocks(fmt, N=13, n_super=2, seed=2)
    qs, d, m = split_blocks(raw, fmt)
    w = gguf_py(raw, fmt)
    for rows in (1, 3, 16, 17):  # 17: past MAX_ROWS, the dequantise-then-GEMM path
        x = torch.randn(1, rows, 512, generator=gen(rows))
        out = gguf_linear_reference(x, qs, d, m, fmt)
        assert out.shape == (1, rows, 13)
        assert_product_close(out[0], x[0], w)


# -- the C++ product -------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", K_FORMATS)
def test_kquant_cpu_product(fmt):
    """gguf_kquants_cpu.cpp's product (built here: this machine has Inductor's compiler): exactly the
    reference's weights (an identity input reads them out), close to the float64 product for 1..16
    rows (groups of 4 and the rest), each row's bits the same alone and among others; the op's CPU
    body calls it; a weight that does not fit x is refused."""
    from specc.kernels.cpu_kernels import load_cpu_kernel, load_error

    assert load_cpu_kernel(), load_error()
    code = FORMATS.index(fmt)
    raw = random_blocks(fmt, N=37, n_super=3, seed=3)  # 37: an odd output count
    qs, d, m = split_blocks(raw, fmt)
    w = gguf_py(raw, fmt)
    eye = torch.eye(768)  # row k of the product is column k of W: w * 1 plus exact zeros
    assert torch.equal(torch.ops.specc_cpu.gguf_kquant_matvec(eye, qs, code), w.T)
    x16 = torch.randn(1, 16, 768, generator=gen(16))
    all16 = torch.ops.specc_cpu.gguf_kquant_matvec(x16, qs, code)
    for rows in (1, 2, 3, 4, 5, 7, 16):
        x = torch.randn(1, rows, 768, generator=gen(rows))
        out = torch.ops.specc_cpu.gguf_kquant_matvec(x, qs, code)
        assert out.shape == (1, rows, 37)
        assert_product_close(out[0], x[0], w)
        assert torch.equal(ops.gguf_linear(x, qs, d, m, fmt), out)  # the op's CPU body calls it
        # a row's bits do not depend on the rows beside it (a verify row = the plain step's)
        assert torch.equal(torch.ops.specc_cpu.gguf_kquant_matvec(x16[:, :rows].contiguous(), qs, code),
                           all16[:, :rows])
        assert torch.equal(torch.ops.specc_cpu.gguf_kquant_matvec(x[:, :1].contiguous(), qs, code), out[:, :1])
    with pytest.raises(RuntimeError, match="inputs"):
        torch.ops.specc_cpu.gguf_kquant_matvec(torch.randn(2, 512), qs, code)
    with pytest.raises(RuntimeError, match="qs must be uint8"):
        torch.ops.specc_cpu.gguf_kquant_matvec(torch.randn(2, 768), qs[..., :-2], code)


@pytest.mark.parametrize("level,needs,flags", [
    ("AVX2", "avx512f", "-mno-avx512f"),                               # an AVX-512 machine builds the AVX2 path
    ("portable", "avx2", "-mno-avx512f -mno-avx -mno-avx2 -mno-fma"),  # every x86 machine the portable loops
])
def test_kquant_cpu_product_other_instruction_sets_subprocess(level, needs, flags):
    """The product above ran the path this machine's build picks; the same test in a process whose build
    leaves the wider instruction sets out runs the paths of lesser CPUs (AVX2's 8-lane vectors, or the
    portable loops). The flags are tests/test_kernels.py's, so the two share their builds."""
    if os.environ.get("SPECC_CPU_KERNEL_FLAGS"):
        pytest.skip("this process already builds with extra flags")
    if needs not in Path("/proc/cpuinfo").read_text(errors="ignore").split():
        pytest.skip(f"no {needs} here: the {level} path is what the test above ran, or cannot be told apart")
    env = dict(os.environ, SPECC_CPU_KERNEL_FLAGS=flags, OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "test_kquant_cpu_product and not subprocess"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "3 passed" in proc.stdout


def test_kquant_reference_compiles_to_native_cpu_code(tmp_path, monkeypatch):
    """Without the C++ product (no compiler where the engine runs) AOTInductor compiles the reference's
    decoding (float16 and bit views of the bytes, shifts, the packed scales) to native code, with no
    call out of the graph. (With it, the graph calls gguf_kquant_matvec as test_kernels.py's Q4_1 case
    calls gguf_matvec.)"""
    import zipfile

    from specc.kernels import cpu_kernels

    monkeypatch.setitem(cpu_kernels._state, "loaded", False)
    raw = random_blocks("Q5_K", N=24, n_super=2, seed=8, scale=1e-3)
    qs, d, m = split_blocks(raw, "Q5_K")

    class Product(torch.nn.Module):
        def forward(self, x, qs, d, m):
            return ops.gguf_linear(x, qs, d, m, "Q5_K")

    x = torch.randn(1, 2, 512, generator=gen(8))
    ep = torch.export.export(Product(), (x, qs, d, m), strict=False)
    pkg = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "kquant.pt2"))
    code = "".join(zipfile.ZipFile(pkg).read(n).decode(errors="ignore")
                   for n in zipfile.ZipFile(pkg).namelist() if n.endswith(".cpp"))
    assert "proxy_executor_call_function" not in code
    assert_product_close(torch._inductor.aoti_load_package(pkg)(x, qs, d, m)[0], x[0], gguf_py(raw, "Q5_K"))


# -- the Triton kernel -----------------------------------------------------------------------------

@pytest.fixture
def interpreted():
    if not K.HAS_TRITON:
        pytest.skip("triton is not installed; the Triton kernels cannot run here")
    if not INTERPRETING:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; "
                    "test_kquant_interpreter_subprocess runs this")


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_kquant_linear_triton(interpreted, fmt):
    """Interpreted: the product close to the reference's weights with a partial block of outputs, a
    row's bits the same alone, and the weights exactly the reference's where one-hot rows read them
    out (one value of every 16, at varying places: every scale, nibble and high-bit field)."""
    raw = random_blocks(fmt, N=40, n_super=2, seed=4)  # 40: a partial block of 32 outputs
    qs, d, m = split_blocks(raw, fmt)
    w = gguf_py(raw, fmt)
    x = torch.randn(5, 512, generator=gen(5))
    out = gl.gguf_linear_triton(x, qs, d, m, fmt, block_n=32)
    assert_product_close(out, x, w)
    assert torch.equal(gl.gguf_linear_triton(x[:1], qs, d, m, fmt, block_n=32), out[:1])
    raw = random_blocks(fmt, N=32, n_super=1, seed=6)
    picks = [16 * i + 7 * i % 16 for i in range(16)]
    one_hot = gl.gguf_linear_triton(torch.eye(256)[picks], *split_blocks(raw, fmt), fmt, block_n=32)
    assert torch.equal(one_hot, gguf_py(raw, fmt)[:, picks].T)


def test_kquant_interpreter_subprocess():
    if not K.HAS_TRITON:
        pytest.skip("triton is not installed")
    if INTERPRETING:
        pytest.skip("the Triton kernels ran under the interpreter in this process")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "triton and not subprocess"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "3 passed" in proc.stdout and "skipped" not in proc.stdout


# -- a Q4_K_M-style GGUF file ----------------------------------------------------------------------

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 512


def tensor_formats() -> dict[str, str]:
    """As llama.cpp's Q4_K_M mix: Q4_K, with attn_v, one layer's ffn_down and the output in Q6_K."""
    out = {"output.weight": "Q6_K"}
    for i in range(LAYERS):
        for part in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            out[f"blk.{i}.{part}.weight"] = "Q4_K"
        out[f"blk.{i}.attn_v.weight"] = "Q6_K"
        out[f"blk.{i}.ffn_down.weight"] = "Q6_K" if i == 0 else "Q4_K"
    return out


def tensor_shape(name: str, vocab: int = VOCAB) -> tuple[int, int]:
    head_dim = HIDDEN // HEADS
    part = name.split(".")[-2]
    kv = KV_HEADS * head_dim
    return {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN),
            "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN),
            "ffn_down": (HIDDEN, INTER), "output": (vocab, HIDDEN)}[part]


def write_gguf(path: Path, formats: dict[str, str], bad: str | None = None, vocab: int = VOCAB,
               tokenizer: bool = False, head_scale: float = 1e-4) -> dict[str, torch.Tensor]:
    """A tiny llama GGUF of random super-blocks (scales small enough for a sane forward), F32 norms and a
    Q8_0 embedding; returns each product tensor's raw bytes. `bad`: a tensor written as if 320 wide.
    `tokenizer`: with a vocabulary of `vocab` pieces in the file, as llama.cpp's tools write one (what
    transformers needs to load the file, and so `specc compile` too); `head_scale`: the output's
    scales (larger: a peakier next-token distribution)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    if tokenizer:
        pieces = ["<unk>", "<s>", "</s>"] + [f"\u2581{chr(97 + i)}" for i in range(vocab - 3)]
        w.add_vocab_size(vocab)
        w.add_tokenizer_model("llama")
        w.add_token_list(pieces)
        w.add_token_scores([0.0] * 3 + [-float(i) for i in range(vocab - 3)])
        w.add_token_types([2, 3, 3] + [1] * (vocab - 3))  # unknown, control x 2, normal
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    emb = torch.randn(vocab, HIDDEN, generator=gen(9)).numpy() * 0.02
    w.add_tensor("token_embd.weight", gguf.quants.quantize(emb, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    raws = {}
    for seed, (name, fmt) in enumerate(formats.items()):
        N, Kin = tensor_shape(name, vocab)
        scale = head_scale if name == "output.weight" else 1e-4 if fmt == "Q6_K" else 4e-4
        raw = random_blocks(fmt, N, Kin // 256, seed=100 + seed, scale=scale)
        raws[name] = raw
        if name == bad:  # bytes of 1.25 super-blocks a row, claimed to be 320 values
            w.add_tensor(name, raw[:, :BLOCK_BYTES[fmt] * 5 // 4].numpy().view(np.int8), raw_shape=(N, 320),
                         raw_dtype=gguf.GGMLQuantizationType[fmt])
        else:
            w.add_tensor(name, raw.numpy(), raw_dtype=gguf.GGMLQuantizationType[fmt])
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(HIDDEN, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return raws


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' reverse of llama.cpp's q/k row permutation (the rotary halves interleaved)."""
    n = w.shape[0]
    return w.reshape(heads, n // heads // 2, 2, -1).transpose(1, 2).reshape(n, -1)


def expected_weights(raws: dict[str, torch.Tensor], formats: dict[str, str]) -> dict[str, torch.Tensor]:
    """Each product's float32 weight in the target's layout, from gguf-py's dequantiser."""
    f = {name: gguf_py(raw, formats[name]) for name, raw in raws.items()}
    out = {"w_head": f["output.weight"]}
    for i in range(LAYERS):
        b = f"blk.{i}."
        out[f"blocks.{i}.wqkv"] = torch.cat([unpermute(f[b + "attn_q.weight"], HEADS),
                                             unpermute(f[b + "attn_k.weight"], KV_HEADS), f[b + "attn_v.weight"]])
        out[f"blocks.{i}.wo"] = f[b + "attn_output.weight"]
        out[f"blocks.{i}.w_gate_up"] = torch.cat([f[b + "ffn_gate.weight"], f[b + "ffn_up.weight"]])
        out[f"blocks.{i}.w_down"] = f[b + "ffn_down.weight"]
    return out


def test_read_gguf_blocks_mixes_formats_in_fused_products(tmp_path):
    """A Q4_K_M-style file: wqkv is a Q4_K group (q, k) and a Q6_K group (v), the other products one
    group each; all decode to gguf-py's weights after the q/k un-permutation; an engine's copy of the
    blocks round-trips; the target computes the float model, and each group is one gguf_linear in
    the exported graph; a K-quant row that is not whole super-blocks is refused in one sentence."""
    from specc.quant import (GGUFParts, GGUFWeight, load_blocks, quantize_, read_gguf_blocks, save_blocks)
    from specc.target_module import TargetModule, causal_mask

    formats = tensor_formats()
    raws = write_gguf(tmp_path / "tiny.gguf", formats)
    model = tiny_model("llama", vocab=VOCAB, layers=LAYERS, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS,
                       intermediate_size=INTER, seed=3)
    blocks = read_gguf_blocks(tmp_path / "tiny.gguf", model.config).blocks
    want = expected_weights(raws, formats)
    assert set(blocks) == set(want)
    assert [g[0] for g in blocks["blocks.0.wqkv"]] == ["Q4_K", "Q6_K"]  # a list: one group per format
    assert [g[1].shape[0] for g in blocks["blocks.0.wqkv"]] == [HIDDEN + HIDDEN // 2, HIDDEN // 2]
    assert blocks["blocks.0.w_down"][0] == "Q6_K" and blocks["blocks.1.w_down"][0] == "Q4_K"
    assert blocks["blocks.0.w_gate_up"][0] == "Q4_K" and blocks["w_head"][0] == "Q6_K"

    def decoded(spec) -> torch.Tensor:
        groups = spec if isinstance(spec, list) else [spec]
        return torch.cat([dequantize(qs, d, m, fmt) for fmt, qs, d, m in groups])

    for name, spec in blocks.items():
        assert torch.equal(decoded(spec), want[name]), name

    save_blocks(read_gguf_blocks(tmp_path / "tiny.gguf", model.config), tmp_path / "blocks.safetensors")
    back = load_blocks(tmp_path / "blocks.safetensors").blocks
    assert set(back) == set(blocks)
    for name, spec in blocks.items():
        groups, back_groups = (spec, back[name]) if isinstance(spec, list) else ([spec], [back[name]])
        assert isinstance(back[name], list) == isinstance(spec, list) and len(groups) == len(back_groups)
        for (fmt, *tensors), (back_fmt, *back_tensors) in zip(groups, back_groups):
            assert fmt == back_fmt and all(torch.equal(a, b) for a, b in zip(tensors, back_tensors))

    # the float model transformers would load from the file, and the target on the file's blocks
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            a, mlp = layer.self_attn, layer.mlp
            q, k, v = want[f"blocks.{i}.wqkv"].split([HIDDEN, HIDDEN // 2, HIDDEN // 2])
            for lin, value in ((a.q_proj, q), (a.k_proj, k), (a.v_proj, v), (a.o_proj, want[f"blocks.{i}.wo"]),
                               (mlp.down_proj, want[f"blocks.{i}.w_down"])):
                lin.weight.copy_(value)
            gate, up = want[f"blocks.{i}.w_gate_up"].split(INTER)
            mlp.gate_proj.weight.copy_(gate)
            mlp.up_proj.weight.copy_(up)
        model.lm_head.weight.copy_(want["w_head"])
    S = 16
    tm = quantize_(TargetModule(model, S), load_blocks(tmp_path / "blocks.safetensors"))  # checks every decode
    assert isinstance(tm.blocks[0].wqkv, GGUFParts) and isinstance(tm.blocks[0].wo, GGUFWeight)
    assert tm.blocks[0].wqkv.shape == (2 * HIDDEN, HIDDEN)
    T = 3
    args = (torch.randint(0, VOCAB, (1, T), generator=gen(7)), torch.arange(T).view(1, T), torch.arange(T),
            causal_mask(T, 0, S))
    with torch.no_grad():
        torch.testing.assert_close(tm(*args)[0], TargetModule(model, S)(*args)[0], atol=1e-4, rtol=1e-4)

    ep = torch.export.export(tm.blocks[0].wqkv, (torch.randn(1, 2, HIDDEN),), strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(ops.gguf_linear.default) == 2 and targets.count(torch.ops.aten.cat.default) == 1

    bad = next(n for n in formats if n.endswith("ffn_up.weight"))
    write_gguf(tmp_path / "bad.gguf", formats, bad=bad)
    with pytest.raises(SpeccError, match="is not a GGUF file that --quant gguf can read: .*Q4_K block size"):
        read_gguf_blocks(tmp_path / "bad.gguf", model.config)


def test_kquant_engine_samples_the_files_distribution(tmp_path):
    """The statistical test of tests/test_sampling.py on an engine compiled from a Q4_K_M-style file
    (--quant gguf keeps its Q4_K / Q6_K super-blocks; a float draft model drafts): speculative samples
    follow the exact distribution of the float model transformers loads from the file, and (the
    negative control) not the distribution of that model at another temperature."""
    import specc
    from transformers import AutoModelForCausalLM

    from test_sampling import NEW, PROMPT, RUNS, V, exact_distribution, g_test

    write_gguf(tmp_path / "tiny.gguf", tensor_formats(), vocab=V, tokenizer=True, head_scale=4e-4)
    tiny_model("llama", vocab=V, layers=1, seed=1, scale=4.0).save_pretrained(tmp_path / "draft")
    engine = specc.load(specc.compile(tmp_path / "tiny.gguf", drafter="draft-model", drafter_path=tmp_path / "draft",
                                      tree="chain:3", quant="gguf", output_dir=tmp_path / "e", max_len=32,
                                      prefill_chunk=4, progress=False, modes="sample"))
    kept = {name: [g[0] for g in (spec if isinstance(spec, list) else [spec])]
            for name, spec in engine_blocks(tmp_path / "e").items()}
    assert kept["w_head"] == ["Q6_K"] and kept["blocks.0.wqkv"] == ["Q4_K", "Q6_K"] and kept["blocks.1.w_down"] == ["Q4_K"]
    samples, steps = [], 0
    for seed in range(RUNS):
        r = engine.generate(PROMPT, max_new_tokens=NEW, temperature=1.0, seed=seed, stop_at_eos=False)
        samples.append(tuple(r.token_ids))
        steps += r.stats.steps
    assert steps < RUNS * (NEW - 1)  # drafts were accepted: the verify ran
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    p = g_test(samples, exact_distribution(ref, 1.0))
    assert p > 1e-3, f"K-quant speculative samples differ from the file's model (p={p:.2e})"
    assert g_test(samples, exact_distribution(ref, 0.7)) < 1e-6  # the test can tell distributions apart


def engine_blocks(engine_dir: Path) -> dict:
    from specc.quant import GGUF_FILE, load_blocks

    return load_blocks(engine_dir / "target" / GGUF_FILE).blocks
