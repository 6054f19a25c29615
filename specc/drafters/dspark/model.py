"""DSpark: DFlash's block drafter, made semi-autoregressive, with a confidence head (arXiv 2607.05147).

The backbone is DFlash's (specc/drafters/dflash/model.py): a few decoder layers over the context features of the
committed tokens and a block [anchor, MASK x (B-1)] at positions start..start+B-1. Two changes:

- Every block row drafts, the anchor's included: row k predicts the token at start + k + 1, so a
  block of B rows gives B drafts (DFlash's gives B - 1).
- A low-rank Markov head adds a bigram term over the previous token to each row's logits,
  logits_k = LM_head(h_k) + W2 · W1[x_k], where x_k is the token at start + k (the anchor, then
  the previous draft), so the drafts are produced left to right inside the block and a draft can
  agree with the one before it. In a tree each node's children are ranked under its own token.
- A confidence head rates each draft: c = sigmoid(w · [h_k ; W1[x_k]] + b), trained toward
  1 - TV(p_draft, p_target), the probability that a sampling verifier keeps the draft. Its graph
  returns the confidences beside the drafts, for a scheduler that verifies only what pays.

Checkpoint: DFlash's directory layout and key names (config.json + model.safetensors: `layers.*`,
`norm`, `fc`, `hidden_norm`; no embedding, no LM head) plus the two heads, `markov.w1.weight`
[V, r], `markov.w2.weight` [V, r] and `confidence.weight` [1, H + r], `confidence.bias` [1];
config.json has `architectures: ["DSparkDraftModel"]`, DFlash's fields (`block_size` is the
number of block rows, all of which draft) and `dspark_config: {markov_rank}`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import SpeccError
from ...signature import DraftSignature
from ...tree import Tree
from ..dflash.model import DFlashConfig, DFlashDrafter, DFlashStep, load_strictly, read_checkpoint

ARCHITECTURE = "DSparkDraftModel"
MARKOV_RANK = 256  # the published r


class MarkovHead(nn.Module):
    """W2 · W1[x]: a rank-r bigram term over the vocabulary."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.w1 = nn.Embedding(vocab, rank)
        self.w2 = nn.Linear(rank, vocab, bias=False)
        with torch.no_grad():  # starts as no bigram at all: the backbone's logits alone
            self.w2.weight.zero_()


class DSparkDrafter(DFlashDrafter):
    """DFlash's weights and the Markov and confidence heads."""

    def __init__(self, cfg: DFlashConfig, markov_rank: int = MARKOV_RANK):
        super().__init__(cfg)
        self.markov_rank = markov_rank
        self.markov = MarkovHead(cfg.vocab_size, markov_rank)
        self.confidence = nn.Linear(cfg.hidden_size + markov_rank, 1)

    def heads(self, logits, h, prev):
        """Backbone logits [..., V] and hidden states [..., H] of rows whose previous tokens are prev
        [...] -> (draft logits [..., V], confidence logits [...])."""
        e = self.markov.w1(prev)
        return logits + self.markov.w2(e), self.confidence(torch.cat((h, e.to(h.dtype)), dim=-1)).squeeze(-1)


