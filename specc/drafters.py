"""The runtime side of each drafter: n-gram prompt lookup, a smaller draft model, DFlash and MTP heads.

By default all propose deterministic drafts (q is one-hot: top-k per depth), which the verifier
accepts with the exact one-hot rule, so sampling stays lossless without a drafter distribution.
DFlash and MTP engines compiled with `--children sampled` instead draw the children of each node
i.i.d. from the drafter's own distribution q at temperature > 0 and hand q to the verifier, which
accepts with min(1, p/q) and residuals (specc.verify).
"""
from __future__ import annotations

import numpy as np
import torch

from .errors import SpeccError
from .tree import Tree
from .verify import inverse_cdf_rows, sampling_probs

DRAFTERS = ("none", "ngram", "draft-model", "mtp", "dflash", "dspark")


def check_drafter(name: str) -> None:
    if name not in DRAFTERS:
        raise SpeccError(f"--drafter {name!r} is unknown; use one of {', '.join(DRAFTERS)}.")
    if name == "dspark":
        raise SpeccError(f"the {name} drafter is not available in engines in this version of specc; "
                         f"use --drafter dflash, mtp, ngram or draft-model.")


def draft_slots(tree: Tree) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For drafters that rank candidates per depth (DFlash per block position, MTP per head depth):
    node i >= 1 takes candidate rank ranks[i] at depth depths[i]. Returns the depth-1 and rank
    index vectors [T-1] and the number of candidates needed per depth."""
    depth = torch.tensor(tree.depths[1:], dtype=torch.int64) - 1
    rank = torch.tensor(tree.ranks[1:], dtype=torch.int64)
    return depth, rank, int(rank.max()) + 1 if len(rank) else 1


def tree_drafts(logits: torch.Tensor, depth: torch.Tensor, rank: torch.Tensor, width: int) -> torch.Tensor:
    """logits [D, V] per depth -> the tree's draft tokens [T-1] (see draft_slots)."""
    if width == 1:  # a chain: plain argmax
        cand = logits.argmax(-1, keepdim=True)
    else:
        cand = torch.topk(logits, width, dim=-1).indices
    return cand[depth, rank]


def sampled_drafts(logits: torch.Tensor, depth: torch.Tensor, rank: torch.Tensor, width: int, temperature,
                   top_p, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Children drawn i.i.d. from the drafter (engines compiled with `--children sampled`).

    logits [D, V] per depth; uniforms [D * width], one per (depth, rank) slot. Returns the drafts
    [T-1] and q [D, V], the drafter's sampling distribution per depth (the target's temperature
    and top-p). At temperature > 0 node i takes the draw of slot (depth[i], rank[i]) from q[depth[i]]:
    siblings take distinct slots, so a node's children are i.i.d. draws from q of their depth,
    which the verifier's min(1, p/q) rule needs. Greedy keeps the top-k drafts (q is unused then)."""
    q = sampling_probs(logits, temperature, top_p)
    slot = depth * width + rank
    drawn = inverse_cdf_rows(q.index_select(0, depth), uniforms.index_select(0, slot))
    return torch.where(temperature > 0, drawn, tree_drafts(logits, depth, rank, width)), q


def ngram_propose(tokens: np.ndarray, k: int, max_ngram: int = 4, min_ngram: int = 1) -> list[int]:
    """Prompt lookup: the k tokens that followed the most recent earlier occurrence of the longest
    suffix (max_ngram down to min_ngram tokens) of `tokens`. Fewer than k when the match runs into
    the end; empty when nothing matches."""
    found = ngram_continuations(tokens, k, max_ngram, min_ngram, limit=1)
    return found[0] if found else []


