"""DeepSeek-V3-style multi-token-prediction (MTP) heads: the module, its training loss, checkpoint I/O.

MTP module k turns the previous depth's hidden h^{k-1}_i and the embedding of token t_{i+k} into a
hidden that predicts t_{i+k+1}:

    x   = M_k · concat(RMSNorm_e(Emb(t_{i+k})), RMSNorm_h(h^{k-1}_i))   # order "emb_hidden"
    h^k = DecoderBlock_k(x)                                              # causal over the rows
    p   = LMHead(FinalNorm(h^k))

* h^0 is the target's post-final-norm hidden (the tensor that enters its lm_head).
* Emb, FinalNorm and LMHead are the target's own modules, passed in and never owned or saved as
  weights of the heads: specc always uses the target's embedding and head.  A Qwen3-Next module
  carries its own final norm (`mtp.norm`), used instead of the target's before the target's head.
* DecoderBlock_k is the target architecture's own transformers decoder-layer class built from the
  target's config, so `specc.target_module.Block` can wrap it later for cached inference.
* With fewer modules than the draft depth, the last module is reused recursively (num_modules=1:
  one module at every depth).  The hidden fed to the next depth is the module's block output
  (`feedback="block"`, DeepSeek-V3), or that output after the module's own final norm
  (`feedback="normed"`: what vLLM's Qwen3-Next MTP returns and feeds back).

Row alignment (teacher forcing over a sequence t_0..t_{N-1} with target hiddens h_0..h_{M-1}):
depth-d row i combines the depth-(d-1) hidden at row i with Emb(t_{i+d}) and predicts t_{i+d+1}.
Depth d therefore has min(M, N-d) rows; with M = N that is N-d rows, of which the first N-d-1 have
their label inside the sequence and the last one predicts past its end (a draft).

Checkpoint layouts (read straight from safetensors: transformers drops these keys on load):
* DeepSeek-V3: `num_nextn_predict_layers: k` in config.json; module j is decoder layer
  `num_hidden_layers + j`: `model.layers.{L+j}.{enorm,hnorm,eh_proj}.weight`, the decoder block's own
  keys (`self_attn.*`, `mlp.*`, `input_layernorm`, `post_attention_layernorm`), and optionally
  `shared_head.norm.weight`, `shared_head.head.weight`, `embed_tokens.weight`.  The head and embedding
  copies are ignored (only their shapes are checked); a `shared_head.norm` that differs from the
  target's final norm is kept as the module's own final norm.
* Qwen3-Next: `mtp.fc.weight` (the role of eh_proj), `mtp.pre_fc_norm_embedding.weight` (enorm),
  `mtp.pre_fc_norm_hidden.weight` (hnorm), `mtp.layers.{j}.*` (one decoder block per depth, sharing
  fc and the norms), optional `mtp.norm.weight`.
Neither layout records the concat order; specc writes `mtp_concat_order` into config.json when it is
"hidden_emb" (MiMo style) and reads it back, defaulting to "emb_hidden".  Likewise `mtp_depth`, the
depth the heads were trained for (the default depth on load; absent: the number of modules), and
`mtp_feedback` when DeepSeek-V3-layout heads feed back the normed hidden (Qwen3-Next heads saved in
that layout, as an engine saves them): the layout itself implies "block".

Engines (`MTPStep`) run one module at every depth with one static KV cache, drafting recursively
from the last committed position; `cached_scheme_drafts` is the slow reference of that scheme.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...acceptance import inverse_cdf_rows, sampling_probs
from ...draft_tokens import draft_slots, sampled_drafts, tree_drafts
from ...signature import DraftSignature, SampledChildren, parse_sampling
from ...target_module import Block, additive_mask
from ...errors import SpeccError
from ...tree import Tree, chain

ORDERS = ("emb_hidden", "hidden_emb")
FEEDBACKS = ("block", "normed")
ORDER_KEY = "mtp_concat_order"  # specc's own config.json key; absent means "emb_hidden"
FEEDBACK_KEY = "mtp_feedback"  # specc's own config.json key (DeepSeek-V3 layout); absent means "block"
DEPTH_KEY = "mtp_depth"  # specc's own config.json key: the depth the heads were trained for
MTP_FILE = "mtp.safetensors"


# ----------------------------------------------------------------------------------------------
# Config and modules


@dataclass
class MTPConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    num_modules: int = 1  # distinct modules; depths past the last reuse the last one
    depth: int = 1  # draft tokens produced after the target's own next token
    order: str = "emb_hidden"  # concat order fed to eh_proj: [emb ; hidden] or [hidden ; emb]
    has_final_norm: bool = False  # each module owns a final norm used before the target's LM head
    feedback: str = "block"  # hidden fed to the next depth: block output, or after the own final norm
    # The target's HF config: decoder layers (rope, attention kind, activation) are built from it.
    target_config: object = field(default=None, repr=False, compare=False)


def mtp_config_for(target_hf_config, num_modules: int = 1, order: str = "emb_hidden", depth: int | None = None,
                   has_final_norm: bool = False, feedback: str = "block") -> MTPConfig:
    """An MTPConfig whose decoder blocks match the target's layers; depth defaults to num_modules."""
    if order not in ORDERS:
        raise SpeccError(f"MTP concat order {order!r} is unknown: use one of {', '.join(ORDERS)}.")
    if feedback not in FEEDBACKS:
        raise SpeccError(f"MTP feedback {feedback!r} is unknown: use one of {', '.join(FEEDBACKS)}.")
    depth = num_modules if depth is None else depth
    if num_modules < 1 or depth < 1:
        raise SpeccError(f"MTP heads need at least one module and depth 1 (got {num_modules} and {depth}).")
    c = target_hf_config
    heads = c.num_attention_heads
    return MTPConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_attention_heads=heads,
                     num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
                     head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, rms_norm_eps=c.rms_norm_eps,
                     num_modules=num_modules, depth=depth, order=order, has_final_norm=has_final_norm,
                     feedback=feedback, target_config=c)


