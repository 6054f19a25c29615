"""The calling conventions of an engine's decode graphs, each written once.

`StepSignature`: the target's step graph (a token tree verified in one call) and its fused form,
which also updates the drafter and returns the next tree's drafts. The passes that make these
graphs (`accept`, `fuse_step`) export them with `example_inputs()`, and the runtime calls them
with `args(...)` and reads their outputs with `unpack(...)`.

`DraftSignature`: the step graphs of the drafters that read the target's hidden states (DFlash,
MTP): committed rows in, drafts for the next tree out. One layout for both kinds: row i holds
the hidden features of the committed token at position ctx_start + i and is paired with
next_tokens[i], the token at position ctx_start + i + 1 (MTP mixes it into row i; DFlash reads
next_tokens[n_ctx - 1], the block's anchor).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor


@dataclass(frozen=True)
class SampledChildren:
    """An engine whose drafter samples each node's children i.i.d. (`--children sampled`): its
    drafter graphs return q [q_rows, vocab] beside the drafts and take q_rows * width uniforms; its
    step graph takes that q and verifies with the min(1, p/q) rule."""
    q_rows: int  # one drafter distribution per depth (MTP) or block position (DFlash)
    vocab: int
    width: int  # draws per distribution: the tree's widest rank + 1

    @property
    def uniforms(self) -> int:
        return self.q_rows * self.width

    @staticmethod
    def from_entry(entry: dict, vocab: int) -> "SampledChildren | None":
        """From a drafter's manifest entry (its "children", "q_rows" and "width"); None for top-k."""
        if entry.get("children") != "sampled":
            return None
        return SampledChildren(entry["q_rows"], vocab, entry["width"])


class StepOutputs(NamedTuple):
    n: Tensor  # accepted drafts []
    path: Tensor  # accepted node indices from the root [D+1], padded by repeating the last
    out: Tensor  # accepted tokens, then the bonus token (repeated) [D+1]
    taps: tuple  # unfused: the taps of every tree node, each [1, T, H]
    next_drafts: Tensor | None  # fused: the next tree's drafts [T-1]
    next_q: Tensor | None  # fused with sampled children: the next tree's q


@dataclass(frozen=True)
class StepSignature:
    """inputs:  tokens [T] (root, then the drafts), base_len [] (tokens in the cache), temperature [],
                top_p [], uniforms [T+1]; sampled children add draft_q [q_rows, V] (this tree's q);
                the fused graph with sampled children adds draft_uniforms [q_rows * width] (the next tree's).
       outputs: n, path, out, then the taps (unfused) or next_drafts [T-1] (+ next_q) (fused)."""
    size: int  # T, the tree's nodes
    sampled: SampledChildren | None = None
    fused: bool = False

    def args(self, tokens, base_len, temperature, top_p, uniforms, draft_q=None, draft_uniforms=None) -> tuple:
        extra = (draft_q,) if self.sampled is not None else ()
        if self.fused and self.sampled is not None:
            extra += (draft_uniforms,)
        return (tokens, base_len, temperature, top_p, uniforms, *extra)

    def example_inputs(self) -> tuple:
        s = self.sampled
        return self.args(torch.zeros(self.size, dtype=torch.int64), torch.tensor(0), torch.tensor(0.0),
                         torch.tensor(1.0), torch.zeros(self.size + 1),
                         torch.zeros(s.q_rows, s.vocab) if s else None, torch.zeros(s.uniforms) if s else None)

    def outputs(self, n, path, out, taps=(), next_drafts=None, next_q=None) -> tuple:
        if not self.fused:
            return (n, path, out, *taps)
        return (n, path, out, next_drafts, next_q) if self.sampled is not None else (n, path, out, next_drafts)

    def unpack(self, outputs) -> StepOutputs:
        n, path, out, *rest = outputs
        if not self.fused:
            return StepOutputs(n, path, out, tuple(rest), None, None)
        return StepOutputs(n, path, out, (), rest[0], rest[1] if self.sampled is not None else None)


@dataclass(frozen=True)
class DraftSignature:
    """inputs:  rows [R, width] (hidden features of committed tokens; rows past n_ctx are padding),
                next_tokens [R] int64, ctx_start [], n_ctx []; with sampled children also
                temperature [], top_p [], uniforms [q_rows * width].
       outputs: drafts [T-1]; with sampled children (drafts, q [q_rows, V])."""
    sampled: SampledChildren | None = None

    def args(self, rows, next_tokens, ctx_start, n_ctx, temperature=None, top_p=None, uniforms=None) -> tuple:
        sampling = (temperature, top_p, uniforms) if self.sampled is not None else ()
        return (rows, next_tokens, ctx_start, n_ctx, *sampling)

    def example_inputs(self, rows: int, width: int, dtype: torch.dtype) -> tuple:
        s = self.sampled
        return self.args(torch.zeros(rows, width, dtype=dtype), torch.zeros(rows, dtype=torch.int64),
                         torch.tensor(0), torch.tensor(rows), torch.tensor(0.0), torch.tensor(1.0),
                         torch.zeros(s.uniforms) if s else None)

    def unpack(self, outputs) -> tuple[Tensor, Tensor | None]:
        """(drafts, q or None)."""
        return tuple(outputs) if self.sampled is not None else (outputs, None)
