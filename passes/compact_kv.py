"""Pass `compact_kv`: the accepted path's K/V rows become contiguous in the cache."""
from __future__ import annotations

import torch
from torch import nn

import specc.kernels  # noqa: F401  (registers torch.ops.specc.compact_kv_)
from specc.pipeline import Uncaptured
from specc.signature import split_report
from specc.tree import Tree


class CompactKV(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.cache_names = [n for n, _ in inner.named_buffers() if n.endswith(("k_cache", "v_cache"))]

    def forward(self, tokens, base_len, *rest):  # rest: the StepSignature inputs after these two
        report, *outputs = self.inner(tokens, base_len, *rest)
        _, path, _ = split_report(report)
        # Slot base_len + i receives node path[i]: an accepted node's index is at least its depth, and
        # the padding repeats the last node, so the op's in-place precondition holds (specc/kernels/compact_kv.py).
        src = base_len + path
        for name in self.cache_names:
            torch.ops.specc.compact_kv_(self.inner.get_buffer(name), src, base_len)
        return (report, *outputs)


def compact_kv(prev: Uncaptured, tree: Tree) -> Uncaptured:
    """Invariant: after the step, slots base_len .. base_len + n_accepted hold the K/V of the root
    and the accepted nodes in path order, so the committed prefix is contiguous. For a chain the
    accepted path is already in place and the program is returned unchanged."""
    if tree.is_chain:
        return prev
    return Uncaptured(CompactKV(prev.module), prev.args)
