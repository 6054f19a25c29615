"""MTP heads: row alignment, concat order, recursion, checkpoint round trips and refusals, training."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny import tiny_model  # noqa: E402

from specc.errors import SpeccError  # noqa: E402
from specc.drafters.mtp.model import (MTP_FILE, build_heads, load_deepseek_v3, load_mtp,  # noqa: E402
                                      load_qwen3_next, mtp_loss, reference_drafts, save_deepseek_v3,
                                      save_qwen3_next, target_hidden, target_parts)

V = 64


def seq(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (1, n), generator=torch.Generator().manual_seed(seed))


def random_heads(model, seed: int = 0, **kw):
    """Heads with every weight random, norms included (all-ones norms would hide a swapped norm)."""
    torch.manual_seed(seed)
    heads = build_heads(model, **kw)
    with torch.no_grad():
        for name, p in heads.named_parameters():
            p.normal_(1.0, 0.3) if p.dim() == 1 else p.normal_(0, 0.2)
    return heads.eval()


def target(arch: str = "llama", seed: int = 0, **kw):
    model = tiny_model(arch, seed=seed, **kw)
    with torch.no_grad():
        model.model.norm.weight.normal_(1.0, 0.3)  # a non-trivial final norm: pre- and post-norm differ
    return model


@torch.no_grad()
def train_logits(heads, model, ids, depth=None):
    h, _ = target_hidden(model, ids)
    return heads.forward_train(h, ids, **target_parts(model), depth=depth)


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def one_sentence(err) -> str:
    msg = str(err.value)
    assert "\n" not in msg and msg.endswith(".") and ". " not in msg, msg
    return msg


# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def test_target_hidden_is_post_norm_lm_head_input():
    """Facts of this transformers version: hidden_states[-1] is the post-final-norm hidden."""
    model = target("llama")
    ids = seq(9)
    h, logits = target_hidden(model, ids)
    out = model(ids, output_hidden_states=True)
    torch.testing.assert_close(logits, out.logits, atol=0, rtol=0)
    torch.testing.assert_close(model.lm_head(h), out.logits, atol=0, rtol=0)
    assert torch.equal(out.hidden_states[-1], h)
    pre = []
    hook = model.model.layers[-1].register_forward_hook(lambda m, i, o: pre.append(o[0] if isinstance(o, tuple) else o))
    model(ids)
    hook.remove()
    torch.testing.assert_close(model.model.norm(pre[0]), h)
    assert not torch.allclose(pre[0], h)


def test_shapes_and_loss_alignment():
    model = target("llama")
    heads = random_heads(model, num_modules=2, depth=3)
    ids = seq(10)
    logits = train_logits(heads, model, ids)
    assert [tuple(x.shape) for x in logits] == [(1, 9, V), (1, 8, V), (1, 7, V)]
    # Logits that put all mass on the label the docstring promises give (almost) zero loss.
    big = 50.0
    fake = [torch.nn.functional.one_hot(ids[:, d + 1:], V).float() * big for d in (1, 2, 3)]
    fake = [torch.cat([f, torch.zeros(1, 1, V)], dim=1) for f in fake]  # last row predicts past the end
    total, per = mtp_loss(fake, tokens=ids)
    assert float(total) < 1e-6 and len(per) == 3
    tgt = seq(10, seed=5)  # stands in for the target's argmax ids
    fake = [torch.nn.functional.one_hot(tgt[:, d:], V).float() * big for d in (1, 2, 3)]
    total, _ = mtp_loss(fake, target_ids=tgt)
    assert float(total) < 1e-6
    with pytest.raises(SpeccError):
        mtp_loss(fake)


@pytest.mark.parametrize("arch,own_norm", [("llama", False), ("qwen3", False), ("llama", True)])
def test_deepseek_round_trip(tmp_path, arch, own_norm):
    model = target(arch)
    heads = random_heads(model, num_modules=2, depth=3, has_final_norm=own_norm)
    out = save_deepseek_v3(heads, tmp_path / "ds", model)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 2 and cfg["hidden_size"] == 32
    from safetensors import safe_open
    with safe_open(str(out / MTP_FILE), "pt") as st:
        keys = set(st.keys())
    for j in (2, 3):  # num_hidden_layers + j
        p = f"model.layers.{j}."
        assert {p + k for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "self_attn.q_proj.weight",
                                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.down_proj.weight",
                                "input_layernorm.weight", "post_attention_layernorm.weight",
                                "shared_head.norm.weight", "shared_head.head.weight", "embed_tokens.weight")} <= keys
        assert (p + "self_attn.q_norm.weight" in keys) == (arch == "qwen3")
    assert not any(k.startswith("model.layers.0.") for k in keys)

    ids = seq(12)
    ref = train_logits(heads, model, ids, depth=3)
    for src in (out, out / MTP_FILE):  # a directory, or one file read against the target's config
        loaded = load_deepseek_v3(src, model, depth=3)
        assert loaded.config.num_modules == 2 and loaded.config.has_final_norm == own_norm
        assert_same(train_logits(loaded, model, ids), ref)
    assert_same(train_logits(load_mtp(out, model, depth=3), model, ids), ref)


@torch.no_grad()
def test_deepseek_keys_in_extra_shard_beside_target(tmp_path):
    from transformers import AutoModelForCausalLM

    model = target("llama")
    d = tmp_path / "ckpt"
    model.save_pretrained(d, max_shard_size="20KB")  # several shards and an index of the target's keys
    assert (d / "model.safetensors.index.json").exists() and len(list(d.glob("model-*.safetensors"))) > 1
    heads = random_heads(model, num_modules=2)
    save_deepseek_v3(heads, d, model)  # the MTP keys in one more shard, config gains num_nextn_predict_layers
    ids = seq(11)
    assert_same(train_logits(load_mtp(d, model), model, ids), train_logits(heads, model, ids))
    # transformers still loads the target from the directory, ignoring the MTP shard.
    again = AutoModelForCausalLM.from_pretrained(d).eval()
    assert torch.equal(again(ids).logits, model(ids).logits)


@pytest.mark.parametrize("arch,n,own_norm", [("llama", 2, True), ("qwen3", 2, True), ("llama", 1, False)])
def test_qwen3_next_round_trip(tmp_path, arch, n, own_norm):
    model = target(arch)
    heads = random_heads(model, num_modules=n, depth=3, has_final_norm=own_norm,
                         feedback="normed" if own_norm else "block")
    with torch.no_grad():  # the layout shares fc and the norms between its layers
        for m in heads.mtp[1:]:
            for name in ("eh_proj", "enorm", "hnorm") + (("final_norm",) if own_norm else ()):
                getattr(m, name).weight.copy_(getattr(heads.mtp[0], name).weight)
    out = save_qwen3_next(heads, tmp_path / "qn", model)
    from safetensors import safe_open
    with safe_open(str(out / MTP_FILE), "pt") as st:
        keys = set(st.keys())
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.layers.0.self_attn.k_proj.weight", "mtp.layers.0.mlp.up_proj.weight"} <= keys
    assert ("mtp.norm.weight" in keys) == own_norm and (f"mtp.layers.{n - 1}.input_layernorm.weight" in keys)
    ids = seq(12, seed=3)
    ref = train_logits(heads, model, ids)
    loaded = load_qwen3_next(out, model, depth=3)
    assert loaded.config.feedback == ("normed" if own_norm else "block")
    assert_same(train_logits(loaded, model, ids), ref)
    assert_same(train_logits(load_mtp(out, model, depth=3), model, ids), ref)


def test_qwen3_next_save_refuses_unshared_fc(tmp_path):
    model = target("llama")
    heads = random_heads(model, num_modules=2)
    with pytest.raises(SpeccError) as err:
        save_qwen3_next(heads, tmp_path / "qn", model)
    assert "shares one fc" in one_sentence(err)


@torch.no_grad()
def test_concat_order(tmp_path):
    model = target("llama")
    a = random_heads(model, num_modules=1, depth=1)
    b = build_heads(model, num_modules=1, depth=1, order="hidden_emb")
    b.load_state_dict(a.state_dict())
    ids = seq(10, seed=1)
    seen = []
    hook = b.mtp[0].eh_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    la, lb = train_logits(a, model, ids)[0], train_logits(b, model, ids)[0]
    hook.remove()
    assert not torch.allclose(la, lb)
    h, _ = target_hidden(model, ids)
    m = b.mtp[0]
    want = torch.cat([m.hnorm(h[:, :9]), m.enorm(model.model.embed_tokens(ids[:, 1:]))], dim=-1)
    assert torch.equal(seen[0], want)
    # The order survives a save and load (specc records it in config.json).
    loaded = load_deepseek_v3(save_deepseek_v3(b, tmp_path / "b", model), model)
    assert loaded.config.order == "hidden_emb"
    assert torch.equal(train_logits(loaded, model, ids)[0], lb)


@pytest.mark.parametrize("arch,feedback", [("llama", "block"), ("qwen3", "block"), ("llama", "normed")])
@torch.no_grad()
def test_recursion_reuses_one_module_and_feeds_back_its_output(arch, feedback):
    """block: DeepSeek-V3 (block output fed back, target's final norm before the head);
    normed: Qwen3-Next with its own mtp.norm (used before the head and applied to the fed-back hidden)."""
    model = target(arch)
    own = feedback == "normed"
    heads = random_heads(model, num_modules=1, depth=3, has_final_norm=own, feedback=feedback)
    m = heads.mtp[0]
    assert heads.module_for(1) is m and heads.module_for(3) is m
    calls = []
    hook = m.layer.register_forward_hook(lambda mod, i, o: calls.append(o))
    ids = seq(10, seed=2)
    got = train_logits(heads, model, ids)
    hook.remove()
    assert len(calls) == 3

    # Hand-written loop: depth d row i combines the previous hidden at row i with Emb(t_{i+d}).
    h, _ = target_hidden(model, ids)
    norm = m.final_norm if own else model.model.norm
    N = ids.shape[1]
    for d in (1, 2, 3):
        R = N - d
        h = h[:, :R]
        e = model.model.embed_tokens(ids[:, d:d + R])
        x = m.eh_proj(torch.cat([m.enorm(e), m.hnorm(h)], dim=-1))
        pos = torch.arange(R).unsqueeze(0)
        mask = torch.zeros(R, R).masked_fill(torch.ones(R, R, dtype=torch.bool).triu(1), float("-inf"))
        h = m.layer(x, attention_mask=mask.view(1, 1, R, R), position_embeddings=model.model.rotary_emb(x, pos))
        h = h[0] if isinstance(h, tuple) else h
        torch.testing.assert_close(got[d - 1], model.lm_head(norm(h)), atol=1e-5, rtol=0)
        if own:
            h = m.final_norm(h)


def _rewrite(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file
    t = load_file(str(path))
    edit(t)
    save_file(t, str(path))


def test_refusals(tmp_path):
    model = target("llama")
    heads = random_heads(model, num_modules=1)

    # An MTP checkpoint of a hidden-48 model against the hidden-32 target.
    big = target("llama", hidden=48)
    d48 = save_deepseek_v3(random_heads(big), tmp_path / "h48", big)
    for load in (load_deepseek_v3, load_mtp):
        with pytest.raises(SpeccError) as err:
            load(d48, model)
        assert "hidden size 32" in one_sentence(err) and "[48, 96]" in str(err.value)
    q48 = save_qwen3_next(random_heads(big), tmp_path / "q48", big)
    with pytest.raises(SpeccError) as err:
        load_mtp(q48, model)
    assert "hidden size" in one_sentence(err)

    # A directory without MTP keys: the target's own checkpoint.
    plain = tmp_path / "plain"
    model.save_pretrained(plain)
    for load in (load_mtp, load_deepseek_v3, load_qwen3_next):
        with pytest.raises(SpeccError) as err:
            load(plain, model)
        assert "no" in one_sentence(err) and "MTP keys" in str(err.value)
    with pytest.raises(SpeccError) as err:
        load_mtp(tmp_path / "missing", model)
    one_sentence(err)

    # Vocabulary of shared_head differs.
    d = save_deepseek_v3(heads, tmp_path / "vocab", model)
    _rewrite(d / MTP_FILE, lambda t: t.update({"model.layers.2.shared_head.head.weight": torch.zeros(80, 32)}))
    with pytest.raises(SpeccError) as err:
        load_mtp(d, model)
    assert "vocabulary" in one_sentence(err) and "shared_head.head.weight" in str(err.value)

    # A layer weight of another shape, a missing key, an unexpected key: each named.
    wide = target("llama", intermediate_size=80)
    dw = save_deepseek_v3(random_heads(wide), tmp_path / "wide", wide)
    with pytest.raises(SpeccError) as err:
        load_mtp(dw, model)
    assert "model.layers.2.mlp." in one_sentence(err)
    d = save_deepseek_v3(heads, tmp_path / "missing_key", model)
    _rewrite(d / MTP_FILE, lambda t: t.pop("model.layers.2.self_attn.v_proj.weight"))
    with pytest.raises(SpeccError) as err:
        load_mtp(d, model)
    assert "lacks model.layers.2.self_attn.v_proj.weight" in one_sentence(err)
    d = save_deepseek_v3(heads, tmp_path / "extra_key", model)
    _rewrite(d / MTP_FILE, lambda t: t.update({"model.layers.2.mlp.experts.0.w1.weight": torch.zeros(4, 4)}))
    with pytest.raises(SpeccError) as err:
        load_mtp(d, model)
    assert "model.layers.2.mlp.experts.0.w1.weight" in one_sentence(err)


def test_training_lowers_loss_with_target_frozen():
    model = target("llama")
    heads = random_heads(model, num_modules=1, depth=2).train()
    ids = seq(32, seed=7)
    with torch.no_grad():
        h, logits = target_hidden(model, ids)
    parts = target_parts(model)
    opt = torch.optim.AdamW(heads.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        total, per = mtp_loss(heads.forward_train(h, ids, **parts), tokens=ids)
        opt.zero_grad()
        total.backward()
        opt.step()
        losses.append(float(total))
        assert len(per) == 2
    assert losses[-1] < 0.7 * losses[0], losses
    assert all(p.grad is None and not p.requires_grad for p in model.parameters())
    assert all(p.grad is not None for p in heads.parameters())
    # Distillation labels (the target's own argmax) score every row.
    total, _ = mtp_loss(heads.forward_train(h, ids, **parts), target_ids=logits.argmax(-1))
    assert torch.isfinite(total)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@torch.no_grad()
def test_reference_drafts(arch):
    model = target(arch)
    heads = random_heads(model, num_modules=2, depth=3)
    prefix = seq(9, seed=4)[0].tolist()
    out = reference_drafts(heads, model, prefix)
    assert len(out) == 4 and all(0 <= t < V for t in out)
    assert out[0] == int(model(torch.tensor([prefix])).logits[0, -1].argmax())
    # Same as teacher forcing over prefix + drafts: depth d's last prefix row gives draft d.
    h, _ = target_hidden(model, torch.tensor([prefix]))
    logits = heads.forward_train(h, torch.tensor([prefix + out[:-1]]), **target_parts(model))
    assert [int(x[0, -1].argmax()) for x in logits] == out[1:]
    assert [x.shape[1] for x in logits] == [9, 9, 9]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@torch.no_grad()
def test_layer_is_the_targets_class_and_capture_block_wraps_it(arch):
    from specc.target_module import Block, causal_mask
    from specc.drafters.mtp.model import MTPHeads, mtp_config_for

    model = target(arch)
    built = MTPHeads(mtp_config_for(model.config))  # the layer class found from the config alone
    assert type(built.mtp[0].layer) is type(model.model.layers[0])
    assert type(built.mtp[0].enorm) is type(model.model.norm)
    layer = random_heads(model).mtp[0].layer
    c = model.config
    block = Block(layer, 16, c.num_attention_heads, c.num_key_value_heads, c.hidden_size // c.num_attention_heads,
                  torch.float32)
    x = torch.randn(1, 7, 32, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(7).unsqueeze(0)
    cos, sin = model.model.rotary_emb(x, pos)
    got = block(x, cos.unsqueeze(1), sin.unsqueeze(1), pos[0], causal_mask(7, 0, 16))
    want = layer(x, attention_mask=causal_mask(7, 0, 7), position_embeddings=(cos, sin))
    torch.testing.assert_close(got, want[0] if isinstance(want, tuple) else want, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# Engines: the final-norm tap, MTPStep and the slow reference of its cached scheme


def mtp_step(heads, model, depth: int, cache_len: int = 64):
    from specc.drafters.mtp.model import MTPStep

    return MTPStep(heads, model.model.embed_tokens, model.model.norm, model.lm_head.weight, model.model.rotary_emb,
                   cache_len, depth)


@torch.no_grad()
def test_target_module_final_norm_tap():
    from specc.target_module import TargetModule, causal_mask

    model = target("llama")
    L = model.config.num_hidden_layers
    ids = seq(9, seed=2)
    tm = TargetModule(model, 16, taps=(L, 0))
    logits, final, first = tm(ids, torch.arange(9).view(1, 9), torch.arange(9), causal_mask(9, 0, 16))
    h, ref_logits = target_hidden(model, ids)
    torch.testing.assert_close(final, h, atol=1e-5, rtol=0)
    assert torch.equal(logits, model.lm_head(final).float())  # exactly the head's input
    hs = model(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(first, hs[1], atol=1e-5, rtol=0)  # layer taps unchanged
    with pytest.raises(SpeccError) as err:
        TargetModule(model, 16, taps=(L + 1,))
    assert f"tap {L + 1}" in one_sentence(err)


@pytest.mark.parametrize("arch,kw", [("llama", {}), ("qwen3", dict(has_final_norm=True, feedback="normed")),
                                     ("qwen2", dict(order="hidden_emb", has_final_norm=True))])
@torch.no_grad()
def test_step_module_matches_cached_scheme(arch, kw):
    """Rows fed in padded pieces, as the runtime feeds them (random padding: it must not matter);
    after each call the drafts equal the uncached reference of the scheme at that committed length."""
    from specc.drafters.mtp.model import cached_scheme_drafts

    model = target(arch)
    heads = random_heads(model, **kw)
    step = mtp_step(heads, model, depth=4)
    ids = seq(24, seed=1)[0].tolist()
    h = target_hidden(model, torch.tensor([ids]))[0][0]
    g = torch.Generator().manual_seed(0)
    R, done = 6, 0
    for N in (2, 9, 10, 13, 14, 20, 24):  # committed lengths; rows 0..N-2 have their hidden
        while done < N - 1:
            m = min(R, N - 1 - done)
            rows = torch.cat((h[done:done + m], torch.randn(R - m, h.shape[1], generator=g)))
            nxt = torch.tensor(ids[done + 1:done + m + 1] + torch.randint(0, V, (R - m,), generator=g).tolist())
            drafts = step(rows, nxt, torch.tensor(done), torch.tensor(m))
            done += m
        assert drafts.tolist() == cached_scheme_drafts(heads, model, ids[:N], 4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@torch.no_grad()
def test_depth_one_equals_teacher_forced_reference(arch):
    """Depth 1 of the cached scheme is exactly reference_drafts' d_1 (they differ only from depth 2)."""
    from specc.drafters.mtp.model import cached_scheme_drafts

    model = target(arch)
    for seed in range(4):
        heads = random_heads(model, seed=seed)
        prefix = seq(5 + 3 * seed, seed=seed)[0].tolist()
        t_n, d_1 = reference_drafts(heads, model, prefix, depth=1)
        committed = prefix + [t_n]  # the target's own next token, as a greedy engine commits it
        assert cached_scheme_drafts(heads, model, committed, 1) == [d_1]
        h = target_hidden(model, torch.tensor([prefix]))[0][0]
        step = mtp_step(heads, model, depth=1)
        n = len(prefix)
        assert step(h, torch.tensor(committed[1:]), torch.tensor(0), torch.tensor(n)).tolist() == [d_1]


def test_engines_refuse_several_modules():
    from specc.drafters.mtp.model import cached_scheme_drafts

    model = target("llama")
    heads = random_heads(model, num_modules=2)
    for make in (lambda: mtp_step(heads, model, depth=2), lambda: cached_scheme_drafts(heads, model, [1, 2, 3], 2)):
        with pytest.raises(SpeccError) as err:
            make()
        assert "one module" in one_sentence(err) and "2 modules" in str(err.value)


@torch.no_grad()
def test_normed_feedback_survives_the_deepseek_layout(tmp_path):
    """Qwen3-Next-style heads (own norm, normed feedback) written in the DeepSeek-V3 layout, as an
    engine stores them, load back the same even when their norm equals the target's, and with
    their trained depth."""
    from specc.drafters.mtp.model import FEEDBACK_KEY, cached_scheme_drafts

    model = target("llama")
    heads = random_heads(model, has_final_norm=True, feedback="normed", depth=3)
    heads.mtp[0].final_norm.weight.copy_(model.model.norm.weight)
    out = save_deepseek_v3(heads, tmp_path / "ds", model, shared_copies=False)
    assert json.loads((out / "config.json").read_text())[FEEDBACK_KEY] == "normed"
    from safetensors import safe_open
    with safe_open(str(out / MTP_FILE), "pt") as st:
        keys = set(st.keys())
    assert "model.layers.2.shared_head.norm.weight" in keys and "model.layers.2.shared_head.head.weight" not in keys
    loaded = load_mtp(out, model)
    assert loaded.config.feedback == "normed" and loaded.config.has_final_norm
    assert loaded.config.depth == 3  # the trained depth, recorded as mtp_depth
    committed = seq(10, seed=3)[0].tolist()
    assert cached_scheme_drafts(loaded, model, committed, 3) == cached_scheme_drafts(heads, model, committed, 3)
    ids = seq(12)
    assert_same(train_logits(loaded, model, ids, depth=3), train_logits(heads, model, ids, depth=3))
