"""Pass `accept`: acceptance of the drafted tree is decided inside the step graph."""
from __future__ import annotations

import torch
from torch import nn

from specc.acceptance import accept as accept_tree
from specc.pipeline import capture
from specc.signature import SampledChildren, StepSignature
from specc.tree import Tree


class Accept(nn.Module):
    def __init__(self, inner: nn.Module, tree: Tree, sampled: SampledChildren | None = None):
        super().__init__()
        self.inner = inner
        self.parents = tree.parents
        self.signature = StepSignature(tree.size, sampled)
        self.register_buffer("child_table", tree.child_table(), persistent=False)
        if sampled is not None:  # node i's children were drawn from q[depth i] (a leaf's row is never read)
            rows = [min(d, sampled.q_rows - 1) for d in tree.depths]
            self.register_buffer("q_row", torch.tensor(rows, dtype=torch.int64), persistent=False)

    def forward(self, tokens, base_len, temperature, top_p, uniforms, draft_q=None):
        logits, *taps = self.inner(tokens, base_len)
        draft_probs = draft_q.index_select(0, self.q_row) if draft_q is not None else None
        n, path, out = accept_tree(logits[0], tokens, self.parents, self.child_table, temperature, top_p, uniforms,
                                   draft_probs)
        return self.signature.outputs(n, path, out, taps)


def accept(ep: torch.export.ExportedProgram, tree: Tree,
           sampled: SampledChildren | None = None) -> torch.export.ExportedProgram:
    """Invariant: the program has the StepSignature of `tree` (unfused): outputs are (n_accepted [],
    path [D+1], out_tokens [D+1], *taps): the accepted draft nodes from the root, and the accepted
    tokens followed by the bonus token, chosen by greedy argmax (temperature <= 0) or exact tree
    rejection sampling with the given uniforms [T+1]. The logits never leave the graph. With
    `sampled` children the graph takes draft_q [q_rows, vocab] too: row d is the distribution the
    children at depth d+1 were drawn from, and sampling uses the min(1, p/q) rule with residuals."""
    return capture(Accept(ep.module(), tree, sampled), StepSignature(tree.size, sampled).example_inputs())