def save_dspark(drafter: DSparkDrafter, path) -> Path:
    """Write DFlash's directory format with DSpark's architecture, rank and heads."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = drafter.config.to_json()
    config.update({"architectures": [ARCHITECTURE], "dspark_config": {"markov_rank": drafter.markov_rank}})
    (path / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.detach().contiguous() for k, v in drafter.state_dict().items()}, str(path / "model.safetensors"))
    return path


def load_dspark(path, dtype=torch.float32) -> DSparkDrafter:
    """Read a DSpark directory, strictly by its key names."""
    raw, weights = read_checkpoint(path, ARCHITECTURE, "DSpark")
    try:
        rank = int(raw["dspark_config"]["markov_rank"])
    except (KeyError, TypeError, ValueError):
        raise SpeccError(f"the DSpark config.json in {str(path)!r} lacks dspark_config.markov_rank.") from None
    raw = {k: v for k, v in raw.items() if k != "dspark_config"}
    return load_strictly(DSparkDrafter(DFlashConfig.from_json(raw), rank), weights, path, "DSpark", dtype)


def tree_plan(tree: Tree) -> list[tuple[list[int], list[int], list[int], int]]:
    """Per depth d = 1..D, over the depth-d nodes (by node number): (their parents' indices among the
    depth d-1 nodes (the root: 0), their parents' slots among the distinct parents, their ranks, the
    candidates needed)."""
    levels = [[0]] + [[i for i in range(1, tree.size) if tree.depths[i] == d] for d in range(1, tree.max_depth + 1)]
    plan = []
    for d in range(1, len(levels)):
        kids = levels[d]
        parents = sorted({tree.parents[i] for i in kids})
        plan.append(([levels[d - 1].index(p) for p in parents], [parents.index(tree.parents[i]) for i in kids],
                     [tree.ranks[i] for i in kids], max(tree.ranks[i] for i in kids) + 1))
    return plan


def markov_drafts(drafter: DSparkDrafter, logits, h, anchor, tree: Tree):
    """A static tree's drafts from the backbone's rows: logits [D, V], h [D, H] (row d-1 drafts depth
    d), anchor [1]. A node's children are the top-ranked tokens of its depth's row plus the Markov
    term of the node's own token. Returns drafts [T-1] and confidences [T-1] in node order (a node's
    confidence is its parent's row's: siblings share it)."""
    level, drafts, rated = anchor.view(1), [], []
    for d, (parents, slot, rank, width) in enumerate(tree_plan(tree), start=1):
        prev = level.index_select(0, torch.tensor(parents))
        P = len(parents)
        scores, conf = drafter.heads(logits[d - 1].expand(P, -1), h[d - 1].expand(P, -1), prev)
        cand = scores.argmax(-1, keepdim=True) if width == 1 else torch.topk(scores, width, dim=-1).indices
        level = cand.reshape(-1).index_select(0, torch.tensor([s * width + r for s, r in zip(slot, rank)]))
        drafts.append(level)
        rated.append(torch.sigmoid(conf.float()).index_select(0, torch.tensor(slot)))
    return torch.cat(drafts), torch.cat(rated)  # depth by depth is node order (Tree sorts nodes by depth)


def markov_drafts_reference(drafter: DSparkDrafter, logits, h, anchor: int, tree: Tree):
    """markov_drafts node by node in plain Python (a test oracle): node i ranks the scores of its
    depth's row under its parent's token and takes its own rank."""
    tokens, drafts, confs = {0: anchor}, [], []
    for i in range(1, tree.size):
        d, p = tree.depths[i], tree.parents[i]
        scores, conf = drafter.heads(logits[d - 1], h[d - 1], torch.tensor(tokens[p]))
        order = sorted(range(scores.shape[0]), key=lambda v: (-float(scores[v]), v))
        tokens[i] = order[tree.ranks[i]]
        drafts.append(tokens[i])
        confs.append(float(torch.sigmoid(conf.float())))
    return drafts, confs


class DSparkStep(DFlashStep):
    """DFlashStep with every block row drafting and DSpark's heads: forward(*DraftSignature) ->
    (drafts [T-1], confidences [T-1]). Top-k trees only (a node's children depend on its token, so
    there is no per-depth q to sample children from); the drafts are a deterministic function of
    the context, verified exactly by the one-hot rule in every mode."""

    FIRST_ROW = 0
    NAME = "DSpark"

    def __init__(self, drafter: DSparkDrafter, embed_tokens: nn.Module, lm_head_weight: torch.Tensor,
                 cache_len: int, block_size: int | None = None, tree: Tree | None = None):
        super().__init__(drafter, embed_tokens, lm_head_weight, cache_len, block_size, tree)

    def signature(self, mode: str = "greedy") -> DraftSignature:
        return DraftSignature(None, mode, confidence=True)

    def forward(self, taps, next_tokens, ctx_start, n_ctx):
        h, anchor = self.block_rows(taps, next_tokens, ctx_start, n_ctx)
        h = h[: self.tree.max_depth]  # rows past the tree's depth draft nothing
        return markov_drafts(self.drafter, F.linear(h, self.lm_head_weight), h, anchor, self.tree)
