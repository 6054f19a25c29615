"""DFlash: a block-diffusion drafter conditioned on the target's hidden states (arXiv 2602.06036).

The drafter is a few Qwen3-style decoder layers with no embedding and no LM head of its own (it
uses the target's, frozen). One forward drafts a whole block: the input is [anchor, MASK x (B-1)]
at absolute positions start..start+B-1, attention inside the block is bidirectional, and every
layer also attends to the *context*: the fused hidden states of the committed tokens,
ctx = hidden_norm(fc(concat(target taps))), projected by that layer's own k_proj/v_proj (+ k_norm,
RoPE at the token's position). Context rows skip input_layernorm, q_proj and the MLP. Row k of the
block predicts the token at start + k, so rows 1..B-1 give B-1 drafts.

This module holds the model, the published checkpoint format (config.json + safetensors, key names
without a `model.` prefix), the checks that a drafter fits a target, and `DFlashStep`, the
batch-1 module with its own context KV cache that the compiler captures.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...draft_tokens import draft_slots, sampled_drafts, tree_drafts
from ...errors import SpeccError
from ...signature import DraftSignature, SampledChildren, parse_sampling
from ...target_module import additive_mask
from ...tree import Tree, chain

ARCHITECTURE = "DFlashDraftModel"


def default_layer_ids(n_target: int, n_taps: int) -> list[int]:
    """Target layers to tap, spread from the second to the third-to-last (0-based decoder-layer
    outputs): round(1 + i * (N - 4) / (L - 1)); a single tap takes the middle layer."""
    if n_taps < 1:
        raise SpeccError("a DFlash drafter needs at least one target layer to condition on.")
    if n_taps == 1:
        return [n_target // 2]
    # Clamped so that very shallow (test) targets still get valid ids.
    return [min(max(int(round(1 + i * (n_target - 4) / (n_taps - 1))), 0), n_target - 1) for i in range(n_taps)]


def choose_mask_token(tokenizer, vocab_size: int) -> int:
    """The MASK id. With a spare embedding row (vocab larger than the tokenizer) it is the first id
    past the tokenizer, as for Qwen3. Without one (SmolLM2: 49152 rows, 49152 tokens) it is the
    highest-numbered added token that is neither BOS, EOS, PAD nor used by the chat template: a
    token ordinary prompts never contain (for SmolLM2, `<empty_output>`, id 16). Its embedding row is
    frozen; the drafter only learns what that row means at a block position."""
    n_tok = len(tokenizer)
    if vocab_size > n_tok:
        return n_tok
    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    template = getattr(tokenizer, "chat_template", None) or ""
    candidates = [i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items()
                  if i not in reserved and i < vocab_size and str(tok) not in template]
    if not candidates:
        raise SpeccError("the target has no spare embedding row and no unused added token to serve as the "
                         "DFlash MASK token; pass --mask-token-id.")
    return max(candidates)


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    extra: dict = field(default_factory=dict)  # other config.json fields, kept for the round trip

    def to_json(self) -> dict:
        d = dict(self.extra)
        d.update({
            "architectures": [ARCHITECTURE], "model_type": "qwen3", "hidden_act": "silu",
            "attention_bias": False, "tie_word_embeddings": False,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "block_size": self.block_size, "num_target_layers": self.num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
        })
        return d

    @classmethod
    def from_json(cls, d: dict) -> "DFlashConfig":
        try:
            dc = d["dflash_config"]
            rope = d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)
            known = {"architectures", "model_type", "hidden_act", "attention_bias", "tie_word_embeddings",
                     "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_theta",
                     "max_position_embeddings", "block_size", "num_target_layers", "dflash_config"}
            heads = d["num_attention_heads"]
            return cls(hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                       num_layers=d["num_hidden_layers"], num_heads=heads,
                       num_kv_heads=d.get("num_key_value_heads") or heads,
                       head_dim=d.get("head_dim") or d["hidden_size"] // heads, vocab_size=d["vocab_size"],
                       block_size=int(d["block_size"]), mask_token_id=int(dc["mask_token_id"]),
                       target_layer_ids=[int(i) for i in dc["target_layer_ids"]],
                       num_target_layers=int(d["num_target_layers"]), rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                       rope_theta=float(rope), max_position_embeddings=d.get("max_position_embeddings", 8192),
                       extra={k: v for k, v in d.items() if k not in known})
        except (KeyError, TypeError, ValueError) as e:
            raise SpeccError(f"the DFlash config.json lacks or garbles field {e}; it is not a DFlash drafter.") from None


def dflash_config_for(target_config, num_layers: int = 1, block_size: int = 16, num_taps: int = 3,
                      mask_token_id: int = 0, layer_ids: list[int] | None = None) -> DFlashConfig:
    """A drafter shaped for this target: its hidden size, heads, vocabulary and RoPE base."""
    heads = target_config.num_attention_heads
    rope = getattr(target_config, "rope_theta", None) or (getattr(target_config, "rope_parameters", None) or {}).get(
        "rope_theta", 10000.0)
    n = target_config.num_hidden_layers
    return DFlashConfig(
        hidden_size=target_config.hidden_size, intermediate_size=target_config.intermediate_size,
        num_layers=num_layers, num_heads=heads, num_kv_heads=getattr(target_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
        vocab_size=target_config.vocab_size, block_size=block_size, mask_token_id=mask_token_id,
        target_layer_ids=list(layer_ids) if layer_ids is not None else default_layer_ids(n, num_taps),
        num_target_layers=n, rms_norm_eps=target_config.rms_norm_eps, rope_theta=float(rope),
        max_position_embeddings=getattr(target_config, "max_position_embeddings", 8192))


# ------------------------------------------------------------------------------------ model


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope(x, cos, sin):
    """x [..., N, D] rotated by cos/sin [N, D] (the rotate-half convention of Llama/Qwen)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_tables(positions, head_dim: int, theta: float, dtype, device=None):
    """cos/sin [N, head_dim] at `positions` [N]; `device`: where the frequencies are made (training on
    CUDA passes the positions' device; the step modules the compiler captures leave it unset)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, D
        self.q_proj = nn.Linear(H, cfg.num_heads * D, bias=False)
        self.k_proj = nn.Linear(H, cfg.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, cfg.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * D, H, bias=False)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def kv(self, x, cos, sin):
        """K/V [KV, N, D] of rows x [N, H] at the positions of cos/sin [N, D]."""
        N = x.shape[0]
        k = self.k_norm(self.k_proj(x).view(N, self.n_kv, self.head_dim)).transpose(0, 1)
        v = self.v_proj(x).view(N, self.n_kv, self.head_dim).transpose(0, 1)
        return rope(k, cos, sin), v

    def forward(self, x, cos, sin, k_ctx, v_ctx, mask):
        """x [M, H] block rows (already normed); k_ctx/v_ctx [KV, N, D] context keys; mask [M, N + M]."""
        M = x.shape[0]
        KV, D = self.n_kv, self.head_dim
        G = self.n_heads // KV
        q = self.q_norm(self.q_proj(x).view(M, self.n_heads, D)).transpose(0, 1)
        q = rope(q, cos, sin)
        k_blk, v_blk = self.kv(x, cos, sin)
        k = torch.cat((k_ctx, k_blk), dim=1)
        v = torch.cat((v_ctx, v_blk), dim=1)
        # Heads h = kv * G + g share kv head kv: fold g into the query length, never copy K/V.
        qg = q.reshape(KV, G * M, D)
        mg = mask.repeat(G, 1) if G > 1 else mask
        o = F.scaled_dot_product_attention(qg.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mg[None, None])
        o = o[0].reshape(self.n_heads, M, D).transpose(0, 1).reshape(M, self.n_heads * D)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, k_ctx, v_ctx, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_ctx, v_ctx, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """The drafter's own weights, under the published key names."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        L = len(cfg.target_layer_ids)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(L * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def context(self, taps):
        """taps [N, L*H] (the target layers' outputs side by side) -> context features [N, H]."""
        return self.hidden_norm(self.fc(taps))

    def forward(self, x, positions, ctx, ctx_positions, mask):
        """x [M, H] block-row embeddings at `positions` [M]; ctx [N, H] at `ctx_positions` [N];
        mask [M, N + M] additive. Returns the final-normed hidden states [M, H]."""
        cfg = self.config
        cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta, x.dtype, positions.device)
        ccos, csin = rope_tables(ctx_positions, cfg.head_dim, cfg.rope_theta, x.dtype, ctx_positions.device)
        for layer in self.layers:
            k_ctx, v_ctx = layer.self_attn.kv(ctx, ccos, csin)
            x = layer(x, cos, sin, k_ctx, v_ctx, mask)
        return self.norm(x)


