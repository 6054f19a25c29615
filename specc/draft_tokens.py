"""From a drafter's logits per depth to the draft tokens of a static tree.

Drafters that rank candidates per depth (DFlash per block position, MTP per head depth) fill a
tree by rank: node i >= 1 takes the candidate of rank ranks[i] at depth depths[i]. By default the
candidates are the top-k (q is one-hot, verified with the exact one-hot rule); engines compiled
with `--children sampled` instead draw each node's children i.i.d. from the drafter's own
distribution q and hand q to the verifier (min(1, p/q) with residuals, specc/acceptance.py).
"""
from __future__ import annotations

import torch

from .acceptance import inverse_cdf_rows, sampling_probs
from .tree import Tree


def draft_slots(tree: Tree) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For drafters that rank candidates per depth (DFlash per block position, MTP per head depth):
    node i >= 1 takes candidate rank ranks[i] at depth depths[i]. Returns the depth-1 and rank
    index vectors [T-1] and the number of candidates needed per depth."""
    depth = torch.tensor(tree.depths[1:], dtype=torch.int64) - 1
    rank = torch.tensor(tree.ranks[1:], dtype=torch.int64)
    return depth, rank, int(rank.max()) + 1 if len(rank) else 1


def tree_drafts(logits: torch.Tensor, depth: torch.Tensor, rank: torch.Tensor, width: int) -> torch.Tensor:
    """logits [D, V] per depth -> the tree's draft tokens [T-1] (see draft_slots)."""
    if width == 1:  # a chain: plain argmax
        cand = logits.argmax(-1, keepdim=True)
    else:
        cand = torch.topk(logits, width, dim=-1).indices
    return cand[depth, rank]


def sampled_drafts(logits: torch.Tensor, depth: torch.Tensor, rank: torch.Tensor, width: int, temperature,
                   top_p, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Children drawn i.i.d. from the drafter (engines compiled with `--children sampled`, in a
    sampling mode; greedy graphs draft the top-k with tree_drafts).

    logits [D, V] per depth; uniforms [D * width], one per (depth, rank) slot; top_p None: no
    filter. Returns the drafts [T-1] and q [D, V], the drafter's sampling distribution per depth
    (the target's temperature and top-p). Node i takes the draw of slot (depth[i], rank[i]) from
    q[depth[i]]: siblings take distinct slots, so a node's children are i.i.d. draws from q of
    their depth, which the verifier's min(1, p/q) rule needs."""
    q = sampling_probs(logits, temperature, top_p)
    slot = depth * width + rank
    return inverse_cdf_rows(q.index_select(0, depth), uniforms.index_select(0, slot)), q
