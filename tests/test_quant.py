"""Weight-only quantization (specc/quant.py): the quantizers against their definitions (and against
gguf-py, llama.cpp's own quantizers, for the Q8_0 and Q4_0 blocks), the configs and their --quant
spelling, a quantized TargetModule against a Hugging Face model carrying the same dequantized
weights, and quantized engines: lossless with respect to the quantized target (greedy, and sampling
checked statistically), what the manifest and `specc inspect` say, and the refusals."""
import copy
import json

import pytest
import torch
from torch import nn

import specc
from specc.config import CompileConfig
from specc.errors import SpeccError
from specc.quant import (HANDLERS, GGUFBlocks, GGUFFile, GGUFWeight, Int4WeightOnly, Int8Weight, Int8WeightOnly,
                         parse_quant, quant_spec, quantize_, quantize_int4, quantize_int8, quantize_q4_0,
                         quantize_q8_0, weight_bytes)
from specc.target_module import TargetModule, causal_mask
from test_engine import hf_greedy
from test_sampling import NEW, PROMPT, RUNS, V, exact_distribution, g_test
from tiny import tiny_model

S = 40


def round_trip(w: torch.Tensor, quant) -> torch.Tensor:
    """The float weight a quantized product computes with (its config's handler, then dequantized)."""
    config = parse_quant(quant)
    return HANDLERS[type(config)]("w", w, config).dequantized().to(w.dtype)


