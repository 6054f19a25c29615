"""DFlash drafter: layer-id rule, MASK choice, published checkpoint round trip, refusals, and the
step module with its context cache against the teacher-forced training forward."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import tiny_tokenizer  # noqa: E402
from tiny import tiny_model  # noqa: E402

from specc.drafters.dflash.model import (DFlashConfig, DFlashDrafter, DFlashStep, block_mask,  # noqa: E402
                                         check_fits, choose_mask_token, default_layer_ids, dflash_config_for,
                                         draft_logits, load_dflash, position_weights, save_dflash)
from specc.errors import SpeccError  # noqa: E402

PUBLISHED_KEYS = {"norm.weight", "fc.weight", "hidden_norm.weight"} | {
    f"layers.{i}.{k}" for i in range(2) for k in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")}


def random_drafter(target, layers=2, block=4, taps=2, seed=0) -> DFlashDrafter:
    torch.manual_seed(seed)
    d = DFlashDrafter(dflash_config_for(target.config, num_layers=layers, block_size=block, num_taps=taps,
                                        mask_token_id=5))
    with torch.no_grad():
        for name, p in d.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 if p.dim() > 1 else 1 + 0.1 * torch.randn_like(p))
    return d.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=4, layers=4)


def taps_of(target, tokens: list[int], ids: list[int]) -> torch.Tensor:
    """The target's decoder-layer outputs at `ids` side by side, [N, L*H] (HF index id + 1)."""
    with torch.no_grad():
        hs = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1][0] for i in ids], dim=-1)


def test_default_layer_ids():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(30, 3) == [1, 14, 27]
    assert default_layer_ids(30, 1) == [15]
    with pytest.raises(SpeccError):
        default_layer_ids(30, 0)


def test_mask_token_choice():
    tok = tiny_tokenizer()
    assert choose_mask_token(tok, len(tok) + 8) == len(tok)  # a spare row: the first id past the tokenizer
    tok.add_special_tokens({"additional_special_tokens": ["<meta_a>", "<meta_b>"]})
    b = tok.convert_tokens_to_ids("<meta_b>")
    assert choose_mask_token(tok, len(tok)) == b  # no spare row: the highest unused added token
    tok.chat_template = "<meta_b>{{ messages[0]['content'] }}"
    assert choose_mask_token(tok, len(tok)) == tok.convert_tokens_to_ids("<meta_a>")


def test_round_trip_published_format(target, tmp_path):
    d = random_drafter(target)
    path = save_dflash(d, tmp_path / "dflash")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 4
    assert cfg["dflash_config"] == {"mask_token_id": 5, "target_layer_ids": default_layer_ids(4, 2)}
    assert cfg["num_target_layers"] == 4 and cfg["num_hidden_layers"] == 2
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == PUBLISHED_KEYS
        assert tuple(f.get_tensor("fc.weight").shape) == (32, 2 * 32)
    back = load_dflash(path)
    tokens = torch.randint(0, 64, (20,), generator=torch.Generator().manual_seed(1))
    taps = taps_of(target, tokens.tolist(), d.config.target_layer_ids)
    anchors = torch.tensor([3, 9, 15])
    emb, head = target.model.embed_tokens, target.lm_head.weight
    assert torch.equal(draft_logits(d, emb, head, taps, tokens, anchors),
                       draft_logits(back, emb, head, taps, tokens, anchors))
    check_fits(back.config, target.config)


def test_load_accepts_model_prefix_and_rope_parameters(target, tmp_path):
    """Checkpoints written by other tools may prefix keys with `model.` and use transformers 5's rope_parameters."""
    from safetensors.torch import save_file

    d = random_drafter(target, seed=2)
    path = save_dflash(d, tmp_path / "d")
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_theta": cfg.pop("rope_theta"), "rope_type": "default"}
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({f"model.{k}": v.contiguous() for k, v in d.state_dict().items()}, str(path / "model.safetensors"))
    back = load_dflash(path)
    assert back.config.rope_theta == d.config.rope_theta
    assert all(torch.equal(a, b) for a, b in zip(d.state_dict().values(), back.state_dict().values()))


