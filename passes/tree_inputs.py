"""Pass `tree_inputs`: positions, cache slots and the tree mask are computed in the graph."""
from __future__ import annotations

import torch
from torch import nn

from specc.target_module import additive_mask
from specc.pipeline import Uncaptured
from specc.tree import Tree


class TreeInputs(nn.Module):
    def __init__(self, inner: nn.Module, tree: Tree, cache_len: int):
        super().__init__()
        self.inner = inner
        self.T, self.cache_len = tree.size, cache_len
        self.register_buffer("depths", torch.tensor(tree.depths, dtype=torch.int64), persistent=False)
        self.register_buffer("ancestors", tree.ancestor_mask(), persistent=False)

    def forward(self, tokens, base_len):
        T, S = self.T, self.cache_len
        slots = torch.arange(T) + base_len
        positions = (self.depths + base_len).view(1, T)
        cols = torch.arange(S)
        rel = cols - base_len  # the tree's own slots are rel 0..T-1
        in_tree = (rel >= 0) & (rel < T)
        # where(), not clamp(): an integer clamp exports to Clip, which TensorRT runs on floats only
        tree_ok = self.ancestors[:, torch.where(in_tree, rel, 0)] & in_tree.view(1, S)
        allowed = (rel < 0).view(1, S) | tree_ok
        mask = additive_mask(allowed).view(1, 1, T, S)  # the target casts it to its dtype
        return self.inner(tokens.view(1, T), positions, slots, mask)


def tree_inputs(prev: Uncaptured, tree: Tree, cache_len: int) -> Uncaptured:
    """Invariant: inputs are (tokens [T], base_len []); node i sits at position base_len + depth(i),
    writes its K/V to slot base_len + i, and attends to every slot < base_len plus its ancestors and
    itself. A prefill chunk is the chain tree, so the same pass serves prefill and decode.
    The caller guarantees base_len + T <= cache_len."""
    return Uncaptured(TreeInputs(prev.module, tree, cache_len),
                      (torch.zeros(tree.size, dtype=torch.int64), torch.tensor(0)))