def block_mask(anchors, ctx_len: int, block_size: int, lengths=None, ctx_from=None) -> torch.Tensor:
    """Training mask [nb*B, ctx_len + nb*B]: block j (anchor at position a_j) sees context rows at
    positions < a_j and its own rows (bidirectionally); nothing else. With `lengths` [nb], block j
    is only its first lengths[j] rows as keys: the block an engine running blocks of that size sees
    (its rows past the length are computed but see nothing they would not, and are not scored).
    With `ctx_from` [nb] (several sequences packed into one record), block j sees only context rows
    from ctx_from[j] on: its own sequence's. Made on the anchors' device."""
    nb, B, dev = anchors.shape[0], block_size, anchors.device
    row_block = torch.arange(nb * B, device=dev) // B
    cols = torch.arange(ctx_len, device=dev).view(1, -1)
    ctx_ok = cols < anchors[row_block].view(-1, 1)
    if ctx_from is not None:
        ctx_ok = ctx_ok & (cols >= ctx_from[row_block].view(-1, 1))
    blk_ok = row_block.view(-1, 1) == row_block.view(1, -1)
    if lengths is not None:
        blk_ok = blk_ok & ((torch.arange(nb * B, device=dev) % B) < lengths[row_block]).view(1, -1)
    return additive_mask(torch.cat((ctx_ok, blk_ok), dim=1))


