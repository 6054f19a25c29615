"""The runtime's decode strategies, one function each, over one generation's state (`Run`).

specc/runtime.py's Engine picks the strategy once per generation (`pick_step`) and calls it in its
loop, which commits what each step accepted:

    plain_step       ordinary decoding: the root alone through the plain graph
    host_draft_step  the drafter proposes on the host, the step graph verifies
    fused_step       one graph per step: it verifies, updates the drafter and drafts the next tree

and the two speculative strategies consult

    choose_size      adaptive verification: how many of the tree's nodes this call verifies, or a
                     rest for the drafter (rest_step) (specc/adaptive.py)
    with_lookup      a hybrid tree: prompt lookup's continuation written into the drafts (specc/hybrid.py)

A step returns its report as read (signature.split_report) and the nodes it verified (1: plain).
What the next call takes stays on the device (Run.base_dev, root_dev, next_tokens): the report is
the step's one device-to-host read (`advance`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .adaptive import StepClock, choose, fused_name, next_rest_run, step_name
from .hybrid import NgramBranch
from .prefill import tap_rows
from .signature import SampledChildren, StepSignature, split_report
from .tree import Tree


@dataclass
class Run:
    """One generation's state, shared by the strategies: the request, the engine's parts it runs
    with (Engine's attributes of the same names, as they were when it started), and what the host
    loop advances step by step."""
    committed: list[int]  # prompt and generated tokens
    base_len: int  # tokens whose K/V are in the cache; the root committed[-1] is not yet
    budget: int  # new tokens allowed
    produced: int
    stop_ids: set[int]  # tokens that end the generation: the engine's EOS ids, or none
    temperature: torch.Tensor
    top_p: torch.Tensor
    mode: str  # greedy | sample | top_p: which of the engine's graphs run
    graphs: dict  # the mode's graphs, by name without the mode (prefill, plain, step, fused, ...)
    signatures: tuple  # the mode's plain, step and fused StepSignatures (Engine.signatures), made once
    table: torch.Tensor | None  # the generation's uniforms (sampling modes), on the device
    tree: Tree
    drafter: object | None  # None: plain decoding (no drafter, or speculate=False)
    sampled: SampledChildren | None  # the drafter samples its children: its q goes with the drafts
    rates: bool  # the fused graph returns the drafter's confidence in each next draft
    adaptive: dict | None  # the manifest's adaptive family (its latencies and rates), or None
    record_confidences: bool  # read each step's confidences into Stats.confidences
    ngram_branch: NgramBranch | None  # a hybrid tree's host side
    device: torch.device
    report_buffers: dict  # pinned host buffers for the reports (CUDA), the engine's: kept across generations
    row0: torch.Tensor  # a one-token call's tap row
    # What the last decode call returned for the next one, on the device: base_len [] and the
    # root [1]; after a fused call, the next tree [T] (root + drafts) and its q.
    base_dev: torch.Tensor | None = None
    root_dev: torch.Tensor | None = None
    next_tokens: torch.Tensor | None = None
    next_q: torch.Tensor | None = None
    next_confidence: torch.Tensor | None = None  # a DSpark drafter's confidence in each of next_tokens' drafts
    lookup_nodes: list[int] = field(default_factory=list)  # the nodes prompt lookup wrote in this call's tree
    confidence: tuple | None = None  # this call's drafts' confidences, where read (Stats.confidences)
    graph: str = "plain"  # the graph this call ran (Stats.graphs)
    # An adaptive engine's resting drafter: plain steps left before the next probe, and the length
    # of the current run of them (0: the engine speculates).
    rest_left: int = 0
    rest_run: int = 0
    clock: StepClock | None = None  # an adaptive greedy generation's step times (Engine.step_clock)


def pick_step(run: Run, use_fused: bool):
    """The generation's strategy: plain without a drafter, else one graph per step where the engine
    has a fused step (and `use_fused`; False runs host drafts, the fused path's reference)."""
    if run.drafter is None:
        return plain_step
    return fused_step if use_fused and "fused" in run.graphs else host_draft_step


# -- the device and the host --------------------------------------------------------------------

def upload(run: Run, tokens: list[int]) -> torch.Tensor:
    """Host tokens to the device without waiting for it (pinned memory, asynchronous copy)."""
    if run.device.type != "cuda":
        return torch.tensor(tokens, dtype=torch.int64)
    return torch.tensor(tokens, dtype=torch.int64).pin_memory().to(run.device, non_blocking=True)


def read(run: Run, report: torch.Tensor) -> list:
    """A device-to-host read (a step's report, or drafts' confidences), through a pinned buffer on CUDA."""
    if run.device.type != "cuda":
        return report.tolist()
    key = (report.shape[0], report.dtype)
    host = run.report_buffers.get(key)
    if host is None:
        host = run.report_buffers[key] = torch.empty(report.shape, dtype=report.dtype, pin_memory=True)
    host.copy_(report, non_blocking=True)
    torch.cuda.current_stream(run.device).synchronize()
    return host.tolist()


def root(run: Run) -> torch.Tensor:
    """The next call's root [1]: on the device from the last call, or the first token from prefill."""
    return run.root_dev if run.root_dev is not None else upload(run, [run.committed[-1]])


def advance(run: Run, res) -> list[int]:
    """Keep what the next call takes on the device; read the report."""
    run.base_dev, run.root_dev = res.base_len, res.tokens[:1]
    return read(run, res.report)


# -- the strategies -----------------------------------------------------------------------------

def plain_step(run: Run, keep_rows: bool = False):
    """Ordinary decoding: the one-node tree (the root alone) through the plain graph; `keep_rows`
    hands the root's hidden row to a drafter that reads them."""
    sig = run.signatures[0]
    res = sig.unpack(run.graphs["plain"](*sig.args(root(run), run.base_dev, run.temperature, run.top_p, run.table)))
    if keep_rows and run.drafter.needs_rows:
        run.drafter.add_rows(tap_rows(res.taps, run.row0), run.base_len)
    run.next_tokens = run.next_confidence = None
    run.graph = "plain"
    return advance(run, res), 1


def host_draft_step(run: Run):
    """The drafter proposes on the host, the step graph verifies; the accepted rows go back to a
    drafter that reads the target's hidden states. Without a proposal the step is plain."""
    if run.rest_left > 0:
        return rest_step(run)
    drafter = run.drafter
    drafts, found = drafter.propose(run.committed)
    if not found:
        return plain_step(run)
    T, sig, name = run.tree.size, run.signatures[1], "step"
    if run.adaptive is not None or run.record_confidences:
        run.confidence = drafter.confidences()
    if run.adaptive is not None:  # the family member with the most expected tokens per second
        T = choose_size(run)
        if T == 0:
            return rest_step(run, start=True)
        if T == 1 and not drafter.needs_rows:
            return plain_step(run)
        sig, name = StepSignature(T, run.sampled, mode=run.mode), step_name(T, run.tree.size)
    drafts = drafts[: T - 1] if isinstance(drafts, torch.Tensor) else upload(run, drafts[: T - 1])
    tokens = with_lookup(run, torch.cat((root(run), drafts)))
    res = sig.unpack(run.graphs[name](*sig.args(tokens, run.base_dev, run.temperature, run.top_p, run.table,
                                                drafter.q)))
    run.graph = name
    report = advance(run, res)
    if drafter.needs_rows:  # the root and the accepted drafts are now committed context
        n = report[0]
        _, path, _ = split_report(res.report)  # on the device: sliced, never read
        drafter.add_rows(tap_rows(res.taps, path[: n + 1]), run.base_len)
    return report, T


def fused_step(run: Run):
    """One graph per step: it verifies, updates the drafter and returns the next tree (root and
    drafts) and its q, which stay on the device for the next call. The first proposal (which
    flushes the prompt's rows) comes from the drafter's own graphs. An adaptive engine reads the
    drafts' confidences and runs the family member that verifies the first k nodes, or rests
    its drafter (the plain graph, re-probed after a run of plain steps)."""
    if run.rest_left > 0:
        return rest_step(run)
    T, sig, name = run.tree.size, run.signatures[2], "fused"
    if run.next_tokens is None:
        drafts, _ = run.drafter.propose(run.committed)
        drafts = drafts if isinstance(drafts, torch.Tensor) else upload(run, drafts[: T - 1])
        tokens, q, confidence = torch.cat((root(run), drafts)), run.drafter.q, run.drafter.confidence
    else:
        tokens, q, confidence = run.next_tokens, run.next_q, run.next_confidence
    if confidence is not None and (run.adaptive is not None or run.record_confidences):
        run.confidence = (list(run.tree.ranks[1:]), read(run, confidence))
    if run.adaptive is not None and run.confidence is not None:
        k = choose_size(run)
        if k == 0:
            return rest_step(run, start=True)
        if k < T:
            sig = StepSignature(k, run.sampled, fused=True, mode=run.mode, confidence=run.rates)
            name, tokens, T = fused_name(k, T), tokens[:k], k
    tokens = with_lookup(run, tokens)
    res = sig.unpack(run.graphs[name](*sig.args(tokens, run.base_dev, run.temperature, run.top_p, run.table, q)))
    run.next_tokens, run.next_q, run.next_confidence = res.tokens, res.next_q, res.confidence
    run.graph = name
    return advance(run, res), T


# -- what the speculative strategies consult ----------------------------------------------------

def choose_size(run: Run) -> int:
    """Adaptive verification: the family member for this call's drafts (its node count k; 0: rest
    the drafter), from their confidences and the members' step times (measured as the generation
    runs, or the compiled table)."""
    if run.clock is not None:
        latency, rest = run.clock.latency_ms, run.clock.rest_ms
    else:
        latency, rest = run.adaptive["latency_ms"], run.adaptive.get("rest_ms")
    k = choose(run.tree, latency, run.adaptive["rates"], run.confidence, rest)
    if run.clock is not None:  # a member untimed for long runs once, so that its time follows the machine
        k = run.clock.stale() or k
    if k:
        run.rest_run = 0
    return k


def rest_step(run: Run, start: bool = False):
    """A plain step while an adaptive engine's drafter rests (`start`: a new run of them): the
    root's row waits with the drafter, and the next speculative call re-proposes through the
    drafter's own graphs, which flush the waiting rows (as the first call after prefill does)."""
    if start:
        run.rest_run = next_rest_run(run.rest_run)
        run.rest_left = run.rest_run
    run.rest_left -= 1
    return plain_step(run, keep_rows=True)


def with_lookup(run: Run, tokens: torch.Tensor) -> torch.Tensor:
    """A hybrid tree's tokens [T] with prompt lookup's continuation written in. The read follows
    the last step's report read, which already waited for the graph that drafted them."""
    if run.ngram_branch is None:
        return tokens
    merged, run.lookup_nodes = run.ngram_branch.merge(read(run, tokens), run.committed)
    return upload(run, merged) if run.lookup_nodes else tokens
