"""What the drafter kinds that read the target's hidden states (DFlash, DSpark, MTP) share: their graphs
and their side of the host loop. All follow DraftSignature (specc/signature.py)."""
from __future__ import annotations

import torch

from ..errors import SpeccError
from ..plans import GraphPlan, start, uniform_table
from ..pipeline import Pipeline
from ..shipped import shipped_drafter
from ..signature import DraftSignature, SampledChildren, graph_name, graphs_for_mode
from ..tree import Tree


def drafter_path(cfg, kind: str, wanted: str):
    """--drafter-path, or on the embedded SmolLM2 the drafter of this kind shipped with specc (if any);
    `wanted` says what the path must hold, for the message when there is neither."""
    path = cfg.drafter_path if cfg.drafter_path is not None else shipped_drafter(kind) if cfg.model is None else None
    if path is None:
        raise SpeccError(f"--drafter {kind} needs --drafter-path DIR, {wanted}.")
    return path


def sampled_entry(children: str, q_rows: int, width: int) -> dict:
    """The manifest fields for `--children`: with sampled children, the shape of q and its draws."""
    out = {"children": children}
    if children == "sampled":
        out.update({"q_rows": q_rows, "width": width})
    return out


def plans(tree: Tree, chunk: int, cache_len: int, backend: str, sampled: SampledChildren | None,
          modes) -> list[GraphPlan]:
    # Rows of a prefill chunk and of one step (at most the tree's size are committed); then the
    # fused step: verify + accept + the drafter's update and next drafts in one graph. Top-k
    # drafters have one pair of graphs for every mode; sampled children one per mode.
    out = []
    for m in (modes if sampled is not None else (None,)):
        out += [GraphPlan(graph_name("draft_prefill", m), "draft", chunk, start(backend, verify=False), mode=m),
                GraphPlan(graph_name("draft_step", m), "draft", tree.size, start(backend, verify=False), mode=m)]
    draft_step = (lambda m: graph_name("draft_step", m if sampled is not None else None))
    return out + [GraphPlan(graph_name("fused", m), "fused", tree.size, Pipeline(),
                            fuse=(graph_name("step", m), draft_step(m)), mode=m,
                            table=uniform_table(cache_len, tree, sampled)) for m in modes]


def runtime(graphs: dict, tree: Tree, entry: dict, chunk: int, device) -> "HiddenStateDrafter":
    sampled = SampledChildren.from_entry(entry, vocab=0)  # the calling convention needs no vocabulary
    return HiddenStateDrafter(tree, graphs, chunk, device, sampled, entry.get("confidence", False))


class HiddenStateDrafter:
    """The runtime side of drafters conditioned on the target's hidden states (DFlash, DSpark, MTP).

    The target's step graph returns the hidden rows the drafter needs (its taps) for the committed
    tokens; they wait here until the next proposal flushes them through the drafter's graphs in
    padded pieces: `prefill_graph` takes `chunk` rows (a prompt), `step_graph` the tree's size (one
    step's commits). The last call drafts after the last committed token, whose own hidden row does
    not exist yet: every committed token but the last has its row. The drafter's step graph fills
    the whole tree (top-k candidates per depth, or i.i.d. draws with sampled children). A drafter
    with a confidence head (DSpark) also rates each draft: `confidence` [T-1] after a proposal."""

    needs_rows = True

    def __init__(self, tree: Tree, graphs: dict, chunk: int, device, sampled: SampledChildren | None,
                 confidence: bool = False):
        self.k = tree.size - 1  # the step graph returns one draft per non-root node
        self.tree_ranks = tree.ranks[1:]
        self.device, self.graphs, self.sampled, self.rates = device, graphs, sampled, confidence
        self.chunk, self.step_rows = chunk, tree.size
        self.q = self.confidence = None

    def start(self, prompt_ids: list[int], mode: str, temperature, top_p, table=None) -> None:
        """mode: the generation's; temperature, top_p: 0-d tensors on the engine's device; table: the
        generation's uniforms (signature.uniform_columns): a call at ctx_start p draws from row p,
        after the T+1 draws that verify the tree of the step at p (what the fused step reads too)."""
        # Sampled children in a sampling mode: the graphs also take the mode's sampling inputs and
        # return q beside the drafts; the last proposal's q is what the step graph verifies against.
        self.signature = DraftSignature(self.sampled, mode, self.rates)
        self.n_uniforms = self.signature.sampled.uniforms if self.signature.sampled is not None else 0
        graphs = graphs_for_mode(self.graphs, mode)
        self.prefill_graph, self.step_graph = graphs["draft_prefill"], graphs["draft_step"]
        self.pending: list[torch.Tensor] = []  # rows not yet in the drafter's cache
        self.pending_start = 0  # position of the first pending row
        self.sampling = (temperature, top_p, table)
        self.q = self.confidence = None

    def add_rows(self, rows: torch.Tensor, start: int) -> None:
        """rows [n, width]: the hidden rows of committed tokens at positions start..start+n-1."""
        if not self.pending:
            self.pending_start = start
        self.pending.append(rows)

    def _call(self, graph, piece, m: int, pos: int, R: int, committed: list[int]):
        dev = lambda v, **kw: torch.tensor(v, device=self.device, **kw)  # noqa: E731
        temperature, top_p, table = self.sampling
        first = self.step_rows + 1
        uniforms = table[pos, first: first + self.n_uniforms] if self.n_uniforms else None
        next_tokens = committed[pos + 1: pos + m + 1] + [0] * (R - m)  # row p pairs with the token at p + 1
        return self.signature.unpack(graph(*self.signature.args(
            piece, dev(next_tokens, dtype=torch.int64), dev(pos), dev(m), temperature, top_p, uniforms)))

    def propose(self, committed: list[int]) -> tuple[torch.Tensor, bool]:
        """The next tree's drafts [T-1], left on the device (the step graph takes them from there)."""
        rows = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
        start, n = self.pending_start, rows.shape[0]
        assert start + n == len(committed) - 1, "every committed token but the last has its hidden row"
        drafts, done = None, 0
        while done < n:  # the last call's drafts are the ones that count
            R, graph = ((self.step_rows, self.step_graph) if n - done <= self.step_rows
                        else (self.chunk, self.prefill_graph))
            piece = rows[done: done + R]
            m = piece.shape[0]
            if m < R:
                piece = torch.cat((piece, piece.new_zeros(R - m, piece.shape[1])))
            drafts, self.q, self.confidence = self._call(graph, piece, m, start + done, R, committed)
            done += m
        self.pending = []
        return drafts[: self.k], True

    def accepted(self, committed: list[int], n_accepted: int) -> None:
        pass

    def confidences(self) -> tuple[list[int], list[float]]:
        """The last proposal's confidences (--adaptive): each node's class is its sibling rank."""
        return list(self.tree_ranks), self.confidence.tolist()