def segment_starts(segments, device=None) -> torch.Tensor:
    """Per position [N], the first position of its sequence in a record that packs sequences of
    lengths `segments` [K] back to back."""
    segments = segments.to(device) if device is not None else segments
    starts = torch.cumsum(segments, 0) - segments
    return torch.repeat_interleave(starts, segments)


def block_hidden(drafter: DFlashDrafter, embed: nn.Module, taps, tokens, anchors, block_size: int | None = None,
                 lengths=None, starts=None):
    """Teacher-forced training forward over one sequence. taps [N, L*H] are the target's features of
    tokens [N]; each anchor a starts a block [tokens[a], MASK, ...] of `block_size` rows (default: the
    trained size) at positions a..a+B-1; `lengths` [nb] optionally shortens blocks (see block_mask).
    `starts` [N] (segment_starts): the record packs several sequences; each position's RoPE position
    counts from its sequence's start and a block sees its own sequence's context only, so every block
    computes what it would in its sequence alone. Returns every block row's final-normed hidden state
    [nb, B, H]."""
    cfg = drafter.config
    B, nb, dev = block_size or cfg.block_size, anchors.shape[0], tokens.device
    block = torch.full((nb, B), cfg.mask_token_id, dtype=torch.long, device=dev)
    block[:, 0] = tokens[anchors]
    offset = starts[anchors] if starts is not None else torch.zeros_like(anchors)
    positions = (anchors.view(-1, 1) - offset.view(-1, 1) + torch.arange(B, device=dev)).reshape(-1)
    ctx_positions = torch.arange(taps.shape[0], device=dev)
    if starts is not None:
        ctx_positions = ctx_positions - starts
    x = embed(block.reshape(-1))
    ctx = drafter.context(taps)
    mask = block_mask(anchors, taps.shape[0], B, lengths, offset if starts is not None else None)
    h = drafter(x, positions, ctx, ctx_positions, mask)
    return h.view(nb, B, -1)


