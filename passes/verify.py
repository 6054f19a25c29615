"""Pass `verify`: acceptance of the drafted tree is decided inside the step graph."""
from __future__ import annotations

import torch
from torch import nn

from specc.pipeline import retrace
from specc.tree import Tree
from specc.verify import accept


class Verify(nn.Module):
    def __init__(self, inner: nn.Module, tree: Tree, q_rows: int | None = None):
        super().__init__()
        self.inner = inner
        self.parents = tree.parents
        self.register_buffer("child_table", tree.child_table(), persistent=False)
        self.sampled = q_rows is not None
        if self.sampled:  # node i's children were drawn from q[depth i] (a leaf's row is never read)
            rows = [min(d, q_rows - 1) for d in tree.depths]
            self.register_buffer("q_row", torch.tensor(rows, dtype=torch.int64), persistent=False)

    def forward(self, tokens, base_len, temperature, top_p, uniforms, draft_q=None):
        logits, *taps = self.inner(tokens, base_len)
        draft_probs = draft_q.index_select(0, self.q_row) if self.sampled else None
        n, path, out = accept(logits[0], tokens, self.parents, self.child_table, temperature, top_p, uniforms,
                              draft_probs)
        return (n, path, out, *taps)


def verify(ep: torch.export.ExportedProgram, tree: Tree, q_rows: int | None = None,
           vocab: int | None = None) -> torch.export.ExportedProgram:
    """Invariant: outputs are (n_accepted [], path [D+1], out_tokens [D+1], *taps): the accepted
    draft nodes from the root, and the accepted tokens followed by the bonus token, chosen by
    greedy argmax (temperature <= 0) or exact tree rejection sampling with the given uniforms
    [T+1]. The logits never leave the graph. With `q_rows` (sampled children) the graph takes one
    more input, draft_q [q_rows, vocab]: row d is the distribution the children at depth d+1 were
    drawn from, and sampling uses the min(1, p/q) rule with residuals."""
    T = tree.size
    args = (torch.zeros(T, dtype=torch.int64), torch.tensor(0), torch.tensor(0.0), torch.tensor(1.0),
            torch.zeros(T + 1))
    if q_rows is not None:
        args += (torch.zeros(q_rows, vocab),)
    return retrace(Verify(ep.module(), tree, q_rows), args)
