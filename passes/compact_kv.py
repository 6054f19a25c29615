"""Pass `compact_kv`: the accepted path's K/V rows become contiguous in the cache."""
from __future__ import annotations

import torch
from torch import nn

from specc.pipeline import example_inputs, retrace
from specc.tree import Tree


class CompactKV(nn.Module):
    def __init__(self, inner: nn.Module, depth: int):
        super().__init__()
        self.inner = inner
        self.depth = depth
        self.cache_names = [n for n, _ in inner.named_buffers() if n.endswith(("k_cache", "v_cache"))]

    def forward(self, tokens, base_len, temperature, top_p, uniforms):
        n, path, out, *taps = self.inner(tokens, base_len, temperature, top_p, uniforms)
        src = base_len + path
        dst = base_len + torch.arange(self.depth + 1)
        for name in self.cache_names:
            cache = self.inner.get_buffer(name)
            cache.index_copy_(2, dst, cache.index_select(2, src))
        return (n, path, out, *taps)


def compact_kv(ep: torch.export.ExportedProgram, tree: Tree) -> torch.export.ExportedProgram:
    """Invariant: after the step, slots base_len .. base_len + n_accepted hold the K/V of the root
    and the accepted nodes in path order, so the committed prefix is contiguous. For a chain the
    accepted path is already in place and the program is returned unchanged."""
    if tree.is_chain:
        return ep
    return retrace(CompactKV(ep.module(), tree.max_depth), example_inputs(ep))