def draft_logits(drafter: DFlashDrafter, embed: nn.Module, lm_head_weight, taps, tokens, anchors,
                 block_size: int | None = None, lengths=None):
    """block_hidden's rows 1..B-1 through the LM head: logits [nb, B-1, V], row k-1 of block j
    predicts the token at a_j + k (with lm_head_weight None: the rows' hidden states [nb, B-1, H],
    for a head applied to some rows only)."""
    h = block_hidden(drafter, embed, taps, tokens, anchors, block_size, lengths)[:, 1:]
    return h if lm_head_weight is None else F.linear(h, lm_head_weight)


def trained_blocks(block_size: int) -> list[int]:
    """The block lengths `specc train` trains a drafter of `block_size` rows on (each training block
    takes one of them): 4, 8, 16, ... below it, and itself. Rows attend to each other both ways, so a
    row's output depends on its block's length: an engine runs one of these lengths."""
    return sorted({b for b in (4, 8, 16, 32, 64) if b < block_size} | {block_size})


def run_block(block_size: int, rows: int) -> int:
    """The block length an engine runs for `rows` drafting rows: the shortest trained length that has
    them (trained_blocks), or the trained size."""
    return min([b for b in trained_blocks(block_size) if b >= rows] or [block_size])


def position_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """Loss weight of block position k = 1..B-1: exp(-(k-1)/gamma); gamma 7/5/4 for B = 16/10/8."""
    if gamma is None:
        gamma = {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, 7.0 * block_size / 16))
    return torch.exp(-(torch.arange(1, block_size, dtype=torch.float32) - 1) / gamma)


# ------------------------------------------------------------------------------ checkpoint


def save_dflash(drafter: DFlashDrafter, path) -> Path:
    """Write the published directory format: config.json + model.safetensors (no embedding, no head)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(drafter.config.to_json(), indent=1))
    save_file({k: v.detach().contiguous() for k, v in drafter.state_dict().items()}, str(path / "model.safetensors"))
    return path


def load_dflash(path, dtype=torch.float32) -> DFlashDrafter:
    """Read a DFlash directory (config.json + *.safetensors), strictly by the published key names."""
    raw, weights = read_checkpoint(path, ARCHITECTURE, "DFlash")
    return load_strictly(DFlashDrafter(DFlashConfig.from_json(raw)), weights, path, "DFlash", dtype)


def read_checkpoint(path, architecture: str, what: str) -> tuple[dict, dict]:
    """(config.json, weights without a `model.` prefix) of a drafter directory whose config.json
    names `architecture`; `what` names the kind in messages."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").is_file():
        raise SpeccError(f"{what} drafter {str(path)!r} has no config.json; give a {what} checkpoint directory.")
    try:
        raw = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise SpeccError(f"{path / 'config.json'} is not valid JSON ({e.msg} at line {e.lineno}).") from None
    if architecture not in (raw.get("architectures") or []):
        raise SpeccError(f"{str(path)!r} is not a {what} drafter (config.json architectures is "
                         f"{raw.get('architectures')}, expected {architecture}).")
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise SpeccError(f"{what} drafter {str(path)!r} has no .safetensors weights.")
    weights = {}
    for s in shards:
        weights.update(load_file(str(s)))
    return raw, {k.removeprefix("model."): v for k, v in weights.items()}


def load_strictly(drafter: nn.Module, weights: dict, path, what: str, dtype) -> nn.Module:
    """`drafter` with exactly `weights` (same names, same shapes), in `dtype`, frozen, in eval mode."""
    own = drafter.state_dict()
    missing = [k for k in own if k not in weights]
    unexpected = [k for k in weights if k not in own]
    if missing or unexpected:
        which = f"lacks weight {missing[0]!r}" if missing else f"has unexpected weight {unexpected[0]!r}"
        raise SpeccError(f"{what} drafter {str(path)!r} {which}; it does not match its config.json.")
    for k, v in own.items():
        if weights[k].shape != v.shape:
            raise SpeccError(f"{what} weight {k!r} has shape {tuple(weights[k].shape)}, its config.json "
                             f"implies {tuple(v.shape)}.")
    drafter.load_state_dict(weights)
    return drafter.to(dtype).eval().requires_grad_(False)


