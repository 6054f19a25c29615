"""Pass `fuse_step`: verify + accept + KV compaction + the drafter's update and next draft, one graph.

Unfused, a step of a hidden-state drafter (DFlash, MTP) is two graph calls with the host in
between: the target's step graph returns the accepted path and the taps of every tree node; the
host gathers the accepted rows and calls the drafter's step graph, which caches them and drafts
the next tree. Fused, that gather and the drafter run inside the step graph, so a decode step is
one call whose outputs include the next step's tree tokens.
"""
from __future__ import annotations

import torch
from torch import nn

from specc.pipeline import retrace
from specc.tree import Tree


class FusedStep(nn.Module):
    def __init__(self, verify_step: nn.Module, draft_step: nn.Module, kind: str, tree: Tree, sampled: bool = False):
        super().__init__()
        # `inner` keeps the target's tensor names canonical (see pipeline.canonical_name); the
        # drafter's tensors are named "draft.<its own name>".
        self.inner, self.draft, self.kind, self.T = verify_step, draft_step, kind, tree.size
        self.sampled = sampled

    def forward(self, tokens, base_len, temperature, top_p, uniforms, draft_q=None, draft_uniforms=None):
        # Sampled children: this tree's q goes to the verifier; the next tree is drawn with draft_uniforms.
        extra = (draft_q,) if self.sampled else ()
        n, path, out, *taps = self.inner(tokens, base_len, temperature, top_p, uniforms, *extra)
        # The root and the accepted nodes are now committed at base_len, base_len+1, ...: their
        # rows feed the drafter's cache. Rows past n (the path's padding, then zeros) are the
        # padding the drafter's step graph already ignores.
        rows = torch.cat(taps, dim=-1)[0].index_select(0, path)
        pad = self.T - rows.shape[0]
        rows = torch.cat((rows, rows.new_zeros(pad, rows.shape[1])))
        n_ctx = n + 1
        sampling = (temperature, top_p, draft_uniforms) if self.sampled else ()
        if self.kind == "dflash":  # the block starts at the bonus token, right after those rows
            drafts = self.draft(rows, base_len, n_ctx, out.index_select(0, n.view(1)).view(()), *sampling)
        else:  # mtp: row i (position base_len + i) pairs with the token after it, out[i]
            nxt = torch.cat((out, out.new_zeros(pad)))
            drafts = self.draft(rows, nxt, base_len, n_ctx, *sampling)
        return (n, path, out, *drafts) if self.sampled else (n, path, out, drafts)


def fuse_step(verify_ep: torch.export.ExportedProgram, draft_ep: torch.export.ExportedProgram, kind: str,
              tree: Tree, sampled: tuple[int, int, int] | None = None) -> torch.export.ExportedProgram:
    """Invariant: inputs are the target step's (tokens [T], base_len, temperature, top_p, uniforms
    [T+1]); outputs are (n_accepted, path [D+1], out_tokens [D+1], next_drafts [T-1]); the target's
    KV cache ends as after the unfused step, and the drafter's cache and next drafts are exactly
    what its step graph gives for the accepted rows (ctx_start = base_len, n_ctx = n + 1).
    `sampled` = (q rows, vocab, draft uniforms) for sampled children: the inputs add draft_q
    [q_rows, V] (this tree's) and draft_uniforms, the outputs add the next tree's q."""
    module = FusedStep(verify_ep.module(), draft_ep.module(), kind, tree, sampled is not None)
    args = (torch.zeros(tree.size, dtype=torch.int64), torch.tensor(0), torch.tensor(0.0), torch.tensor(1.0),
            torch.zeros(tree.size + 1))
    if sampled is not None:
        q_rows, vocab, n_uniforms = sampled
        args += (torch.zeros(q_rows, vocab), torch.zeros(n_uniforms))
    return retrace(module, args)
