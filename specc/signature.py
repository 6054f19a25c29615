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

Modes: an engine holds one graph per sampling mode (`MODES`), chosen when a generation starts, so
no graph branches on a run-time value. A greedy graph takes no temperature, top-p or random
numbers and carries no sampling code; a `sample` graph takes the temperature and the uniforms; a
`top_p` graph takes top-p too. With sampled children, greedy graphs draft the top-k (as a top-k
engine does): q and its draws exist only in the sampling modes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor


MODES = ("greedy", "sample", "top_p")


def mode_of(temperature: float, top_p: float) -> str:
    """The mode a generation with these settings runs in."""
    return "greedy" if temperature <= 0 else "sample" if top_p >= 1 else "top_p"


def graph_name(name: str, mode: str | None) -> str:
    """The key of a graph in an engine: mode-specific graphs carry their mode (`step_top_p`)."""
    return name if mode is None else f"{name}_{mode}"


def graphs_for_mode(graphs: dict, mode: str) -> dict:
    """The graphs a generation in `mode` runs, by name without the mode: that mode's graphs and
    those that serve every mode."""
    out = {}
    for key, graph in graphs.items():
        own = next((m for m in MODES if key.endswith("_" + m)), None)
        if own is None:
            out[key] = graph
        elif own == mode:
            out[key[: -len(own) - 1]] = graph
    return out


def sampling_inputs(mode: str, temperature, top_p, uniforms) -> tuple:
    """The sampling inputs a graph of `mode` takes, in order."""
    return {"greedy": (), "sample": (temperature, uniforms), "top_p": (temperature, top_p, uniforms)}[mode]


class Sampling(NamedTuple):
    mode: str
    temperature: Tensor | None
    top_p: Tensor | None  # None: no top-p filter
    uniforms: Tensor | None


def parse_sampling(args: tuple) -> Sampling:
    """The inverse of sampling_inputs: the mode is the number of inputs (a static fact when tracing)."""
    if len(args) == 0:
        return Sampling("greedy", None, None, None)
    if len(args) == 2:
        return Sampling("sample", args[0], None, args[1])
    if len(args) == 3:
        return Sampling("top_p", *args)
    raise TypeError(f"a graph takes 0, 2 or 3 sampling inputs, not {len(args)}")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; one of {MODES}")
    return mode


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
    """inputs:  tokens [T] (root, then the drafts), base_len [] (tokens in the cache), then the mode's
                sampling inputs (temperature [], top_p [], uniforms [T+1]: see sampling_inputs); in a
                sampling mode, sampled children add draft_q [q_rows, V] (this tree's q), and the fused
                graph with sampled children adds draft_uniforms [q_rows * width] (the next tree's).
       outputs: n, path, out, then the taps (unfused) or next_drafts [T-1] (+ next_q) (fused)."""
    size: int  # T, the tree's nodes
    sampled: SampledChildren | None = None
    fused: bool = False
    mode: str = "greedy"

    def __post_init__(self):
        if check_mode(self.mode) == "greedy":  # greedy verification ignores q: the drafts are the top-k
            object.__setattr__(self, "sampled", None)

    def args(self, tokens, base_len, temperature=None, top_p=None, uniforms=None, draft_q=None,
             draft_uniforms=None) -> tuple:
        extra = (draft_q,) if self.sampled is not None else ()
        if self.fused and self.sampled is not None:
            extra += (draft_uniforms,)
        return (tokens, base_len, *sampling_inputs(self.mode, temperature, top_p, uniforms), *extra)

    def parse(self, args: tuple) -> tuple[Sampling, Tensor | None, Tensor | None]:
        """A graph's inputs after (tokens, base_len) -> (sampling, draft_q, draft_uniforms)."""
        n = len(sampling_inputs(self.mode, None, None, None))
        extra = list(args[n:]) + [None, None]
        return parse_sampling(tuple(args[:n])), extra[0], extra[1]

    def example_inputs(self) -> tuple:
        s = self.sampled
        return self.args(torch.zeros(self.size, dtype=torch.int64), torch.tensor(0), torch.tensor(1.0),
                         torch.tensor(0.5), torch.zeros(self.size + 1),
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
                next_tokens [R] int64, ctx_start [], n_ctx []; with sampled children in a sampling
                mode also the mode's sampling inputs (uniforms [q_rows * width]).
       outputs: drafts [T-1]; with sampled children in a sampling mode (drafts, q [q_rows, V])."""
    sampled: SampledChildren | None = None
    mode: str = "greedy"

    def __post_init__(self):
        if check_mode(self.mode) == "greedy":
            object.__setattr__(self, "sampled", None)

    def args(self, rows, next_tokens, ctx_start, n_ctx, temperature=None, top_p=None, uniforms=None) -> tuple:
        sampling = sampling_inputs(self.mode, temperature, top_p, uniforms) if self.sampled is not None else ()
        return (rows, next_tokens, ctx_start, n_ctx, *sampling)

    def example_inputs(self, rows: int, width: int, dtype: torch.dtype) -> tuple:
        s = self.sampled
        return self.args(torch.zeros(rows, width, dtype=dtype), torch.zeros(rows, dtype=torch.int64),
                         torch.tensor(0), torch.tensor(rows), torch.tensor(1.0), torch.tensor(0.5),
                         torch.zeros(s.uniforms) if s else None)

    def unpack(self, outputs) -> tuple[Tensor, Tensor | None]:
        """(drafts, q or None)."""
        return tuple(outputs) if self.sampled is not None else (outputs, None)
