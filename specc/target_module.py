"""The captured target: a batch-1 module with a static KV cache held as buffers.

`TargetModule` runs a Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) over the Hugging Face
model's own weights and submodules (embedding, norms, activation, rotary embedding). What it adds is what a static step graph needs:

* the KV cache is one pair of registered buffers per layer, [1, n_kv_heads, cache_len, head_dim],
  written in place with index_copy_ at explicit cache positions;
* positions and the additive float mask [1, 1, T, cache_len] are inputs, so the same module
  serves a causal prefill chunk and a token tree;
* grouped-query attention folds the query group into the query length instead of repeating
  K/V over the whole cache;
* q/k/v and gate/up projections are fused into one weight each ([out, in], as nn.Linear keeps
  them), so a decode step makes one matrix-vector product per group;
* any decoder layer's output, or the hidden after the final norm, can be returned as a tap.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .errors import SpeccError
from .models import check_architecture
from .quant import linear  # a float weight, or a quantized one (specc/quant.py)

NEG_INF = -1e9  # large negative, not -inf: a fully masked row stays finite instead of NaN


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _fused_weight(*linears) -> nn.Parameter:
    """The given projections stacked along the output dimension, [out, in] contiguous: each row is
    one output's dot product, read as one contiguous stream (what the `matvec` pass relies on)."""
    w = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    return nn.Parameter(w.contiguous(), requires_grad=False)


def _fused_bias(*linears):
    if all(lin.bias is None for lin in linears):
        return None
    return nn.Parameter(torch.cat([lin.bias.detach() if lin.bias is not None else
                                   torch.zeros(lin.out_features, dtype=lin.weight.dtype) for lin in linears]),
                        requires_grad=False)


class Block(nn.Module):
    """One decoder layer (fused projection weights) plus its slice of the KV cache."""

    def __init__(self, layer, cache_len: int, n_heads: int, n_kv: int, head_dim: int, dtype, share=None):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.q_norm = getattr(attn, "q_norm", None)  # Qwen3 normalises q and k per head
        self.k_norm = getattr(attn, "k_norm", None)
        self.act_fn = mlp.act_fn
        if share is not None:  # a truncated draft model reuses the target's tensors
            self.wqkv, self.bqkv, self.wo, self.w_gate_up, self.w_down = (
                share.wqkv, share.bqkv, share.wo, share.w_gate_up, share.w_down)
        else:
            self.wqkv = _fused_weight(attn.q_proj, attn.k_proj, attn.v_proj)
            self.bqkv = _fused_bias(attn.q_proj, attn.k_proj, attn.v_proj)  # Qwen2 has q/k/v biases
            self.wo = _fused_weight(attn.o_proj)
            self.w_gate_up = _fused_weight(mlp.gate_proj, mlp.up_proj)
            self.w_down = _fused_weight(mlp.down_proj)
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self.scaling = getattr(attn, "scaling", head_dim ** -0.5)
        self.register_buffer("k_cache", torch.zeros(1, n_kv, cache_len, head_dim, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(1, n_kv, cache_len, head_dim, dtype=dtype), persistent=False)

    def forward(self, x, cos, sin, cache_pos, mask):
        T = x.shape[1]
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        qkv = linear(self.input_layernorm(x), self.wqkv, self.bqkv)
        q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)
        q, k, v = q.view(1, T, H, D), k.view(1, T, KV, D), v.view(1, T, KV, D).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        self.k_cache.index_copy_(2, cache_pos, k)
        self.v_cache.index_copy_(2, cache_pos, v)
        # Heads h = kv * G + g share kv head kv: fold g into the query length, never copy K/V.
        G = H // KV
        qg = q.reshape(1, KV, G * T, D)
        mg = mask.repeat(1, 1, G, 1) if G > 1 else mask
        o = F.scaled_dot_product_attention(qg, self.k_cache, self.v_cache, attn_mask=mg, scale=self.scaling)
        o = o.reshape(1, H, T, D).transpose(1, 2).reshape(1, T, H * D)
        x = x + linear(o, self.wo)
        gate, up = linear(self.post_attention_layernorm(x), self.w_gate_up).chunk(2, dim=-1)
        return x + linear(self.act_fn(gate) * up, self.w_down)


