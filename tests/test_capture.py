"""Capture: TargetModule and its exported program against plain Hugging Face forwards (tiny models, eager)."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny import tiny_config, tiny_model  # noqa: E402

from specc.backends import EagerGraph  # noqa: E402
from specc.pipeline import capture  # noqa: E402
from specc.target_module import TargetModule, causal_mask, module_state  # noqa: E402
from specc.errors import SpeccError  # noqa: E402
from specc.models import check_architecture, load_model  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
S = 32  # cache length
ATOL = 1e-4




@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request):
    return request.param, tiny_model(request.param, seed=1)


def prompt(n: int, seed: int = 0, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def chunk_args(ids: torch.Tensor, start: int, cache_len: int = S) -> tuple:
    """Inputs of a plain causal chunk of tokens ids [1, T] written at slots start.."""
    T = ids.shape[1]
    pos = torch.arange(start, start + T)
    return ids, pos.view(1, T).clone(), pos, causal_mask(T, start, cache_len)  # no aliased inputs


def caches(tm: TargetModule) -> list[torch.Tensor]:
    return [t for b in tm.blocks for t in (b.k_cache, b.v_cache)]


@torch.no_grad()
def test_logits_match_hf_one_call_and_chunks(arch_model):
    arch, model = arch_model
    ids = prompt(11)
    ref = model(ids).logits
    tm = TargetModule(model, S)
    assert tm.arch == arch
    whole = tm(*chunk_args(ids, 0))[0]
    assert whole.shape == (1, 11, 64) and whole.dtype == torch.float32
    torch.testing.assert_close(whole, ref, atol=ATOL, rtol=0)
    after_whole = [c.clone() for c in caches(tm)]

    # Same prompt in causal chunks at increasing cache positions, into a fresh cache.
    tm2 = TargetModule(model, S)
    got, start = [], 0
    for size in (4, 1, 6):
        got.append(tm2(*chunk_args(ids[:, start:start + size], start))[0])
        start += size
    torch.testing.assert_close(torch.cat(got, dim=1), ref, atol=ATOL, rtol=0)
    for a, b in zip(after_whole, caches(tm2)):
        torch.testing.assert_close(a[:, :, :11], b[:, :, :11], atol=1e-5, rtol=0)
        assert not b[:, :, 11:].any()  # nothing written past the prompt


@torch.no_grad()
def test_exported_program_matches_eager_and_mutates_caches(arch_model):
    _, model = arch_model
    ids = prompt(7, seed=3)
    args = chunk_args(ids, 0)
    tm = TargetModule(model, S)
    ep = capture(tm, args)
    eager = tm(*args)[0]
    eager_caches = [c.clone() for c in caches(tm)]

    # The unlifted module mutates its own cache buffers in place.
    mod = ep.module()
    bufs = dict(mod.named_buffers())
    names = [f"blocks.{i}.{kv}_cache" for i in range(len(tm.blocks)) for kv in ("k", "v")]
    for n in names:
        bufs[n].zero_()
    out = mod(*args)[0]
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=0)
    for n, want in zip(names, eager_caches):
        assert bufs[n][:, :, :7].abs().sum() > 0
        torch.testing.assert_close(bufs[n], want, atol=1e-5, rtol=0)

    # torch.export keeps the non-functional index_copy_ in the captured graph (all outputs are
    # USER_OUTPUT); after functionalisation the caches appear as BUFFER_MUTATION outputs.
    kinds = [s.kind.name for s in ep.graph_signature.output_specs]
    assert kinds.count("USER_OUTPUT") == 1
    dec = ep.run_decompositions()
    mutated = [s.target for s in dec.graph_signature.output_specs if s.kind.name == "BUFFER_MUTATION"]
    assert sorted(mutated) == sorted(names)


@torch.no_grad()
def test_eager_graph_binds_another_modules_tensors():
    """EagerGraph(ep, state) runs the program on `state`'s weights and writes `state`'s caches."""
    m1, m2 = tiny_model("llama", seed=1), tiny_model("llama", seed=2)
    ids = prompt(5, seed=4)
    args = chunk_args(ids, 0)
    tm1, tm2 = TargetModule(m1, S), TargetModule(m2, S)
    ep = capture(tm1, args)
    for c in caches(tm1):
        c.zero_()
    g = EagerGraph(ep, module_state(tm2))
    out = g(*args)[0]
    torch.testing.assert_close(out, m2(ids).logits, atol=ATOL, rtol=0)
    assert all(c[:, :, :5].abs().sum() > 0 for c in caches(tm2))
    assert not any(c.any() for c in caches(tm1))  # the captured module's caches are untouched


@torch.no_grad()
def test_hidden_state_taps():
    model = tiny_model("qwen3", seed=5, layers=3)
    ids = prompt(6, seed=5)
    tm = TargetModule(model, S, taps=(0, 1, 2))
    logits, *taps = tm(*chunk_args(ids, 0))
    assert len(taps) == 3
    hf = model(ids, output_hidden_states=True)
    # Ground truth independent of HF's hidden_states convention: each decoder layer's output.
    seen = []
    hooks = [layer.register_forward_hook(lambda m, a, o: seen.append(o[0] if isinstance(o, tuple) else o))
             for layer in model.model.layers]
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    for tap, layer_out in zip(taps, seen):
        torch.testing.assert_close(tap, layer_out, atol=ATOL, rtol=0)
    # Non-last layers: tap i == hidden_states[i + 1].
    for i in (0, 1):
        torch.testing.assert_close(taps[i], hf.hidden_states[i + 1], atol=ATOL, rtol=0)
    # Last layer: this transformers version returns the *normed* output as hidden_states[-1];
    # the tap is the raw layer output, and norm(tap) is HF's last hidden state.
    torch.testing.assert_close(model.model.norm(taps[2]), hf.hidden_states[3], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits, hf.logits, atol=ATOL, rtol=0)
    # A single tap is the same tensor; tap 3 (= the number of layers) is the final norm's output;
    # a tap past that is refused.
    tm2 = TargetModule(model, S, taps=(1,))
    _, only = tm2(*chunk_args(ids, 0))
    torch.testing.assert_close(only, taps[1], atol=1e-6, rtol=0)
    _, final = TargetModule(model, S, taps=(3,))(*chunk_args(ids, 0))
    torch.testing.assert_close(final, model.model.norm(taps[2]), atol=1e-6, rtol=0)
    with pytest.raises(SpeccError, match="tap 4"):
        TargetModule(model, S, taps=(4,))


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1), (4, 4), (8, 2)])
@torch.no_grad()
def test_gqa_and_mha_match_hf(heads, kv_heads):
    model = tiny_model("llama", seed=6, heads=heads, kv_heads=kv_heads)
    ids = prompt(9, seed=6)
    tm = TargetModule(model, S)
    assert tm.blocks[0].k_cache.shape == (1, kv_heads, S, 32 // heads)
    torch.testing.assert_close(tm(*chunk_args(ids, 0))[0], model(ids).logits, atol=ATOL, rtol=0)
    # And as two chunks, so the second chunk's queries read K/V written by the first.
    tm2 = TargetModule(model, S)
    a = tm2(*chunk_args(ids[:, :5], 0))[0]
    b = tm2(*chunk_args(ids[:, 5:], 5))[0]
    torch.testing.assert_close(torch.cat([a, b], 1), model(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_check_architecture_accepts_supported(arch):
    cfg = tiny_config(arch)
    assert check_architecture(cfg) == arch
    cfg.architectures = None  # a bare config still names its model_type
    assert check_architecture(cfg) == arch


def test_load_model_accepts_saved_tiny_model(tmp_path):
    tiny_model("mistral", seed=7).save_pretrained(tmp_path / "m")
    loaded = load_model(tmp_path / "m", with_tokenizer=False)
    assert check_architecture(loaded.model.config) == "mistral"


@pytest.mark.parametrize("kind", ["gpt2", "phi", "gpt2-bare"])
def test_unsupported_architecture_refused(tmp_path, kind):
    import transformers as tf

    if kind.startswith("gpt2"):
        cfg = tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2)
        cfg.architectures = None if kind == "gpt2-bare" else ["GPT2LMHeadModel"]
        name = "gpt2" if kind == "gpt2-bare" else "GPT2LMHeadModel"
    else:
        cfg = tf.PhiConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2)
        cfg.architectures = ["PhiForCausalLM"]
        name = "PhiForCausalLM"
    cfg.save_pretrained(tmp_path)
    with pytest.raises(SpeccError, match=name) as info:
        load_model(tmp_path, with_tokenizer=False)
    assert "not supported" in str(info.value)
    with pytest.raises(SpeccError, match=name):
        check_architecture(cfg)


@torch.no_grad()
def test_truncated_module_matches_truncated_hf():
    model = tiny_model("qwen2", seed=8, layers=3)
    ids = prompt(8, seed=8)
    short = copy.deepcopy(model)
    short.model.layers = short.model.layers[:1]
    short.config.num_hidden_layers = 1
    if getattr(short.config, "layer_types", None):
        short.config.layer_types = short.config.layer_types[:1]
    ref = short(ids).logits
    assert not torch.allclose(ref, model(ids).logits, atol=1e-3)  # truncation changes the model
    tm = TargetModule(model, S, n_layers=1)
    assert len(tm.blocks) == 1
    torch.testing.assert_close(tm(*chunk_args(ids, 0))[0], ref, atol=ATOL, rtol=0)
    for bad in (0, 4):
        with pytest.raises(SpeccError):
            TargetModule(model, S, n_layers=bad)
