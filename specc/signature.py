"""The calling conventions of an engine's decode graphs, each written once.

`StepSignature`: the target's step graph (a token tree verified in one call) and its fused form,
which also updates the drafter and returns the next tree's drafts. The passes that make these
graphs (`accept`, `fuse_step`) export them with `example_inputs()`, and the runtime calls them
with `args(...)` and reads their outputs with `unpack(...)`.

`DraftSignature`: the step graphs of the drafters that read the target's hidden states (DFlash,
DSpark, MTP): committed rows in, drafts for the next tree out (and DSpark's confidences). One
layout for all: row i holds the hidden features of the committed token at position ctx_start + i
and is paired with next_tokens[i], the token at position ctx_start + i + 1 (MTP mixes it into row
i; DFlash and DSpark read next_tokens[n_ctx - 1], the block's anchor).

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


def uniform_columns(size: int, sampled: SampledChildren | None) -> int:
    """Columns of an engine's table of uniforms (one row per cache position, drawn once per
    generation from the seeded generator, indexed inside the graphs). Row r belongs to the call
    whose root sits at position r (its base_len): columns [0, T] verify that call's tree (plain
    decoding and a prefill chunk's last row read [0, 1]); with sampled children, the next tree's
    draws follow. Every decode call advances base_len, so no draw is ever used twice."""
    return size + 1 + (sampled.uniforms if sampled is not None else 0)


def split_report(report):
    """A step's report [2D+3] (a tensor, or the host's list) -> (n, path [D+1], out [D+1])."""
    depth = (len(report) - 3) // 2
    return report[0], report[1: depth + 2], report[depth + 2:]


class StepOutputs(NamedTuple):
    report: Tensor  # [2D+3] int64: n_accepted, path, out (split_report): what the host reads, once
    base_len: Tensor  # [] the next call's base_len: base_len + n_accepted + 1
    tokens: Tensor  # the next call's tokens: unfused [1] (the root: the bonus token); fused [T] (root + drafts)
    taps: tuple  # unfused: the taps of every tree node, each [1, T, H]
    next_q: Tensor | None  # fused with sampled children: the next tree's q
    confidence: Tensor | None = None  # fused, with a drafter that rates its drafts (DSpark): [T-1]


@dataclass(frozen=True)
class StepSignature:
    """inputs:  tokens [T] (root, then the drafts), base_len [] (tokens in the cache), then the mode's
                sampling inputs (temperature [], top_p [], uniforms [rows, cols]: the generation's
                table, see uniform_columns and sampling_inputs); in a sampling mode, sampled
                children add draft_q [q_rows, V] (this tree's q).
       outputs: report [2D+3], next base_len [], then the root [1] and the taps (unfused) or the next
                tree's tokens [T] (+ its q) (+ the drafter's confidences [T-1]) (fused): what the next
                call takes, kept on the device."""
    size: int  # T, the tree's nodes
    sampled: SampledChildren | None = None
    fused: bool = False
    mode: str = "greedy"
    table: tuple[int, int] | None = None  # (rows, cols) of the uniforms table: needed in the sampling modes
    confidence: bool = False  # the fused graph also returns the drafter's confidence in each next draft

    def __post_init__(self):
        if check_mode(self.mode) == "greedy":  # greedy verification ignores q: the drafts are the top-k
            object.__setattr__(self, "sampled", None)

    def args(self, tokens, base_len, temperature=None, top_p=None, uniforms=None, draft_q=None) -> tuple:
        extra = (draft_q,) if self.sampled is not None else ()
        return (tokens, base_len, *sampling_inputs(self.mode, temperature, top_p, uniforms), *extra)

    def parse(self, args: tuple) -> tuple[Sampling, Tensor | None]:
        """A graph's inputs after (tokens, base_len) -> (sampling, draft_q)."""
        n = len(sampling_inputs(self.mode, None, None, None))
        return parse_sampling(tuple(args[:n])), (args[n] if len(args) > n else None)

    def example_inputs(self) -> tuple:
        s, table = self.sampled, self.table
        if table is None and self.mode != "greedy":
            raise ValueError("a sampling mode's step graph needs the shape of the uniforms table")
        return self.args(torch.zeros(self.size, dtype=torch.int64), torch.tensor(0), torch.tensor(1.0),
                         torch.tensor(0.5), torch.zeros(table) if table else None,
                         torch.zeros(s.q_rows, s.vocab) if s else None)

    def outputs(self, n, path, out, base_len, taps=(), next_drafts=None, next_q=None, confidence=None) -> tuple:
        report = torch.cat((n.view(1), path, out))
        root = out.index_select(0, n.view(1))
        next_base_len = base_len + n + 1
        if not self.fused:
            return (report, next_base_len, root, *taps)
        tokens = torch.cat((root, next_drafts))
        return ((report, next_base_len, tokens) + ((next_q,) if self.sampled is not None else ())
                + ((confidence,) if self.confidence else ()))

    def unpack(self, outputs) -> StepOutputs:
        report, base_len, tokens, *rest = outputs
        if not self.fused:
            return StepOutputs(report, base_len, tokens, tuple(rest), None)
        q = rest.pop(0) if self.sampled is not None else None
        return StepOutputs(report, base_len, tokens, (), q, rest[0] if self.confidence else None)


@dataclass(frozen=True)
class DraftSignature:
    """inputs:  rows [R, width] (hidden features of committed tokens; rows past n_ctx are padding),
                next_tokens [R] int64, ctx_start [], n_ctx []; with sampled children in a sampling
                mode also the mode's sampling inputs (uniforms [q_rows * width]).
       outputs: drafts [T-1]; with sampled children in a sampling mode also q [q_rows, V]; with
                `confidence` (DSpark) also the drafter's confidence in each draft [T-1]."""
    sampled: SampledChildren | None = None
    mode: str = "greedy"
    confidence: bool = False

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

    def unpack(self, outputs) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(drafts, q or None, confidences or None)."""
        outs = list(outputs) if self.sampled is not None or self.confidence else [outputs]
        drafts = outs.pop(0)
        q = outs.pop(0) if self.sampled is not None else None
        return drafts, q, (outs[0] if self.confidence else None)