def one_sentence(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg.endswith(".")
    return msg


def test_refusals(target, tmp_path):
    d = random_drafter(target)
    with pytest.raises(SpeccError) as e:
        check_fits(DFlashConfig(**{**d.config.__dict__, "hidden_size": 48}), target.config)
    assert "hidden size" in one_sentence(e)
    with pytest.raises(SpeccError) as e:
        check_fits(DFlashConfig(**{**d.config.__dict__, "vocab_size": 80}), target.config)
    assert "vocabulary" in one_sentence(e)
    with pytest.raises(SpeccError) as e:
        check_fits(DFlashConfig(**{**d.config.__dict__, "target_layer_ids": [1, 7], "num_target_layers": 8}),
                   target.config)
    assert "layers" in one_sentence(e)
    # Damaged directories.
    path = save_dflash(d, tmp_path / "ok")
    with pytest.raises(SpeccError) as e:
        load_dflash(tmp_path / "nothing")
    one_sentence(e)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(SpeccError) as e:
        load_dflash(path)
    assert "not a DFlash" in one_sentence(e)
    (path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(SpeccError) as e:
        load_dflash(path)
    assert "lacks weight" in one_sentence(e)


def test_block_mask_and_weights():
    m = block_mask(torch.tensor([2, 5]), ctx_len=8, block_size=3)
    ok = m == 0
    assert ok.shape == (6, 14)
    assert ok[0, :2].all() and not ok[0, 2:8].any()  # block 0 sees context < 2
    assert ok[3, :5].all() and not ok[3, 5:8].any()
    assert ok[0, 8:11].all() and not ok[0, 11:].any()  # and its own block, bidirectionally
    assert ok[5, 11:].all() and not ok[5, 8:11].any()
    w = position_weights(16)
    assert w.shape == (15,) and w[0] == 1 and torch.isclose(w[7], torch.exp(torch.tensor(-1.0)))


@torch.no_grad()
@pytest.mark.parametrize("layers,block", [(1, 4), (2, 5)])
def test_step_module_matches_training_forward(target, layers, block):
    """Feeding the context in uneven padded pieces through the cache gives the same drafts as the
    teacher-forced forward that sees the whole sequence at once."""
    d = random_drafter(target, layers=layers, block=block, seed=layers)
    tokens = torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(7))
    ids = d.config.target_layer_ids
    taps = taps_of(target, tokens.tolist(), ids)
    emb, head = target.model.embed_tokens, target.lm_head.weight
    step = DFlashStep(d, emb, head, cache_len=48)
    R = 6
    start = 0
    for piece in (6, 2, 5, 1, 6, 3):  # context rows committed per call
        rows = taps[start:start + piece]
        padded = torch.cat((rows, torch.randn(R - piece, rows.shape[1])))  # padding must not matter
        anchor = start + piece
        # Row i pairs with the token after it (the DraftSignature); the last one is the block's anchor.
        nxt = torch.cat((tokens[start + 1: anchor + 1], torch.randint(0, 64, (R - piece,))))
        drafts = step(padded, nxt, torch.tensor(start), torch.tensor(piece))
        ref = draft_logits(d, emb, head, taps, tokens, torch.tensor([anchor]))[0].argmax(-1)
        assert drafts.tolist() == ref.tolist()
        logits_ref = draft_logits(d, emb, head, taps, tokens, torch.tensor([anchor]))
        assert logits_ref.shape == (1, block - 1, 64)
        start += piece


def test_training_forward_learns(target):
    """A few AdamW steps on the position-weighted loss lower it; the target's tensors get no gradient."""
    torch.manual_seed(0)
    d = DFlashDrafter(dflash_config_for(target.config, num_layers=1, block_size=4, num_taps=2, mask_token_id=5))
    tokens = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(3))
    taps = taps_of(target, tokens.tolist(), d.config.target_layer_ids)
    anchors = torch.arange(1, 36, 3)
    labels = tokens[anchors.view(-1, 1) + torch.arange(1, 4)]
    w = position_weights(4)
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    emb, head = target.model.embed_tokens, target.lm_head.weight

    def loss_fn():
        logits = draft_logits(d, emb, head, taps, tokens, anchors)
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1), reduction="none")
        return (ce.view(-1, 3) * w).sum() / (w.sum() * len(anchors))

    first = float(loss_fn())
    for _ in range(40):
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
    assert float(loss_fn()) < 0.7 * first
    assert all(p.grad is None for p in target.parameters())


@torch.no_grad()
def test_step_module_runs_shorter_blocks(target):
    """A drafter trained on blocks of 5 run on blocks of 3 equals the same weights configured for 3."""
    d = random_drafter(target, layers=1, block=5, seed=9)
    short = DFlashDrafter(DFlashConfig(**{**d.config.__dict__, "block_size": 3}))
    short.load_state_dict(d.state_dict())
    tokens = torch.randint(0, 64, (20,), generator=torch.Generator().manual_seed(2))
    taps = taps_of(target, tokens.tolist(), d.config.target_layer_ids)
    emb, head = target.model.embed_tokens, target.lm_head.weight
    step = DFlashStep(d, emb, head, cache_len=32, block_size=3)
    drafts = step(taps[:12], tokens[1:13], torch.tensor(0), torch.tensor(12))
    ref = draft_logits(short, emb, head, taps, tokens, torch.tensor([12]))[0].argmax(-1)
    assert drafts.tolist() == ref.tolist() and len(drafts) == 2
    with pytest.raises(SpeccError, match="blocks of 2 to 5"):
        DFlashStep(d, emb, head, cache_len=32, block_size=6)


@torch.no_grad()
def test_shortened_training_blocks_equal_run_time_blocks(target):
    """Training on blocks of B with per-block lengths scores, for a block of length b, exactly the
    drafts an engine running blocks of b makes: draft_logits(block_size=b), and DFlashStep(block_size=b)."""
    d = random_drafter(target, layers=2, block=6, seed=4)
    tokens = torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(5))
    taps = taps_of(target, tokens.tolist(), d.config.target_layer_ids)
    emb, head = target.model.embed_tokens, target.lm_head.weight
    anchors, lengths = torch.tensor([8, 13, 20]), torch.tensor([3, 6, 2])
    mixed = draft_logits(d, emb, head, taps, tokens, anchors, lengths=lengths)
    for j, (a, b) in enumerate(zip(anchors.tolist(), lengths.tolist())):
        alone = draft_logits(d, emb, head, taps, tokens, anchors[j:j + 1], block_size=b)[0]
        torch.testing.assert_close(mixed[j, : b - 1], alone, rtol=1e-4, atol=1e-4)
        step = DFlashStep(d, emb, head, cache_len=40, block_size=b)
        assert step(taps[:a], tokens[1: a + 1], torch.tensor(0), torch.tensor(a)).tolist() == alone.argmax(-1).tolist()