def ngram_continuations(tokens: np.ndarray, k: int, max_ngram: int = 4, min_ngram: int = 1,
                        limit: int = 16) -> list[list[int]]:
    """Up to `limit` distinct continuations (each at most k tokens) that followed earlier occurrences
    of a suffix of `tokens`: longer suffixes first, the most recent occurrence first within a length.
    The first one is what `ngram_propose` returns."""
    n, found = len(tokens), []
    for size in range(min(max_ngram, n - 1), min_ngram - 1, -1):
        suffix = tokens[n - size:]
        # windows[i] = tokens[i : i+size]; an earlier match must start at i < n - size.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: n - 1], size)
        for hit in np.flatnonzero((windows == suffix).all(axis=1))[::-1]:
            start = int(hit) + size
            cont = tokens[start: start + k].tolist()
            if cont and cont not in found:
                found.append(cont)
                if len(found) == limit:
                    return found
    return found


def ngram_tree_drafts(continuations: list[list[int]], tree: Tree, root: int) -> list[int]:
    """Tokens for the tree's nodes 1..T-1. A node of rank r takes the r-th distinct next token among
    the continuations that agree with its ancestors' tokens (in the continuations' order); a node
    no continuation reaches repeats its parent's token (any token is lossless; this one is what a
    chain drafter that ran out of matches proposed before)."""
    tokens = [root] + [0] * (tree.size - 1)
    agree: list[list[list[int]]] = [continuations] + [[] for _ in range(tree.size - 1)]
    for i in range(1, tree.size):  # parents come before children
        parent, d = tree.parents[i], tree.depths[i]
        nexts: list[int] = []
        for c in agree[parent]:
            if len(c) >= d and c[d - 1] not in nexts:
                nexts.append(c[d - 1])
        rank = tree.ranks[i]
        if rank < len(nexts):
            tokens[i] = nexts[rank]
            agree[i] = [c for c in agree[parent] if len(c) >= d and c[d - 1] == tokens[i]]
        else:
            tokens[i] = tokens[parent]
    return tokens[1:]


class NgramDrafter:
    kind = "ngram"

    def __init__(self, tree: Tree, max_ngram: int = 4, min_ngram: int = 3):
        # A match shorter than min_ngram predicts poorly; without a match the step falls back to
        # the plain one-token graph, which is cheaper than verifying a likely-rejected tree.
        self.tree, self.max_ngram, self.min_ngram = tree, max_ngram, min_ngram
        # Distinct continuations worth collecting: enough to fill every rank at depth 1.
        self.limit = max(1, len(tree.children[0])) * 4

    def start(self, prompt_ids: list[int], temperature, top_p, gen=None) -> None:
        self.buf = np.array(prompt_ids, dtype=np.int64)

    def propose(self, committed: list[int]) -> tuple[list[int], bool]:
        """Drafts for the tree's non-root nodes, and whether anything matched (else the step can be plain)."""
        if len(self.buf) < len(committed):
            self.buf = np.asarray(committed, dtype=np.int64)
        conts = ngram_continuations(self.buf, self.tree.max_depth, self.max_ngram, self.min_ngram,
                                    limit=1 if self.tree.is_chain else self.limit)
        return ngram_tree_drafts(conts, self.tree, committed[-1]), len(conts) > 0

    def accepted(self, committed: list[int], n_accepted: int) -> None:
        self.buf = np.asarray(committed, dtype=np.int64)


class DraftModelDrafter:
    """A smaller causal LM (or the target's first N layers) decoding greedily with its own KV cache."""

    kind = "draft-model"

    def __init__(self, tree: Tree, prefill, step, chunk: int, device="cpu"):
        if not tree.is_chain:
            raise SpeccError("the draft-model drafter proposes a chain in this version; use --tree chain:K.")
        self.k, self.prefill_graph, self.step_graph, self.chunk = tree.size - 1, prefill, step, chunk
        self.device = device
        self.zero, self.one = torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
        self.u1 = torch.zeros(2, device=device)

    def start(self, prompt_ids: list[int], temperature, top_p, gen=None) -> None:
        from .runtime import prefill

        prefill(prompt_ids, self.prefill_graph, self.step_graph, self.chunk, self.zero, self.one, torch.Generator(),
                device=self.device)
        self.cached = len(prompt_ids)  # tokens whose K/V the drafter holds

    def _next(self, token: int, pos: int) -> int:
        _, _, out = self.step_graph(torch.tensor([token], device=self.device), torch.tensor(pos, device=self.device),
                                    self.zero, self.one, self.u1)
        return int(out[0])

    def propose(self, committed: list[int]) -> tuple[list[int], bool]:
        nxt = None
        for pos in range(self.cached, len(committed)):  # catch up on tokens committed since last time
            nxt = self._next(committed[pos], pos)
        drafts = [nxt]
        for i in range(self.k - 1):
            drafts.append(self._next(drafts[-1], len(committed) + i))
        self.pending = len(committed)
        return drafts, True

    def accepted(self, committed: list[int], n_accepted: int) -> None:
        # Draft j (1-based) was fed for j < k, so the drafter already holds the accepted ones below k.
        self.cached = self.pending + min(n_accepted, self.k - 1)