def check_fits(cfg: DFlashConfig, target_config, what: str = "DFlash", least_block: int = 2) -> None:
    """Refuse a drafter whose hidden size, target layers or vocabulary do not fit the target (`what`:
    the kind, for messages; `least_block`: the shortest block that drafts a token)."""
    n = target_config.num_hidden_layers
    if cfg.hidden_size != target_config.hidden_size:
        raise SpeccError(f"the {what} drafter's hidden size ({cfg.hidden_size}) differs from the target's "
                         f"({target_config.hidden_size}); it was trained for another model.")
    if cfg.vocab_size != target_config.vocab_size:
        raise SpeccError(f"the {what} drafter's vocabulary ({cfg.vocab_size}) differs from the target's "
                         f"({target_config.vocab_size}); it was trained for another model.")
    if cfg.num_target_layers != n or any(not 0 <= i < n for i in cfg.target_layer_ids):
        raise SpeccError(f"the {what} drafter taps target layers {cfg.target_layer_ids} of a "
                         f"{cfg.num_target_layers}-layer model, but the target has {n} layers.")
    if not 0 <= cfg.mask_token_id < target_config.vocab_size:
        raise SpeccError(f"the {what} MASK token {cfg.mask_token_id} is outside the target's vocabulary "
                         f"of {target_config.vocab_size}.")
    if cfg.block_size < least_block:
        raise SpeccError(f"the {what} block size {cfg.block_size} leaves no draft tokens; it must be at least "
                         f"{least_block}.")


# ------------------------------------------------------------------------- step module


