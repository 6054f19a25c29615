"""Pass `verify`: acceptance of the drafted tree is decided inside the step graph."""
from __future__ import annotations

import torch
from torch import nn

from specc.pipeline import retrace
from specc.tree import Tree
from specc.verify import accept


class Verify(nn.Module):
    def __init__(self, inner: nn.Module, tree: Tree):
        super().__init__()
        self.inner = inner
        self.parents = tree.parents
        self.register_buffer("child_table", tree.child_table(), persistent=False)

    def forward(self, tokens, base_len, temperature, top_p, uniforms):
        logits, *taps = self.inner(tokens, base_len)
        n, path, out = accept(logits[0], tokens, self.parents, self.child_table, temperature, top_p, uniforms)
        return (n, path, out, *taps)


def verify(ep: torch.export.ExportedProgram, tree: Tree) -> torch.export.ExportedProgram:
    """Invariant: outputs are (n_accepted [], path [D+1], out_tokens [D+1], *taps): the accepted
    draft nodes from the root, and the accepted tokens followed by the bonus token, chosen by
    greedy argmax (temperature <= 0) or exact tree rejection sampling with the given uniforms
    [T+1]. The logits never leave the graph."""
    T = tree.size
    args = (torch.zeros(T, dtype=torch.int64), torch.tensor(0), torch.tensor(0.0), torch.tensor(1.0),
            torch.zeros(T + 1))
    return retrace(Verify(ep.module(), tree), args)