def decoder_layer_class(hf_config):
    """The transformers decoder-layer class of the config's causal-LM architecture."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
        name = model_cls._no_split_modules[0]  # transformers names the decoder layer here
        return getattr(sys.modules[model_cls.__module__], name)
    except (KeyError, IndexError, TypeError, AttributeError):
        raise SpeccError(f"no decoder-layer class is known for the {type(hf_config).__name__} architecture.") from None


class MTPModule(nn.Module):
    """One MTP depth: enorm, hnorm, eh_proj [H, 2H], a full decoder block, optional final norm."""

    def __init__(self, config: MTPConfig, layer_cls=None):
        super().__init__()
        layer_cls = layer_cls or decoder_layer_class(config.target_config)
        # layer_idx 0: it only names the layer's cache slot and picks its attention kind (full in layer 0).
        self.layer = layer_cls(config.target_config, layer_idx=0)
        norm_cls = type(self.layer.input_layernorm)  # the architecture's own RMSNorm (Gemma-style in Qwen3-Next)
        H, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = norm_cls(H, eps=eps)
        self.hnorm = norm_cls(H, eps=eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.final_norm = norm_cls(H, eps=eps) if config.has_final_norm else None
        self.order, self.feedback = config.order, config.feedback

    def forward(self, h_prev, emb, position_embeddings, mask, position_ids):
        """Block output [1,R,H] for the previous depth's hidden [1,R,H] and the token embeddings [1,R,H]."""
        e, h = self.enorm(emb), self.hnorm(h_prev)
        x = self.eh_proj(torch.cat((e, h) if self.order == "emb_hidden" else (h, e), dim=-1))
        out = self.layer(x, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings)
        return out[0] if isinstance(out, tuple) else out  # older transformers returned a tuple

    def logits(self, hidden, final_norm, lm_head):
        return lm_head((self.final_norm or final_norm)(hidden))

    def next_hidden(self, hidden):
        return self.final_norm(hidden) if self.feedback == "normed" and self.final_norm is not None else hidden