class DFlashStep(nn.Module):
    """Batch-1 drafting with a static context cache, the module the compiler captures.

    forward(*DraftSignature): taps [R, L*H], next_tokens [R], ctx_start [], n_ctx [] -> drafts [T-1].
    The first n_ctx rows of taps are the features of the committed tokens at positions ctx_start..
    (padding after them); their K/V go into each layer's cache at slot = position. The anchor is
    next_tokens[n_ctx - 1], the token after the last row. The block [anchor, MASK...] then
    sits at positions start = ctx_start + n_ctx .., sees every cached slot < start and itself, and
    its rows 1..B-1 go through the target's LM head. Tree node i takes the candidate of rank
    ranks[i] at block position depths[i] (argmax for a chain). Padding rows write slots >= start,
    which no block sees before a later call overwrites them.

    `sampled=True` (`--children sampled`): in a sampling mode forward also takes the mode's sampling
    inputs (uniforms [(B-1) * width]) and returns (drafts, q [B-1, V]): the drafts are draws from q,
    the drafter's distribution at each block position (draft_tokens.sampled_drafts)."""

    FIRST_ROW = 1  # the first block row that drafts (DSpark's anchor row drafts too)
    NAME = "DFlash"

    def __init__(self, drafter: DFlashDrafter, embed_tokens: nn.Module, lm_head_weight: torch.Tensor,
                 cache_len: int, block_size: int | None = None, tree: Tree | None = None, sampled: bool = False):
        super().__init__()
        self.sampled = sampled
        cfg = drafter.config
        # A drafter trained on blocks of B also runs on shorter ones (not the reverse).
        self.block_size = cfg.block_size if block_size is None else block_size
        first, least = self.FIRST_ROW, self.FIRST_ROW + 1
        if not least <= self.block_size <= cfg.block_size:
            raise SpeccError(f"a {self.NAME} drafter trained on blocks of {cfg.block_size} runs on blocks of {least} "
                             f"to {cfg.block_size}, not {self.block_size}.")
        self.tree = tree = chain(self.block_size - first) if tree is None else tree
        if tree.max_depth > self.block_size - first:
            raise SpeccError(f"a token tree of depth {tree.max_depth} needs a {self.NAME} block of at least "
                             f"{tree.max_depth + first}, not {self.block_size}.")
        depth, rank, self.width = draft_slots(tree)
        self.q_rows = self.block_size - first  # one distribution per drafted block position
        self.register_buffer("draft_depth", depth, persistent=False)
        self.register_buffer("draft_rank", rank, persistent=False)
        self.drafter = drafter
        self.embed_tokens = embed_tokens
        # The target's own tensor, registered (not a plain attribute, which export would bake in as a constant).
        self.lm_head_weight = nn.Parameter(lm_head_weight, requires_grad=False)
        self.cache_len = cache_len
        dtype = drafter.fc.weight.dtype
        # [1, KV, S, D]: the target's cache layout, the one TensorRT's in-place KV update takes (4-D, axis -2)
        for i in range(cfg.num_layers):
            self.register_buffer(f"k_cache_{i}", torch.zeros(1, cfg.num_kv_heads, cache_len, cfg.head_dim, dtype=dtype),
                                 persistent=False)
            self.register_buffer(f"v_cache_{i}", torch.zeros(1, cfg.num_kv_heads, cache_len, cfg.head_dim, dtype=dtype),
                                 persistent=False)

    def signature(self, mode: str = "greedy") -> DraftSignature:
        vocab = self.lm_head_weight.shape[0]
        return DraftSignature(SampledChildren(self.q_rows, vocab, self.width) if self.sampled else None, mode)

    def example_inputs(self, rows: int, mode: str = "greedy") -> tuple:
        return self.signature(mode).example_inputs(rows, self.drafter.fc.in_features, self.drafter.fc.weight.dtype)

    def forward(self, taps, next_tokens, ctx_start, n_ctx, *sampling_args):
        s = parse_sampling(sampling_args)  # none in greedy mode: top-k drafts
        h, _ = self.block_rows(taps, next_tokens, ctx_start, n_ctx)
        logits = F.linear(h, self.lm_head_weight)
        if self.sampled and s.mode != "greedy":
            return sampled_drafts(logits, self.draft_depth, self.draft_rank, self.width, s.temperature, s.top_p,
                                  s.uniforms)
        return tree_drafts(logits, self.draft_depth, self.draft_rank, self.width)

    def block_rows(self, taps, next_tokens, ctx_start, n_ctx):
        """Cache the context rows, run the block: (its drafting rows' final-normed hidden states
        [B - FIRST_ROW, H], the anchor [1])."""
        cfg = self.drafter.config
        anchor = next_tokens.index_select(0, (n_ctx - 1).view(1))
        R, B, S = taps.shape[0], self.block_size, self.cache_len
        ctx_pos = torch.arange(R) + ctx_start
        start = ctx_start + n_ctx
        positions = torch.arange(B) + start
        block = torch.full((B,), cfg.mask_token_id, dtype=torch.long)
        block = torch.cat((anchor.view(1), block[1:]))
        x = self.embed_tokens(block)
        ctx = self.drafter.context(taps)
        cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
        ccos, csin = rope_tables(ctx_pos, cfg.head_dim, cfg.rope_theta, x.dtype)
        seen = torch.arange(S).view(1, S) < start
        mask = additive_mask(torch.cat((seen.expand(B, S), torch.ones(B, B, dtype=torch.bool)), dim=1), x.dtype)
        for i, layer in enumerate(self.drafter.layers):
            k_cache, v_cache = getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")
            k_new, v_new = layer.self_attn.kv(ctx, ccos, csin)
            k_cache.index_copy_(2, ctx_pos, k_new.unsqueeze(0))
            v_cache.index_copy_(2, ctx_pos, v_new.unsqueeze(0))
            x = layer(x, cos, sin, k_cache[0], v_cache[0], mask)
        return self.drafter.norm(x)[self.FIRST_ROW:], anchor

