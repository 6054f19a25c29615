"""Pass `accept`: acceptance of the drafted tree is decided inside the step graph."""
from __future__ import annotations

import torch
from torch import nn

from specc.acceptance import accept as accept_tree
from specc.pipeline import Uncaptured
from specc.signature import SampledChildren, StepSignature
from specc.tree import Tree


class Accept(nn.Module):
    def __init__(self, inner: nn.Module, tree: Tree, sampled: SampledChildren | None = None, mode: str = "greedy",
                 table: tuple[int, int] | None = None):
        super().__init__()
        self.inner = inner
        self.parents = tree.parents
        self.signature = StepSignature(tree.size, sampled, mode=mode, table=table)
        sampled = self.signature.sampled  # None in greedy mode
        self.register_buffer("child_table", tree.child_table(), persistent=False)
        if sampled is not None:  # node i's children were drawn from q[depth i] (a leaf's row is never read)
            rows = [min(d, sampled.q_rows - 1) for d in tree.depths]
            self.register_buffer("q_row", torch.tensor(rows, dtype=torch.int64), persistent=False)

    def forward(self, tokens, base_len, *rest):  # rest: the mode's sampling inputs (+ draft_q)
        sampling, draft_q = self.signature.parse(rest)
        logits, *taps = self.inner(tokens, base_len)
        draft_probs = draft_q.index_select(0, self.q_row) if draft_q is not None else None
        uniforms = None
        if sampling.uniforms is not None:  # this call's row of the generation's table: its first T+1 draws
            uniforms = sampling.uniforms.index_select(0, base_len.view(1))[0, : tokens.shape[0] + 1]
        n, path, out = accept_tree(logits[0], tokens, self.parents, self.child_table, sampling.temperature,
                                   sampling.top_p, uniforms, draft_probs, mode=sampling.mode)
        return self.signature.outputs(n, path, out, base_len, taps)


def accept(prev: Uncaptured, tree: Tree, sampled: SampledChildren | None = None, mode: str = "greedy",
           table: tuple[int, int] | None = None) -> Uncaptured:
    """Invariant: the program has the StepSignature of `tree` (unfused): outputs are (report [2D+3],
    next base_len [], root [1], *taps): the report packs n_accepted, the accepted draft nodes from
    the root and the accepted tokens followed by the bonus token (the root of the next call),
    chosen by greedy argmax (mode greedy: no sampling inputs, no sampling code) or exact tree
    rejection sampling (modes sample and top_p) with the draws of row base_len of the uniforms
    table `table` (rows, cols). The logits never leave the graph. With `sampled` children a sampling graph takes
    draft_q [q_rows, vocab] too: row d is the distribution the children at depth d+1 were drawn
    from, and sampling uses the min(1, p/q) rule with residuals."""
    module = Accept(prev.module, tree, sampled, mode, table)
    return Uncaptured(module, module.signature.example_inputs())