class TargetModule(nn.Module):
    """forward(tokens [1,T], positions [1,T], cache_pos [T], mask [1,1,T,S]) -> (logits [1,T,V], *taps).

    `taps`: the hidden states [1,T,H] to return beside the logits, in the order given. Tap i < n_layers
    is decoder layer i's output; tap n_layers is the hidden after the final norm (exactly lm_head's
    input, what MTP heads condition on).

    `share`: another TargetModule over the same HF model whose weight tensors to reuse (a draft
    model made of the target's first layers needs its own caches, not its own weights)."""

    def __init__(self, hf_model, cache_len: int, n_layers: int | None = None, taps: tuple[int, ...] = (),
                 share: "TargetModule | None" = None):
        super().__init__()
        cfg = hf_model.config
        self.arch = check_architecture(cfg)
        base = hf_model.model
        n_total = len(base.layers)
        n_layers = n_total if n_layers is None else n_layers
        if not 1 <= n_layers <= n_total:
            raise SpeccError(f"a draft model truncated to {n_layers} layers is impossible: the target has {n_total}.")
        for t in taps:
            if not 0 <= t <= n_layers:
                raise SpeccError(f"hidden-state tap {t} is outside the model's {n_layers} layers "
                                 f"(tap {n_layers} is the final norm's output).")
        n_heads = cfg.num_attention_heads
        n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
        dtype = base.embed_tokens.weight.dtype
        self.config = cfg
        self.cache_len, self.n_layers, self.taps = cache_len, n_layers, tuple(taps)
        self.vocab_size = hf_model.lm_head.out_features
        self.embed_tokens = base.embed_tokens
        self.rotary_emb = base.rotary_emb
        self.blocks = nn.ModuleList(
            Block(base.layers[i], cache_len, n_heads, n_kv, head_dim, dtype,
                  share=share.blocks[i] if share is not None else None) for i in range(n_layers))
        self.norm = base.norm
        self.w_head = share.w_head if share is not None else _fused_weight(hf_model.lm_head)

    def forward(self, tokens, positions, cache_pos, mask):
        x = self.embed_tokens(tokens)
        mask = mask.to(x.dtype)  # once for every layer: attention takes the query's dtype
        cos, sin = self.rotary_emb(x, positions)
        cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
        tapped = {}
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, cache_pos, mask)
            if i in self.taps:
                tapped[i] = x
        x = self.norm(x)
        tapped[self.n_layers] = x  # the head's input; returned only when asked for
        logits = linear(x, self.w_head).float()
        return (logits, *(tapped[i] for i in self.taps))  # in the order asked for

    def example_inputs(self, T: int) -> tuple:
        """forward's inputs for T consecutive tokens at the start of the cache (what capture traces)."""
        return (torch.zeros(1, T, dtype=torch.int64), torch.arange(T).view(1, T), torch.arange(T),
                causal_mask(T, 0, self.cache_len))


def module_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the runtime owns for a captured module (weights and caches), under its own name."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def sliding_window_limit(config) -> int | None:
    window = getattr(config, "sliding_window", None)
    if window is None or (hasattr(config, "use_sliding_window") and not config.use_sliding_window):
        return None
    return int(window)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """0 where `allowed`, a large negative elsewhere, in `dtype`: attention takes its mask in the
    query's dtype (CUDA's memory-efficient SDPA refuses a float32 mask beside bf16 queries)."""
    return torch.full_like(allowed, max(NEG_INF, torch.finfo(dtype).min), dtype=dtype).masked_fill(allowed, 0.0)


def causal_mask(T: int, start: int, cache_len: int) -> torch.Tensor:
    """Additive mask [1,1,T,S] for T consecutive tokens written at start.. (a plain causal chunk)."""
    rows = torch.arange(T).unsqueeze(1) + start
    cols = torch.arange(cache_len).unsqueeze(0)
    return additive_mask(cols <= rows).view(1, 1, T, cache_len)