def dequantized_hf(model, quant: str = "int8"):
    """The float model that a quantized engine computes: a copy of `model` whose product weights are
    their round trips (the LM head untied from the embedding, which stays float)."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for layer in m.model.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                lin.weight = nn.Parameter(round_trip(lin.weight, quant))
        m.lm_head.weight = nn.Parameter(round_trip(m.lm_head.weight, quant))
    return m


def test_int8_round_trip_and_edge_rows():
    w = torch.randn(7, 33, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 7)[:, None]
    w[3] = 0.0  # an all-zero row keeps a finite scale
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (7,) and q.abs().max() <= 127
    assert torch.all(q[torch.arange(7) != 3].abs().amax(1) == 127)  # each row's largest weight maps to +-127
    err = (q.float() * s[:, None] - w).abs()
    assert torch.all(err <= s[:, None] / 2 + 1e-12)
    assert torch.equal(q[3], torch.zeros(33, dtype=torch.int8)) and s[3] == 1
    x = torch.randn(5, 33)
    torch.testing.assert_close(Int8Weight(w)(x), x @ (q.float() * s[:, None]).T, atol=1e-4, rtol=1e-5)


def test_int4_round_trip():
    w = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)) * 3
    w[2, :32] = 0.7  # a constant block: d = 0, every code 0, the value is m
    qs, d, m = quantize_int4(w)
    assert qs.shape == (5, 2, 16) and d.dtype == m.dtype == torch.float16
    err = (round_trip(w, "int4") - w).abs().reshape(5, 2, 32)
    assert torch.all(err <= d.float()[..., None] / 2 + 1e-3 * w.abs().max())  # + float16 rounding of m
    assert torch.all(round_trip(w, "int4")[2, :32] == m[2, 0].float())


@pytest.mark.parametrize("fmt,quantize", [("Q8_0", quantize_q8_0), ("Q4_0", quantize_q4_0)])
def test_llama_cpp_blocks_are_llama_cpps_own(fmt, quantize):
    """int8:group_size=32 and int4:symmetric=true quantize as llama.cpp does: byte for byte what gguf-py
    (its bit-exact port) makes of the same float32 weights, ties, zero blocks and huge values included."""
    import gguf
    import numpy as np

    from specc.kernels.gguf_linear import split_blocks

    g = torch.Generator().manual_seed(7)
    w = torch.randn(9, 128, generator=g) * torch.logspace(-4, 3, 9)[:, None]
    w[1, :32] = 0.0  # a zero block: d = 0
    w[2, 32:64] = 2.5  # a constant block
    w[3, :32] = torch.arange(32) - 16.0  # codes exactly at halves
    w[4, 64:96] = -w[4, 64:96].abs()  # the largest magnitude negative: Q4_0's d flips sign
    raw = torch.from_numpy(np.array(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[fmt])))
    for got, want in zip(quantize(w), split_blocks(raw, fmt)):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8) if got.numel() else got, want.view(torch.uint8) if want.numel() else want)


def test_configs_parse_once_and_spell_back():
    assert parse_quant("none") is None and parse_quant(None) is None
    assert parse_quant("int8") == Int8WeightOnly() and parse_quant("int8:group_size=32") == Int8WeightOnly(32)
    assert parse_quant("int4:symmetric=true") == Int4WeightOnly(symmetric=True)
    assert isinstance(parse_quant("gguf"), GGUFFile)
    for spec in ("none", "int8", "int8:group_size=32", "int4", "int4:symmetric=true", "gguf"):
        assert quant_spec(parse_quant(spec)) == spec
    assert parse_quant(Int4WeightOnly()) == Int4WeightOnly()  # a config passes through
    assert (Int8WeightOnly().weights, Int8WeightOnly(32).weights, Int4WeightOnly().weights) == ("int8", "blocks", "blocks")
    assert Int4WeightOnly(symmetric=True).block_formats == ("Q4_0",) and Int8WeightOnly(32).block_formats == ("Q8_0",)
    for bad, words in (("int8:group_size=64", "is not built; use none"), ("int8:bits=4", "takes group_size"),
                       ("int4:symmetric=maybe", "is not a number, true, false or none"),
                       ("gguf:x=1", "takes no options")):
        with pytest.raises(SpeccError, match=words):
            parse_quant(bad)
    with pytest.raises(SpeccError, match="unsupported quantization config"):
        parse_quant(3)


@pytest.mark.parametrize("quant,module", [("int8", Int8Weight), ("int8:group_size=32", GGUFWeight),
                                          ("int4", GGUFWeight), ("int4:symmetric=true", GGUFWeight)])
def test_quantized_target_module_matches_dequantized_hf(quant, module):
    model = tiny_model("llama", vocab=64, layers=2, seed=3)
    tm = quantize_(TargetModule(model, S), quant)
    assert all(isinstance(getattr(b, n), module) for b in tm.blocks for n in ("wqkv", "wo", "w_gate_up", "w_down"))
    assert isinstance(tm.w_head, module) and tm.embed_tokens.weight.dtype == torch.float32
    ref = TargetModule(dequantized_hf(model, quant), S)
    T = 6
    args = (torch.randint(0, 64, (1, T)), torch.arange(T).view(1, T), torch.arange(T), causal_mask(T, 0, S))
    with torch.no_grad():
        torch.testing.assert_close(tm(*args)[0], ref(*args)[0], atol=1e-4, rtol=1e-4)
    # at most a quarter of the product weights' bytes (plus the scales)
    fp = weight_bytes(TargetModule(model, S))
    assert weight_bytes(tm) < 0.3 * fp + 64 * 64 * 4  # the embedding row and norms stay float


@pytest.fixture(scope="module")
def quant_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    model = tiny_model("llama", vocab=64, layers=2, seed=0)
    model.save_pretrained(root / "llama")
    return root, model


# Suite time: int8 through Inductor runs in examples/bench_quant.py (and int4 here covers the
# quantized graphs through AOTInductor).
@pytest.mark.parametrize("quant,backend", [("int8", "eager"), ("int4", "inductor"), ("int8", "onnx"),
                                           ("int4:symmetric=true", "eager")])
def test_quantized_engine_is_lossless_to_the_quantized_target(quant_dir, tmp_path, quant, backend):
    """Speculative greedy == the engine's own plain decoding == HF on the dequantized weights; for
    int4 on Inductor, specc::gguf_linear inside every compiled graph; for int8 on onnx, int8
    initializers cast in the graph."""
    if backend == "onnx":
        pytest.importorskip("onnxruntime")
    root, model = quant_dir
    path = specc.compile(root / "llama", drafter="ngram", tree="chain:3", backend=backend, quant=quant,
                         output_dir=tmp_path / "e", max_len=64, prefill_chunk=8, progress=False, modes="greedy")
    m = json.loads((path / "specc.json").read_text())
    assert m["quant"]["target"] == quant and m["quant"]["drafter"] == "none"
    fp32 = weight_bytes(TargetModule(model, 8))
    assert m["quant"]["bytes_per_token"]["target"] < 0.35 * fp32 and m["quant"]["bytes_per_token"]["drafter"] == 0
    engine = specc.load(path)
    if backend == "inductor":  # the graphs take the quantized tensors (load quantized the stored float weights again)
        keys = set(m["graphs"]["plain_greedy"]["state_keys"])
        want = {"w_head.qs", "blocks.1.w_down.d"}  # int4's blocks
        assert want <= keys and "w_head" not in keys
    if backend == "onnx":  # the int8 weights stay int8 in the graphs (their casts are not folded away)
        import onnx

        g = onnx.load(path / "graphs" / "step_greedy.onnx", load_external_data=False)
        int8 = [i for i in g.graph.initializer if i.data_type == onnx.TensorProto.INT8]
        assert len(int8) == 4 * 2 + 1, [i.name for i in int8]  # 4 products a layer, 2 layers, the head
    ref = dequantized_hf(model, quant)
    prompt = [3, 9, 4, 3, 9, 4, 3, 9]  # repeats, so prompt lookup drafts and the step graph verifies
    spec = engine.generate(prompt, max_new_tokens=24, stop_at_eos=False)
    assert spec.stats.steps < 24
    assert spec.token_ids == hf_greedy(ref, prompt, 24)
    plain = engine.generate(prompt, max_new_tokens=24, stop_at_eos=False, speculate=False)
    assert plain.token_ids == spec.token_ids


def test_int8_sampling_matches_the_quantized_target(tmp_path):
    """The statistical test of tests/test_sampling.py on an int8 target (a float draft model): the
    samples follow the quantized target's exact distribution."""
    target = tiny_model("llama", vocab=V, layers=2, seed=0, scale=4.0)
    target.save_pretrained(tmp_path / "target")
    tiny_model("llama", vocab=V, layers=1, seed=1, scale=4.0).save_pretrained(tmp_path / "draft")
    engine = specc.load(specc.compile(tmp_path / "target", drafter="draft-model", drafter_path=tmp_path / "draft",
                                      tree="chain:3", quant="int8", output_dir=tmp_path / "e", max_len=32,
                                      prefill_chunk=4, progress=False, modes="sample"))
    samples, steps = [], 0
    for seed in range(RUNS):
        r = engine.generate(PROMPT, max_new_tokens=NEW, temperature=1.0, seed=seed, stop_at_eos=False)
        samples.append(tuple(r.token_ids))
        steps += r.stats.steps
    assert steps < RUNS * (NEW - 1)
    p = g_test(samples, exact_distribution(dequantized_hf(target), 1.0))
    assert p > 1e-3, f"int8 speculative samples differ from the quantized target (p={p:.2e})"