def _causal_mask(R: int, dtype, device) -> torch.Tensor:
    # Explicit additive mask: eager attention ignores causality when the mask is None.
    m = torch.full((R, R), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    return m.view(1, 1, R, R)


class MTPHeads(nn.Module):
    """The MTP modules (`mtp`, a ModuleList) and their config; the target's parts are passed in."""

    def __init__(self, config: MTPConfig, layer_cls=None):
        super().__init__()
        self.config = config
        self.mtp = nn.ModuleList(MTPModule(config, layer_cls) for _ in range(config.num_modules))

    def module_for(self, d: int) -> MTPModule:
        """The module of depth d (1-based); depths past the last module reuse the last one."""
        return self.mtp[min(d, len(self.mtp)) - 1]

    def run_depth(self, d: int, h_prev, tokens, embed, final_norm, lm_head, rotary_emb):
        """Depth d over R rows: h_prev [1,R,H] with Emb(tokens[:, d:d+R]).  -> (logits [1,R,V], next hidden)."""
        R = h_prev.shape[1]
        module = self.module_for(d)
        emb = embed(tokens[:, d:d + R])
        # Positions 0..R-1: within one causal pass RoPE sees only relative offsets, so any start works.
        pos = torch.arange(R, device=emb.device).unsqueeze(0)
        cos, sin = rotary_emb(emb, pos)
        out = module(h_prev, emb, (cos, sin), _causal_mask(R, emb.dtype, emb.device), pos)
        return module.logits(out, final_norm, lm_head), module.next_hidden(out)

    def forward_train(self, target_hidden, tokens, embed, final_norm, lm_head, rotary_emb,
                      depth: int | None = None) -> list[torch.Tensor]:
        """Teacher-forced logits per depth d = 1..depth, each [1, min(M, N-d), V].

        target_hidden [1,M,H]: the target's post-final-norm hidden at positions 0..M-1 (h_i predicts
        t_{i+1}); tokens [1,N].  Row i of depth d predicts t_{i+d+1} (see the module docstring)."""
        depth = self.config.depth if depth is None else depth
        N = tokens.shape[1]
        if N - depth < 1:
            raise SpeccError(f"MTP depth {depth} needs more than {depth} tokens, but the sequence has {N}.")
        h, out = target_hidden, []
        for d in range(1, depth + 1):
            h = h[:, :N - d]
            logits, h = self.run_depth(d, h, tokens, embed, final_norm, lm_head, rotary_emb)
            out.append(logits)
        return out


def target_parts(target_hf_model) -> dict:
    """The target modules forward_train needs, as keyword arguments."""
    return dict(embed=target_hf_model.get_input_embeddings(), final_norm=target_hf_model.model.norm,
                lm_head=target_hf_model.get_output_embeddings(), rotary_emb=target_hf_model.model.rotary_emb)


def target_hidden(target_hf_model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(post-final-norm hidden [1,N,H], logits [1,N,V]) of the target over ids [1,N].

    The hidden is taken as lm_head's input, so it is exactly what the head saw whatever the
    transformers version reports in hidden_states."""
    seen = []
    hook = target_hf_model.get_output_embeddings().register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    try:
        logits = target_hf_model(ids).logits
    finally:
        hook.remove()
    return seen[-1], logits


def build_heads(target_hf_model, num_modules: int = 1, depth: int | None = None, order: str = "emb_hidden",
                has_final_norm: bool = False, feedback: str = "block") -> MTPHeads:
    """Freshly initialised MTP heads on the target's dtype and device."""
    cfg = mtp_config_for(target_hf_model.config, num_modules=num_modules, order=order, depth=depth,
                         has_final_norm=has_final_norm, feedback=feedback)
    w = target_hf_model.get_input_embeddings().weight
    return MTPHeads(cfg, type(target_hf_model.model.layers[0])).to(device=w.device, dtype=w.dtype)


# ----------------------------------------------------------------------------------------------
# Loss and reference drafting


def mtp_loss(logits_per_depth: list[torch.Tensor], tokens: torch.Tensor | None = None,
             target_ids: torch.Tensor | None = None, weights: list[float] | None = None):
    """(total, [loss per depth]) of per-depth cross-entropy; total = sum of weights[d] * loss[d].

    Give exactly one of
    * tokens [1,N]: the sequence itself; depth-d row i is scored against t_{i+d+1} (its last row,
      which predicts past the sequence, is dropped);
    * target_ids [1,N]: the target's argmax at each position (target_ids[j] is its prediction of
      t_{j+1}); depth-d row i is scored against target_ids[i+d], so every row has a label.
    weights default to 1/depth each (the mean over depths, as DeepSeek-V3 averages before scaling)."""
    if (tokens is None) == (target_ids is None):
        raise SpeccError("mtp_loss needs exactly one of tokens or target_ids.")
    labels, shift = (tokens, 1) if tokens is not None else (target_ids, 0)
    D = len(logits_per_depth)
    weights = [1.0 / D] * D if weights is None else list(weights)
    if len(weights) != D:
        raise SpeccError(f"mtp_loss got {len(weights)} weights for {D} depths.")
    N = labels.shape[1]
    total, per_depth = 0.0, []
    for d, (logits, w) in enumerate(zip(logits_per_depth, weights), start=1):
        rows = min(logits.shape[1], N - d - shift)
        if rows < 1:
            raise SpeccError(f"depth {d} has no labelled rows in a sequence of {N} tokens.")
        loss = F.cross_entropy(logits[0, :rows].float(), labels[0, d + shift:d + shift + rows])
        total = total + w * loss
        per_depth.append(loss.detach())
    return total, per_depth


@torch.no_grad()
def reference_drafts(heads: MTPHeads, target_hf_model, prefix_ids: list[int], depth: int | None = None) -> list[int]:
    """Greedy tokens after the prefix, slowly and without a cache: [t_n, d_1, ..., d_depth].

    t_n is the target's own argmax at the last prefix position (not an MTP output).  d_1 is MTP
    depth 1 at the last prefix row, combining that row's target hidden with Emb(t_n); d_k comes from
    depth k fed the depth-(k-1) hidden and Emb(d_{k-1}).  Every depth runs teacher-forced over all
    n prefix rows (causal attention), exactly as forward_train on prefix + [t_n, d_1, ...]."""
    depth = heads.config.depth if depth is None else depth
    parts = target_parts(target_hf_model)
    device = parts["embed"].weight.device
    n = len(prefix_ids)
    h, logits = target_hidden(target_hf_model, torch.tensor([prefix_ids], device=device))
    tokens = list(prefix_ids) + [int(logits[0, -1].argmax())]
    for d in range(1, depth + 1):
        ids = torch.tensor([tokens], device=device)  # length n + d: rows 0..n-1 embed t_{i+d}
        logits, h = heads.run_depth(d, h, ids, **parts)
        tokens.append(int(logits[0, -1].argmax()))
    return tokens[n:]


# ----------------------------------------------------------------------------------------------
# Engines: the cached step module and the slow reference of its scheme


def check_engine_heads(heads: MTPHeads) -> None:
    """Engines reuse one module at every depth (one KV cache); refuse heads with more."""
    n = heads.config.num_modules
    if n != 1:
        raise SpeccError(f"engines run MTP heads with one module reused at every depth, but this checkpoint "
                         f"has {n} modules.")


@torch.no_grad()
def cached_scheme_drafts(heads: MTPHeads, target_hf_model, committed: list[int], depth: int,
                         width: int | None = None) -> list:
    """The drafts d_1..d_depth that an engine's MTPStep proposes after `committed`, slowly and uncached
    (with `width`: each depth's `width` best candidates instead, the argmax leading the recursion).

    One causal sequence of rows at positions 0, 1, ... through the one module: row p <= P = n-2
    (n = len(committed)) combines the target's hidden h_p with Emb(t_{p+1}); row P+d-1 (d >= 2)
    combines the fed-back output of the row before it with Emb(d_{d-1}).  Row P+d-1 gives d_d.
    Depth 1 is reference_drafts' depth 1; deeper rows attend to the depth-1 rows of the committed
    positions (one cache), where reference_drafts reruns each depth over every prefix row."""
    check_engine_heads(heads)
    if len(committed) < 2:
        raise SpeccError("MTP drafting needs at least two committed tokens.")
    module, parts = heads.mtp[0], target_parts(target_hf_model)
    device = parts["embed"].weight.device
    h, _ = target_hidden(target_hf_model, torch.tensor([committed[:-1]], device=device))
    tokens, drafts, ranked = list(committed[1:]), [], []
    for _ in range(depth):
        R = h.shape[1]
        emb = parts["embed"](torch.tensor([tokens], device=device))
        pos = torch.arange(R, device=device).unsqueeze(0)
        cos, sin = parts["rotary_emb"](emb, pos)
        last = module(h, emb, (cos, sin), _causal_mask(R, emb.dtype, emb.device), pos)[:, -1:]
        row = module.logits(last, parts["final_norm"], parts["lm_head"])[0, -1]
        drafts.append(int(row.argmax()))
        ranked.append(torch.topk(row, width).indices.tolist() if width else None)
        h = torch.cat((h, module.next_hidden(last)), dim=1)
        tokens.append(drafts[-1])
    return ranked if width else drafts


class MTPStep(nn.Module):
    """Batch-1 MTP drafting with a static KV cache for the module's decoder layer; the compiler captures it.

    forward(*DraftSignature): hidden [R,H], next_tokens [R], ctx_start [], n_ctx [] -> drafts [T-1].  Rows i < n_ctx
    are committed positions p = ctx_start + i: the target's post-final-norm hidden h_p beside
    next_tokens[i] = t_{p+1}.  Their K/V go to cache slot p and each attends to slots <= p.  Row
    n_ctx-1 (position P) gives d_1; depth d >= 2 is one row at position P+d-1 (the fed-back hidden
    and Emb(d_{d-1})), written at its slot, attending slots <= its position.  Padding rows (i >=
    n_ctx) write slots > P, which the depth rows or a later call overwrite before anything reads them.
    Each depth feeds the next with its argmax; tree node i takes the candidate of rank ranks[i] at
    depth depths[i] (`tree` defaults to chain:depth, whose drafts are the argmaxes).
    The target's embedding, final norm, LM head and rotary embedding are passed in and shared.

    `sampled=True` (`--children sampled`): in a sampling mode forward also takes the mode's sampling
    inputs (uniforms [depth * width]) and returns (drafts, q [depth, V]): the drafts are draws from
    q (draft_tokens.sampled_drafts) and each depth feeds the next with its rank-0 draw."""

    def __init__(self, heads: MTPHeads, embed_tokens: nn.Module, final_norm: nn.Module, lm_head_weight: torch.Tensor,
                 rotary_emb: nn.Module, cache_len: int, depth: int, tree: Tree | None = None, sampled: bool = False):
        super().__init__()
        self.sampled = sampled
        check_engine_heads(heads)
        if depth < 1:
            raise SpeccError(f"MTP drafting needs depth 1 or more, not {depth}.")
        c, m = heads.config, heads.mtp[0]
        self.enorm, self.hnorm, self.eh_proj = m.enorm, m.hnorm, m.eh_proj
        self.head_norm = m.final_norm if m.final_norm is not None else final_norm
        self.normed_feedback = m.feedback == "normed" and m.final_norm is not None  # through the own norm
        self.emb_first = m.order == "emb_hidden"
        self.embed_tokens, self.rotary_emb = embed_tokens, rotary_emb
        # The target's own tensor, registered (not a plain attribute, which export would bake in as a constant).
        self.lm_head_weight = nn.Parameter(lm_head_weight, requires_grad=False)
        self.block = Block(m.layer, cache_len, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                           m.eh_proj.weight.dtype)
        self.cache_len, self.depth = cache_len, depth
        tree = chain(depth) if tree is None else tree
        if tree.max_depth != depth:
            raise SpeccError(f"MTP drafting of depth {depth} cannot fill a token tree of depth {tree.max_depth}.")
        d_idx, rank, self.width = draft_slots(tree)
        self.q_rows = depth  # one distribution per depth
        self.register_buffer("draft_depth", d_idx, persistent=False)
        self.register_buffer("draft_rank", rank, persistent=False)

    def _mix(self, h, e):
        e, h = self.enorm(e), self.hnorm(h)
        return self.eh_proj(torch.cat((e, h) if self.emb_first else (h, e), dim=-1))

    def _layer(self, x, pos):
        """The decoder layer over rows x [T,H] at positions pos [T], through the cache."""
        cos, sin = self.rotary_emb(x, pos.view(1, -1))
        mask = additive_mask(torch.arange(self.cache_len).view(1, -1) <= pos.view(-1, 1), x.dtype)
        out = self.block(x.unsqueeze(0), cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype), pos,
                         mask.view(1, 1, *mask.shape))
        return out[0]

    def _logits(self, out):
        return F.linear(self.head_norm(out), self.lm_head_weight)

    def signature(self, mode: str = "greedy") -> DraftSignature:
        vocab = self.lm_head_weight.shape[0]
        return DraftSignature(SampledChildren(self.q_rows, vocab, self.width) if self.sampled else None, mode)

    def example_inputs(self, rows: int, mode: str = "greedy") -> tuple:
        return self.signature(mode).example_inputs(rows, self.eh_proj.weight.shape[0], self.eh_proj.weight.dtype)

    def forward(self, hidden, next_tokens, ctx_start, n_ctx, *sampling_args):
        s = parse_sampling(sampling_args)  # none in greedy mode: top-k drafts
        sample = self.sampled and s.mode != "greedy"
        R = hidden.shape[0]
        out = self._layer(self._mix(hidden, self.embed_tokens(next_tokens)), torch.arange(R) + ctx_start)
        last = out.index_select(0, (n_ctx - 1).view(1))  # position P = ctx_start + n_ctx - 1
        logits = [self._logits(last)]
        for d in range(2, self.depth + 1):
            h = self.head_norm(last) if self.normed_feedback else last
            top = logits[-1].argmax(-1)
            if sample:  # feed the rank-0 draw of depth d-1: the token every rank-0 node there carries
                q = sampling_probs(logits[-1], s.temperature, s.top_p)
                top = inverse_cdf_rows(q, s.uniforms.index_select(0, torch.tensor([(d - 2) * self.width])))
            last = self._layer(self._mix(h, self.embed_tokens(top)), (ctx_start + n_ctx + d - 2).view(1))
            logits.append(self._logits(last))
        if sample:
            return sampled_drafts(torch.cat(logits), self.draft_depth, self.draft_rank, self.width, s.temperature,
                                  s.top_p, s.uniforms)
        return tree_drafts(torch.cat(logits), self.draft_depth, self.draft_rank, self.width)



# ----------------------------------------------------------------------------------------------
# Checkpoint files


def _checkpoint_files(path: Path) -> list[Path]:
    if not path.exists():
        raise SpeccError(f"MTP checkpoint {path} does not exist.")
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise SpeccError(f"no MTP keys found in {path}: it holds no .safetensors file.")
    return files


def _key_index(files: list[Path]) -> dict[str, Path]:
    """Key -> file, reading only the headers.  All shards are scanned (not just those an index lists),
    so MTP keys in an extra shard beside the target's are found; the first file holding a key wins."""
    from safetensors import safe_open

    index: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    index.setdefault(k, f)
        except Exception as e:  # a damaged or non-safetensors file
            raise SpeccError(f"{f} is not a readable safetensors file ({type(e).__name__}).") from None
    return index


def _read(index: dict[str, Path], keys: list[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for k in keys:
        by_file.setdefault(index[k], []).append(k)
    out = {}
    for f, ks in by_file.items():
        with safe_open(str(f), framework="pt") as st:
            for k in ks:
                out[k] = st.get_tensor(k)
    return out


def _config_json(path: Path) -> dict:
    cfg = path / "config.json" if path.is_dir() else None
    return json.loads(cfg.read_text()) if cfg is not None and cfg.is_file() else {}


def _check_eh_proj(w: torch.Tensor, key: str, H: int) -> None:
    if tuple(w.shape) != (H, 2 * H):
        raise SpeccError(f"MTP weight {key} has shape {list(w.shape)} but the target's hidden size {H} "
                         f"needs [{H}, {2 * H}], so this MTP checkpoint belongs to another model.")


def _check_vocab(w: torch.Tensor, key: str, ref: torch.Tensor) -> None:
    if tuple(w.shape) != tuple(ref.shape):
        raise SpeccError(f"MTP weight {key} has shape {list(w.shape)} but the target's is {list(ref.shape)}, "
                         f"so its vocabulary or hidden size differs from the target's.")


def _load_strict(module: nn.Module, state: dict[str, torch.Tensor], file_key) -> None:
    """load_state_dict(strict) with one-sentence errors that name the checkpoint's key."""
    expected = module.state_dict()
    for k in expected:
        if k not in state:
            raise SpeccError(f"the MTP checkpoint lacks {file_key(k)}, which the target's layer architecture needs.")
    for k, v in state.items():
        if k not in expected:
            raise SpeccError(f"the MTP checkpoint has {file_key(k)}, which the target's layer architecture lacks.")
        if tuple(v.shape) != tuple(expected[k].shape):
            raise SpeccError(f"MTP weight {file_key(k)} has shape {list(v.shape)} but the target's layers "
                             f"need {list(expected[k].shape)}.")
    with torch.no_grad():
        module.load_state_dict(state, strict=True)  # copies, casting to the heads' dtype


def _new_heads(target_hf_model, cfg_json: dict, num_modules: int, depth, order, has_final_norm,
               feedback) -> MTPHeads:
    order = order or cfg_json.get(ORDER_KEY, "emb_hidden")
    if depth is None and cfg_json.get(DEPTH_KEY) is not None:
        try:
            depth = int(cfg_json[DEPTH_KEY])
        except (TypeError, ValueError):
            raise SpeccError(f"the MTP checkpoint's config.json has {DEPTH_KEY} {cfg_json[DEPTH_KEY]!r}, "
                             f"which is not a depth.") from None
    return build_heads(target_hf_model, num_modules=num_modules, depth=depth, order=order,
                       has_final_norm=has_final_norm, feedback=feedback)


def _write(path: Path, target_hf_model, heads: MTPHeads, extra_config: dict, tensors: dict) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(target_hf_model.config.to_json_string(use_diff=False))
    cfg.update(extra_config)
    if heads.config.order != "emb_hidden":
        cfg[ORDER_KEY] = heads.config.order
    cfg[DEPTH_KEY] = heads.config.depth
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    # Own contiguous copies: safetensors refuses tensors that share storage (a tied head and embedding).
    save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}, str(path / MTP_FILE))
    return path


# ----------------------------------------------------------------------------------------------
# DeepSeek-V3 layout


_EH_PROJ = re.compile(r"model\.layers\.(\d+)\.eh_proj\.weight$")


def load_deepseek_v3(path, target_hf_model, depth: int | None = None, order: str | None = None) -> MTPHeads:
    """MTP heads from a DeepSeek-V3-layout checkpoint: a directory (config.json and any number of
    *.safetensors shards, e.g. the target's own checkpoint with the extra layers) or one .safetensors
    file read against the target's config.  depth defaults to the number of modules."""
    path = Path(path)
    index = _key_index(_checkpoint_files(path))
    cfg_json = _config_json(path)
    tcfg = target_hf_model.config
    L = int(cfg_json.get("num_hidden_layers", tcfg.num_hidden_layers))
    found = sorted(int(m.group(1)) for k in index if (m := _EH_PROJ.match(k)))
    if not found:
        raise SpeccError(f"no DeepSeek-V3 MTP keys (model.layers.N.eh_proj.weight) found in {path}.")
    k = cfg_json.get("num_nextn_predict_layers")
    if k is None:  # no config: the MTP layers are the contiguous run of eh_proj layers from L
        k = 0
        while L + k in found:
            k += 1
    if int(k) < 1:
        raise SpeccError(f"no DeepSeek-V3 MTP module starts at layer {L} in {path} (eh_proj found at layers "
                         f"{found}).")
    k = int(k)

    H = tcfg.hidden_size
    embed_w = target_hf_model.get_input_embeddings().weight
    head_w = target_hf_model.get_output_embeddings().weight
    norm_w = target_hf_model.model.norm.weight
    states, norms = [], []
    for j in range(k):
        prefix = f"model.layers.{L + j}."
        keys = [key for key in index if key.startswith(prefix)]
        if prefix + "eh_proj.weight" not in keys:
            raise SpeccError(f"the MTP checkpoint lacks {prefix}eh_proj.weight although it declares {k} MTP modules.")
        raw = _read(index, keys)
        _check_eh_proj(raw[prefix + "eh_proj.weight"], prefix + "eh_proj.weight", H)
        state, norm = {}, None
        for key, t in raw.items():
            sub = key[len(prefix):]
            if sub == "shared_head.head.weight":
                _check_vocab(t, key, head_w)  # specc always uses the target's head
            elif sub == "embed_tokens.weight":
                _check_vocab(t, key, embed_w)  # ... and the target's embedding
            elif sub == "shared_head.norm.weight":
                _check_vocab(t, key, norm_w)
                norm = t
            elif sub.split(".")[0] in ("enorm", "hnorm", "eh_proj"):
                state[sub] = t
            else:
                state["layer." + sub] = t
        states.append(state)
        norms.append(norm)
    # A shared_head.norm equal to the target's final norm adds nothing to the logits; one that differs is
    # the module's own.  Heads that feed back the normed hidden always need it (even when equal).
    feedback = cfg_json.get(FEEDBACK_KEY, "block")
    own_norm = feedback == "normed" or any(
        n is not None and not torch.equal(n.to(norm_w.dtype), norm_w.detach().cpu()) for n in norms)
    heads = _new_heads(target_hf_model, cfg_json, k, depth, order, own_norm, feedback)

    def file_key(local, j):
        return f"model.layers.{L + j}." + (local[len("layer."):] if local.startswith("layer.") else local)

    for j, (module, state) in enumerate(zip(heads.mtp, states)):
        if own_norm:
            state["final_norm.weight"] = norms[j] if norms[j] is not None else norm_w.detach()
        _load_strict(module, state, lambda local, j=j: file_key(local, j).replace(
            "final_norm.weight", "shared_head.norm.weight"))
    return heads


def save_deepseek_v3(heads: MTPHeads, path, target_hf_model, shared_copies: bool = True) -> Path:
    """A directory with config.json (the target's config plus num_nextn_predict_layers) and
    mtp.safetensors holding exactly the DeepSeek-V3 keys, including the shared_head and embedding
    copies real checkpoints carry (left out with shared_copies=False: an engine already holds the
    target's, and specc never reads them)."""
    tcfg = target_hf_model.config
    L = tcfg.num_hidden_layers
    head_w = target_hf_model.get_output_embeddings().weight
    embed_w = target_hf_model.get_input_embeddings().weight
    tensors = {}
    for j, module in enumerate(heads.mtp):
        p = f"model.layers.{L + j}."
        for name in ("enorm", "hnorm", "eh_proj"):
            tensors[p + name + ".weight"] = getattr(module, name).weight
        for k, v in module.layer.state_dict().items():
            tensors[p + k] = v
        norm = module.final_norm if module.final_norm is not None else target_hf_model.model.norm
        tensors[p + "shared_head.norm.weight"] = norm.weight
        if shared_copies:
            tensors[p + "shared_head.head.weight"] = head_w
            tensors[p + "embed_tokens.weight"] = embed_w
    extra = {"num_nextn_predict_layers": len(heads.mtp)}
    if heads.config.feedback == "normed" and heads.config.has_final_norm:  # without a norm both feed back alike
        extra[FEEDBACK_KEY] = "normed"
    return _write(path, target_hf_model, heads, extra, tensors)


# ----------------------------------------------------------------------------------------------
# Qwen3-Next layout

_QN_SHARED = {"mtp.fc.weight": "eh_proj.weight", "mtp.pre_fc_norm_embedding.weight": "enorm.weight",
              "mtp.pre_fc_norm_hidden.weight": "hnorm.weight", "mtp.norm.weight": "final_norm.weight"}
_QN_LAYER = re.compile(r"mtp\.layers\.(\d+)\.(.+)$")


def load_qwen3_next(path, target_hf_model, depth: int | None = None, order: str | None = None) -> MTPHeads:
    """MTP heads from Qwen3-Next `mtp.*` keys: one module per `mtp.layers.{j}`, all sharing fc, the two
    pre-fc norms and `mtp.norm`.  With `mtp.norm` the fed-back hidden is the normed one, as in vLLM."""
    path = Path(path)
    index = _key_index(_checkpoint_files(path))
    cfg_json = _config_json(path)
    keys = [k for k in index if k.startswith("mtp.")]
    if "mtp.fc.weight" not in keys:
        raise SpeccError(f"no Qwen3-Next MTP keys (mtp.fc.weight) found in {path}.")
    raw = _read(index, keys)
    H = target_hf_model.config.hidden_size
    _check_eh_proj(raw["mtp.fc.weight"], "mtp.fc.weight", H)
    layers: dict[int, dict[str, torch.Tensor]] = {}
    shared = {}
    for key, t in raw.items():
        m = _QN_LAYER.match(key)
        if m:
            layers.setdefault(int(m.group(1)), {})["layer." + m.group(2)] = t
        elif key in _QN_SHARED:
            shared[_QN_SHARED[key]] = t
        elif key in ("mtp.embed_tokens.weight", "mtp.lm_head.weight"):
            _check_vocab(t, key, target_hf_model.get_input_embeddings().weight)  # specc uses the target's
        else:
            raise SpeccError(f"the MTP checkpoint has {key}, which the Qwen3-Next MTP layout does not define.")
    n = 0
    while n in layers:
        n += 1
    if n == 0 or n != len(layers):
        raise SpeccError(f"the Qwen3-Next MTP layers in {path} are not numbered 0..k-1 (found {sorted(layers)}).")
    has_norm = "final_norm.weight" in shared
    heads = _new_heads(target_hf_model, cfg_json, n, depth, order, has_norm, "normed" if has_norm else "block")
    names = {v: k for k, v in _QN_SHARED.items()}

    def file_key(local, j):
        return names.get(local) or f"mtp.layers.{j}." + local[len("layer."):]

    for j, module in enumerate(heads.mtp):
        _load_strict(module, {**shared, **layers[j]}, lambda local, j=j: file_key(local, j))
    return heads


def save_qwen3_next(heads: MTPHeads, path, target_hf_model) -> Path:
    """A directory with config.json (target config plus mtp_num_hidden_layers) and mtp.safetensors
    holding the Qwen3-Next `mtp.*` keys; refuses heads whose modules do not share fc and norms."""
    first = heads.mtp[0]
    shared = {"mtp.fc.weight": first.eh_proj.weight, "mtp.pre_fc_norm_embedding.weight": first.enorm.weight,
              "mtp.pre_fc_norm_hidden.weight": first.hnorm.weight}
    if first.final_norm is not None:
        shared["mtp.norm.weight"] = first.final_norm.weight
    for module in heads.mtp[1:]:
        names = ("eh_proj", "enorm", "hnorm") + (("final_norm",) if first.final_norm is not None else ())
        if not all(torch.equal(getattr(module, n).weight, getattr(first, n).weight) for n in names):
            raise SpeccError("the Qwen3-Next layout shares one fc and its norms across MTP layers, "
                             "but these heads' modules have different ones.")
    tensors = dict(shared)
    for j, module in enumerate(heads.mtp):
        for k, v in module.layer.state_dict().items():
            tensors[f"mtp.layers.{j}.{k}"] = v
    return _write(path, target_hf_model, heads, {"mtp_num_hidden_layers": len(heads.mtp)}, tensors)


# ----------------------------------------------------------------------------------------------


def load_mtp(path, target_hf_model, depth: int | None = None, order: str | None = None) -> MTPHeads:
    """MTP heads from either layout, recognised by its key names."""
    path = Path(path)
    index = _key_index(_checkpoint_files(path))
    if any(k.startswith("mtp.") for k in index):
        return load_qwen3_next(path, target_hf_model, depth=depth, order=order)
    if any(_EH_PROJ.match(k) for k in index):
        return load_deepseek_v3(path, target_hf_model, depth=depth, order=order)
    raise SpeccError(f"no MTP keys found in {path}: expected DeepSeek-V3 model.layers.N.eh_proj.weight "
                     f"or Qwen3-Next mtp.fc.weight.")