class HiddenStateDrafter:
    """The runtime side of drafters conditioned on the target's hidden states (DFlash, MTP).

    The target's step graph returns the hidden rows the drafter needs (its taps) for the committed
    tokens; they wait here until the next proposal flushes them through the drafter's graphs in
    padded pieces: `prefill_graph` takes `chunk` rows (a prompt), `step_graph` the tree's size (one
    step's commits). The last call drafts after the last committed token, whose own hidden row does
    not exist yet: every committed token but the last has its row. The drafter's step graph fills
    the whole tree (top-k candidates per depth)."""

    needs_taps = True

    def __init__(self, kind: str, tree: Tree, prefill_graph, step_graph, chunk: int, device="cpu",
                 n_uniforms: int = 0):
        self.kind, self.k = kind, tree.size - 1  # the step graph returns one draft per non-root node
        self.device = device
        # Sampled children (n_uniforms > 0): the graphs also take (temperature, top_p, uniforms) and
        # return q beside the drafts; the last proposal's q is what the step graph verifies against.
        self.n_uniforms, self.q = n_uniforms, None
        self.chunk, self.prefill_graph = chunk, prefill_graph
        self.step_rows, self.step_graph = tree.size, step_graph

    def start(self, prompt_ids: list[int], temperature, top_p, gen=None) -> None:
        """temperature, top_p: 0-d tensors on the engine's device; gen: the runtime's CPU generator."""
        self.pending: list[torch.Tensor] = []  # rows not yet in the drafter's cache
        self.pending_start = 0  # position of the first pending row
        self.sampling = (temperature, top_p, gen)

    def add_rows(self, rows: torch.Tensor, start: int) -> None:
        """rows [n, width]: the hidden rows of committed tokens at positions start..start+n-1."""
        if not self.pending:
            self.pending_start = start
        self.pending.append(rows)

    def _call(self, graph, piece, m: int, pos: int, R: int, committed: list[int]):
        dev = lambda v, **kw: torch.tensor(v, device=self.device, **kw)  # noqa: E731
        extra = ()
        if self.n_uniforms:
            temperature, top_p, gen = self.sampling
            extra = (temperature, top_p, torch.rand(self.n_uniforms, generator=gen).to(self.device))
        if self.kind == "dflash":  # (taps, ctx_start, n_ctx, anchor): the block starts at the token after them
            return graph(piece, dev(pos), dev(m), dev(committed[pos + m]), *extra)
        # mtp: (hidden, next tokens, ctx_start, n_ctx): row p pairs with the token at p + 1
        nxt = committed[pos + 1: pos + m + 1] + [0] * (R - m)
        return graph(piece, dev(nxt, dtype=torch.int64), dev(pos), dev(m), *extra)

    def propose(self, committed: list[int]) -> tuple[list[int], bool]:
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
            drafts = self._call(graph, piece, m, start + done, R, committed)
            done += m
        if self.n_uniforms:
            drafts, self.q = drafts
        self.pending = []
        return drafts[: self.k].tolist(), True

    def accepted(self, committed: list[int], n_accepted: int) -> None:
        pass