def gguf_blocks_for(model, fmt: str):
    """GGUF blocks of `model`'s products in the target's layout (quantized by gguf-py, as llama.cpp's
    tools do), with `model`'s weights set to what the blocks decode to (as transformers loads a file)."""
    import gguf
    import numpy as np

    from specc.kernels.gguf_linear import dequantize, split_blocks

    qtype = gguf.GGMLQuantizationType[fmt]

    def blocks(lins):
        parts = []
        for lin in lins:
            raw = torch.from_numpy(np.array(gguf.quants.quantize(lin.weight.detach().numpy(), qtype)))
            qs, d, m = split_blocks(raw, fmt)
            with torch.no_grad():
                lin.weight.copy_(dequantize(qs, d, m, fmt))
            parts.append(raw)
        return (fmt, *split_blocks(torch.cat(parts), fmt))

    out = {}
    for i, layer in enumerate(model.model.layers):
        a, mlp = layer.self_attn, layer.mlp
        out[f"blocks.{i}.wqkv"] = blocks([a.q_proj, a.k_proj, a.v_proj])
        out[f"blocks.{i}.wo"] = blocks([a.o_proj])
        out[f"blocks.{i}.w_gate_up"] = blocks([mlp.gate_proj, mlp.up_proj])
        out[f"blocks.{i}.w_down"] = blocks([mlp.down_proj])
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())  # untied, as a Q8_0 head
    out["w_head"] = blocks([model.lm_head])
    return GGUFBlocks(out)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q4_0", "Q8_0"])
def test_gguf_target_module_computes_the_loaded_model(fmt):
    """A TargetModule on GGUF blocks gives the float model's values (the blocks decode to its weights
    exactly); blocks that decode to other weights are refused in one sentence."""
    model = tiny_model("llama", vocab=64, layers=2, seed=5, hidden=64)
    config = gguf_blocks_for(model, fmt)
    tm = quantize_(TargetModule(model, S), config)
    assert isinstance(tm.w_head, GGUFWeight) and tm.w_head.fmt == fmt
    ref = TargetModule(model, S)
    T = 5
    args = (torch.randint(0, 64, (1, T)), torch.arange(T).view(1, T), torch.arange(T), causal_mask(T, 0, S))
    with torch.no_grad():
        torch.testing.assert_close(tm(*args)[0], ref(*args)[0], atol=1e-4, rtol=1e-4)
    ratio = weight_bytes(tm) / weight_bytes(ref)
    assert ratio < {"Q4_1": 0.2, "Q4_0": 0.2, "Q8_0": 0.3}[fmt], ratio
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-3  # the float model no longer matches its blocks
    with pytest.raises(SpeccError, match="the GGUF blocks of blocks.1.w_down do not decode to the weights"):
        quantize_(TargetModule(model, S), config)


def test_bad_quant_is_refused(tmp_path):
    with pytest.raises(SpeccError, match="unknown --quant 'int3'; use one of none, int8, int4, gguf"):
        CompileConfig(output_dir=tmp_path / "e", quant="int3")
    with pytest.raises(SpeccError, match="the ONNX lowering of block-quantized weights .* is not built yet"):
        CompileConfig(output_dir=tmp_path / "e", quant="int4", backend="onnx")
    with pytest.raises(SpeccError, match="--quant int8:group_size=32 runs on the eager and inductor backends"):
        CompileConfig(output_dir=tmp_path / "e", quant=Int8WeightOnly(group_size=32), backend="onnx")
    with pytest.raises(SpeccError, match="TensorRT engines of int8 weights are not built yet"):
        CompileConfig(output_dir=tmp_path / "e", quant="int8", backend="tensorrt")
    with pytest.raises(SpeccError, match="--quant gguf keeps a GGUF file's own blocks; give a .gguf model"):
        CompileConfig(output_dir=tmp_path / "e", model=tmp_path, quant="gguf")
    assert not (tmp_path / "e").exists()
