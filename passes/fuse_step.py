"""Pass `fuse_step`: verify + accept + KV compaction + the drafter's update and next draft, one graph.

Unfused, a step of a hidden-state drafter (DFlash, DSpark, MTP) is two graph calls with the host in
between: the target's step graph returns the accepted path and the taps of every tree node; the
host gathers the accepted rows and calls the drafter's step graph, which caches them and drafts
the next tree. Fused, that gather and the drafter run inside the step graph, so a decode step is
one call whose outputs include the next step's tree tokens.

An adaptive engine (specc/adaptive.py) fuses each prefix of the tree's verify graphs with the same
drafter graph: it verifies the prefix's `verify_size` nodes and drafts the whole next tree.
"""
from __future__ import annotations

import torch
from torch import nn

from specc.pipeline import capture
from specc.signature import DraftSignature, StepSignature, split_report
from specc.tree import Tree


class FusedStep(nn.Module):
    def __init__(self, verify_step: nn.Module, draft_step: nn.Module, tree: Tree, draft: DraftSignature,
                 table: tuple[int, int] | None = None, verify_size: int | None = None):
        super().__init__()
        # `inner` keeps the target's tensor names canonical (see pipeline.canonical_name); the
        # drafter's tensors are named "draft.<its own name>".
        self.inner, self.draft, self.T = verify_step, draft_step, tree.size
        k = verify_size or tree.size  # the nodes verified: the tree's first k
        self.verify_signature = StepSignature(k, draft.sampled, mode=draft.mode, table=table)
        self.signature = StepSignature(k, draft.sampled, fused=True, mode=draft.mode, table=table,
                                       confidence=draft.confidence)
        self.draft_signature = draft

    def forward(self, tokens, base_len, *rest):  # rest: the mode's sampling inputs (+ draft_q)
        # Sampled children: this tree's q goes to the verifier; the next tree is drawn with the
        # draws after this tree's in the table's row base_len (uniform_columns).
        s, draft_q = self.signature.parse(rest)
        temperature, top_p, uniforms = s.temperature, s.top_p, s.uniforms
        step = self.verify_signature.unpack(self.inner(*self.verify_signature.args(
            tokens, base_len, temperature, top_p, uniforms, draft_q)))
        n, path, out = split_report(step.report)
        # The root and the accepted nodes are now committed at base_len, base_len+1, ...: their
        # rows feed the drafter's cache. Rows past n (the path's padding, then zeros) are the
        # padding the drafter's step graph ignores. Row i pairs with the token after it, out[i]
        # (row n with the bonus token, the next block's anchor).
        rows = torch.cat(step.taps, dim=-1)[0].index_select(0, path)
        pad = self.T - rows.shape[0]
        rows = torch.cat((rows, rows.new_zeros(pad, rows.shape[1])))
        next_tokens = torch.cat((out, out.new_zeros(pad)))
        draft_uniforms = None
        if self.draft_signature.sampled is not None:
            draft_uniforms = uniforms.index_select(0, base_len.view(1))[0, self.T + 1:]
        drafts, q, confidence = self.draft_signature.unpack(self.draft(*self.draft_signature.args(
            rows, next_tokens, base_len, n + 1, temperature, top_p, draft_uniforms)))
        return self.signature.outputs(n, path, out, base_len, next_drafts=drafts, next_q=q, confidence=confidence)


def fuse_step(verify_ep: torch.export.ExportedProgram, draft_ep: torch.export.ExportedProgram, tree: Tree,
              draft: DraftSignature, table: tuple[int, int] | None = None,
              verify_size: int | None = None) -> torch.export.ExportedProgram:
    """Invariant: the program has the fused StepSignature of `draft.mode`: the target step's inputs
    (tokens [verify_size]: `verify_ep` verifies the tree's first verify_size nodes, default all),
    outputs (report [2D+3], next base_len [], the next tree's tokens [T] (its root: the bonus token;
    then the drafts) (+ its q) (+ the drafter's confidences)); the target's KV cache ends as after the unfused step, and the
    drafter's cache and next drafts are exactly what its step graph (DraftSignature, T rows) gives
    for the accepted rows (ctx_start = base_len, n_ctx = n + 1) and, with sampled children, the
    draws that follow this tree's in row base_len of the uniforms table."""
    module = FusedStep(verify_ep.module(), draft_ep.module(), tree, draft, table, verify_size)
    return capture(module, module.signature.example_inputs())
