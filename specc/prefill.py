"""Prefill on the host side: a prompt goes through an engine's static-chunk graphs (and its one-token
graph for a short tail), filling the KV cache; the runtime and the draft-model drafter share it.

An engine may hold chunk graphs of several sizes (`--prefill-chunk 128,32`): a larger chunk
costs less per token (its products are bigger GEMMs and it reads the weights once for more rows),
but only the last call of a prompt may be padded. `prefill_plan` covers the prompt with the calls of
least total cost, from each graph's latency measured at compile time (the manifest's `prefill_ms`).
"""
from __future__ import annotations

import torch

from .errors import SpeccError
from .signature import sampling_inputs

# Where an engine measured no costs (one chunk size, engines from before `prefill_ms`, TensorRT's):
# the smallest chunk costs 3.5 one-token calls, so a tail of up to 3 tokens goes through the one-token
# graph, as prefill always did (on the 2-core CPU a 32-token chunk call cost about 110 ms and a
# one-token call about 31, SmolLM2 fp32); a larger chunk costs a little less than the smallest chunks
# it replaces, so whole large chunks come first but none is padded where small ones would do.
SMALLEST_CHUNK_CALLS = 3.5
LARGER_CHUNK_SAVING = 0.99


def prefill_name(chunk: int, smallest: int) -> str:
    """An engine's chunk graph of `chunk` tokens: `prefill` for the smallest size (the one every engine
    has), `prefill128` for a larger one."""
    return "prefill" if chunk == smallest else f"prefill{chunk}"


def tap_rows(taps, rows) -> torch.Tensor:
    """The hidden-state taps [1, T, H] each of a graph call, at row indices `rows`, side by side [n, L*H]."""
    return torch.cat([t[0].index_select(0, rows) for t in taps], dim=-1)


def estimated_costs(chunks) -> dict[int, float]:
    """Per call size (1: the one-token graph), in one-token calls, the cost prefill_plan weighs where
    none was measured."""
    sizes = sorted(c for c in chunks if c > 1)
    if not sizes:
        return {1: 1.0}
    small = sizes[0]
    return {1: 1.0, small: SMALLEST_CHUNK_CALLS,
            **{c: SMALLEST_CHUNK_CALLS * c / small * LARGER_CHUNK_SAVING for c in sizes[1:]}}


def prefill_plan(length: int, costs: dict[int, float], capacity: int | None = None) -> list[tuple[int, int]]:
    """The calls that prefill `length` tokens at the least total cost: [(start, size)] in order,
    `size` a key of `costs` (1 is the one-token graph, which is always there). Every call but the last
    is full; the last may be a chunk padded past the prompt's end, though never past `capacity` (the
    cache's slots). Ties go to fewer calls."""
    # best[j]: (cost, calls, where the last call started, its size) of the cheapest way to fill j tokens
    best: list[tuple[float, int, int, int] | None] = [None] * (length + 1)
    best[0] = (0.0, 0, 0, 0)
    for i in range(length):
        if best[i] is None:
            continue
        for size, cost in costs.items():
            if capacity is not None and i + size > capacity:
                continue
            j = min(length, i + size)  # past the end: the prompt's last call, padded
            cand = (best[i][0] + cost, best[i][1] + 1, i, size)
            # ties: fewer calls, then the later last call (whole chunks first, a short tail after)
            if best[j] is None or (cand[0], cand[1], -i) < (best[j][0], best[j][1], -best[j][2]):
                best[j] = cand
    plan, j = [], length
    while j > 0:
        _, _, i, size = best[j]
        plan.append((i, size))
        j = i
    return plan[::-1]


def prefill(ids: list[int], chunk_graphs: dict, one_graph, mode: str, temperature=None, top_p=None,
            table=None, on_rows=None, device="cpu", costs: dict[int, float] | None = None,
            capacity: int | None = None) -> int:
    """Fill the cache with `ids` and return the token that follows them, drawn by the same rule as a
    decode step of `mode` (the graphs are that mode's) with the draws of row len(ids) - 1 of the
    generation's uniforms `table` (in a sampling mode). `chunk_graphs`: the chunk graphs by their
    size; `costs`: each call size's milliseconds (1: `one_graph`), estimated where not given;
    `capacity`: the cache's slots, which no padded chunk may write past.
    `on_rows(rows, start)` receives the taps of the prompt's rows (when the graphs have taps). The
    graphs' inputs are made on `device`."""
    if not ids:
        raise SpeccError("the prompt is empty; give at least one token.")
    dev = lambda v, **kw: torch.tensor(v, device=device, **kw)  # noqa: E731
    costs = {size: ms for size, ms in (costs or estimated_costs(chunk_graphs)).items()
             if size == 1 or size in chunk_graphs}
    sampling = sampling_inputs(mode, temperature, top_p, table)
    first = None
    for start, size in prefill_plan(len(ids), costs, capacity):
        piece = ids[start:start + size]
        if size == 1:
            res = one_graph(dev(piece), dev(start), *sampling)
            first, taps = res[2][0], res[3:]  # the root of the next call
        else:
            toks = dev(piece + [0] * (size - len(piece)), dtype=torch.int64)
            res = chunk_graphs[size](toks, dev(start), dev(len(piece)), *sampling)
            first, taps = res[0], res[1:]
        if on_rows is not None:
            on_rows(tap_rows(taps, torch.arange(len(piece), device=device)), start)
    return int(first)
