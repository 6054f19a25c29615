"""Prefill on the host side: a prompt goes through an engine's static-chunk graph (and its one-token
graph for a short tail), filling the KV cache; the runtime and the draft-model drafter share it."""
from __future__ import annotations

import torch

from .signature import sampling_inputs

# A prompt tail this short goes through the one-token graph token by token: on the 2-core CPU a
# 32-token chunk call costs about 110 ms and a one-token call about 31 ms (SmolLM2, fp32).
PLAIN_TAIL = 3


def tap_rows(taps, rows) -> torch.Tensor:
    """The hidden-state taps [1, T, H] each of a graph call, at row indices `rows`, side by side [n, L*H]."""
    return torch.cat([t[0].index_select(0, rows) for t in taps], dim=-1)


def prefill(ids: list[int], chunk_graph, one_graph, chunk: int, mode: str, temperature=None, top_p=None,
            table=None, on_rows=None, device="cpu") -> int:
    """Fill the cache with `ids` (static chunks, a short tail one token at a time) and return the
    token that follows them, drawn by the same rule as a decode step of `mode` (the graphs are that
    mode's) with the draws of row len(ids) - 1 of the generation's uniforms `table` (in a sampling
    mode). `on_rows(rows, start)` receives the taps of the prompt's rows (when the graphs have taps).
    The graphs' inputs are made on `device`."""
    L = len(ids)
    dev = lambda v, **kw: torch.tensor(v, device=device, **kw)  # noqa: E731

    def sampling() -> tuple:
        return sampling_inputs(mode, temperature, top_p, table)

    tail = L % chunk
    chunked = L - tail if 0 < tail <= PLAIN_TAIL else L
    first = None
    for start in range(0, chunked, chunk):
        piece = ids[start:start + chunk]
        toks = dev(piece + [0] * (chunk - len(piece)), dtype=torch.int64)
        res = chunk_graph(toks, dev(start), dev(len(piece)), *sampling())
        first = res[0]
        if on_rows is not None:
            on_rows(tap_rows(res[1:], torch.arange(len(piece), device=device)), start)
    for pos in range(chunked, L):
        res = one_graph(dev([ids[pos]]), dev(pos), *sampling())
        first = res[2][0]  # the root of the next call
        if on_rows is not None:
            on_rows(tap_rows(res[3:], torch.arange(1, device=device)), pos)
    return int(first)
