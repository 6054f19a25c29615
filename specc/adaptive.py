"""Adaptive verification (`specc compile --adaptive`): per step, verify as much of the tree as pays.

An adaptive engine holds a family of step graphs: the tree's first k nodes for k = 2 .. T (nodes
are ordered by depth, so every such prefix is a tree, closed under parents), and plain decoding
(k = 1). At compile time each is timed on the machine that compiles it, and the drafter's
confidence in a node is calibrated into an acceptance rate on calibration prompts. A confidence is
a class (ngram: the length of the matched suffix, one for the whole proposal; DSpark: the node's
sibling rank) and a number in [0, 1] per node (ngram: how many earlier occurrences agree; DSpark:
its confidence head); the rate is measured per class and bucket of the number. Per step the
runtime takes the drafts and their confidences and runs the member with the most expected tokens
per second:

    E[tokens | k] = 1 + sum over nodes 1..k-1 of prod over the node's path of rate(class, confidence)
    choice        = argmax_k E[tokens | k] / latency_k

With a fused step (a drafter whose graphs draft the next tree inside the step, DSpark), every
member verifies its prefix and drafts the whole next tree, so the next choice has every node's
confidence; member k=1 verifies the root alone (the drafter still reads its row). Every fused
member pays for the drafter, so the family also has k=0: the target's plain graph with the
drafter resting (its rows wait on the host, `rest_ms` in the manifest). A resting engine has no
confidences to choose from, so it re-probes (one call of the drafter's own graph, which flushes
the waiting rows) after 1, 2, 4 ... REST_MAX plain steps, the run doubling while the probes keep
choosing to rest and starting again at 1 once one speculates.

The compiled latencies are one moment of one machine: it may have been busy while it compiled, or
its memory bandwidth shared differently than now, and attention grows with the context. So a greedy
generation also times its steps as it runs (StepClock) and chooses from those times: per member
the median of its last WINDOW steps while its last is no more than FRESH steps old, any other its
compiled latency rescaled by how the freshly timed ones moved, and a member left untimed for
REFRESH steps runs once to be timed again.
Sampling keeps the compiled table, so that a seed's output stays a function of the engine alone.

Lossless by construction: the choice depends only on text already committed and on times, never
on the step's own uniforms (signature.uniform_columns: a call's draws are the row at its base
position, used by no other call), and whatever is verified is verified exactly.
"""
from __future__ import annotations

import bisect
import math
import statistics
import time
from collections import deque

from .tree import Tree, tree_from_paths

# Confidence buckets: edges between them. A rate per bucket is measured at compile time.
EDGES = (0.2, 0.4, 0.55, 0.7, 0.85)
PRIOR = (1.0, 2.0)  # Laplace: (accepted + 1) / (seen + 2) per bucket
CALIBRATION_PROMPTS = 8
CALIBRATION_TOKENS = 96
TIMING_ROUNDS, TIMING_CALLS = 5, 4
REST_MAX = 32  # the longest run of plain steps between two probes of a resting drafter
# StepClock: step times kept per member, how many count as its own estimate, for how many steps
# after its last, and after how many steps without one a member is run again to be timed.
WINDOW, MIN_TIMED, FRESH, REFRESH = 16, 3, 64, 1000


def step_name(k: int, size: int) -> str:
    """The graph that verifies the tree's first k nodes: `plain` for 1, `step` for the whole tree."""
    return "plain" if k == 1 else "step" if k == size else f"step{k}"


def fused_name(k: int, size: int) -> str:
    """The fused step that verifies the tree's first k nodes and drafts the whole next tree."""
    return "fused" if k == size else f"fused{k}"


def member_names(tree: Tree, fused: bool) -> list[str]:
    """The family's graphs, plain (k = 1) first: what an adaptive engine times and runs."""
    name = fused_name if fused else step_name
    return [name(k, tree.size) for k in family_sizes(tree)]


def prefix(tree: Tree, k: int) -> Tree:
    """The tree's first k nodes (node order is by depth, so this is a tree)."""
    return tree_from_paths(tree.paths[:k])


def family_sizes(tree: Tree) -> list[int]:
    return list(range(1, tree.size + 1))


def node_classes(cls, n: int) -> list[int]:
    """A confidence's class per node: one class for the whole proposal, or already one per node."""
    return [cls] * n if isinstance(cls, int) else list(cls)


def bucket(confidence: float) -> int:
    return bisect.bisect_right(EDGES, confidence)


def rates_from_counts(seen: list[list[int]], accepted: list[list[int]]) -> list[list[float]]:
    """Acceptance rate per class and bucket, with a Laplace prior (an unseen cell reads 0.5)."""
    a, b = PRIOR
    return [[(acc + a) / (n + b) for n, acc in zip(ns, accs)] for ns, accs in zip(seen, accepted)]


def empty_counts(classes: int) -> list[list[int]]:
    return [[0] * (len(EDGES) + 1) for _ in range(classes)]


def expected_tokens(tree: Tree, rates: list[float], k: int) -> float:
    """1 + the probability of reaching each of the first k nodes, each node accepted (given its
    parent) at `rates[node]` (rates[0], the root, is unused)."""
    reach = [1.0] * k
    for i in range(1, k):
        reach[i] = reach[tree.parents[i]] * rates[i]
    return 1.0 + math.fsum(reach[1:])


def choose(tree: Tree, latency_ms: list[float], table: list[list[float]], confidence,
           rest_ms: float | None = None) -> int:
    """The family member (node count k, 1 = plain) with the most expected tokens per millisecond,
    given the drafter's confidence (class, a number per non-root node; the class is one for the
    whole proposal, or a list with one per node); the smaller one on a tie. With `rest_ms` (a fused
    family), 0: the plain graph with the drafter resting, one token per rest_ms."""
    cls, values = confidence
    classes = node_classes(cls, len(values))
    rates = [1.0] + [table[c][bucket(v)] for c, v in zip(classes, values)]
    best, best_k = (1.0 / rest_ms, 0) if rest_ms else (-1.0, 1)
    for k in range(1, len(latency_ms) + 1):
        score = expected_tokens(tree, rates, k) / latency_ms[k - 1]
        if score > best * (1 + 1e-9):
            best, best_k = score, k
    return best_k


def next_rest_run(last: int) -> int:
    """Plain steps before the next probe, given the last run's length (0: the engine speculated)."""
    return min(2 * last, REST_MAX) if last else 1


class StepClock:
    """Each family member's step time as the engine runs (milliseconds, the whole step: drafting,
    the graph call and the report's read). `latency_ms` and `rest_ms` are what `choose` takes: a
    member timed at least MIN_TIMED times, the last of them within FRESH steps, reads the median of
    its last WINDOW times; any other its compiled latency times the median ratio of timed to
    compiled latency over those fresh members (1 before any). Times go stale so that a slow spell
    does not stick to whichever member ran through it. Members are the family's graphs by name
    (plain first) and, in a fused family, `plain` for the drafter resting."""

    def __init__(self, entry: dict):
        self.entry = entry  # the manifest's `adaptive` entry it started from
        self.names = list(entry["graphs"])
        self.compiled = list(entry["latency_ms"])
        self.rest_name = "plain" if entry.get("rest_ms") is not None else None
        if self.rest_name:
            self.names.append(self.rest_name)
            self.compiled.append(entry["rest_ms"])
        self.times = {n: deque(maxlen=WINDOW) for n in self.names}
        self.median: dict[str, float] = {}  # of members timed MIN_TIMED times or more
        self.last = {n: 0 for n in self.names}  # the step count at each member's last time
        self.steps = 0
        self.estimate = list(self.compiled)

    def record(self, name: str, ms: float) -> None:
        self.steps += 1
        times = self.times.get(name)
        if times is not None:  # else not a member (a drafter's own graph on the first call)
            times.append(ms)
            self.last[name] = self.steps
            if len(times) >= MIN_TIMED:
                self.median[name] = statistics.median(times)
        own = {n: t for n, t in self.median.items() if self.steps - self.last[n] < FRESH}
        ratios = [own[n] / c for n, c in zip(self.names, self.compiled) if n in own and c > 0]
        scale = statistics.median(ratios) if ratios else 1.0
        self.estimate = [own.get(n, c * scale) for n, c in zip(self.names, self.compiled)]

    @property
    def latency_ms(self) -> list[float]:
        return self.estimate[: len(self.estimate) - bool(self.rest_name)]

    @property
    def rest_ms(self) -> float | None:
        return self.estimate[-1] if self.rest_name else None

    def stale(self) -> int | None:
        """The member (its k, 1 = the first graph) least recently timed, if REFRESH steps ago or
        more; the resting drafter is never forced (it has no drafts to time the others with)."""
        k = min(range(len(self.latency_ms)), key=lambda i: self.last[self.names[i]])
        return k + 1 if self.steps - self.last[self.names[k]] >= REFRESH else None


# -- compile time --------------------------------------------------------------------------------

def time_family(engine, mode: str = "greedy", names: list[str] | None = None) -> list[float]:
    """Milliseconds per call of each family member (`names`, plain first; default: the unfused step
    graphs), interleaved rounds, medians. The graphs run on constant inputs: their shapes are
    static, so the cost does not depend on the values."""
    import torch

    names = names or member_names(engine.tree, fused=False)
    calls = []
    for name in names:
        key = f"{name}_{mode}"
        # zeros for ids and lengths, ones for temperature, top-p and uniforms (no division by zero)
        dtypes = engine.manifest.graphs[key].input_specs()
        args = tuple((torch.ones if dt.is_floating_point else torch.zeros)(s, dtype=dt, device=engine.device)
                     for s, dt in dtypes)
        calls.append((engine.graphs[key], args))
    return time_calls(calls, engine.device)


def time_calls(calls: list, device) -> list[float]:
    """Milliseconds per call of each (fn, args) in `calls`: a warm-up call each, then TIMING_ROUNDS
    rounds that run every fn TIMING_CALLS times in turn (so drift falls on all alike), medians."""
    import torch

    device = torch.device(device)
    for fn, args in calls:  # warm-up
        fn(*args)
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(TIMING_ROUNDS):
        for i, (fn, args) in enumerate(calls):
            t0 = time.perf_counter()
            for _ in range(TIMING_CALLS):
                out = fn(*args)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            del out
            times[i].append((time.perf_counter() - t0) * 1000 / TIMING_CALLS)
    return [round(statistics.median(t), 4) for t in times]


def calibrate_confidence(engine, drafter, prompts: list[list[int]], new_tokens: int, classes: int):
    """How often a node whose parent was right is right itself, by confidence class and bucket: the
    target's own greedy text on the prompts, and at every position what the drafter would have
    drafted there. Returns (seen, accepted), each [classes][buckets]."""
    seen, accepted = empty_counts(classes), empty_counts(classes)
    tree = engine.tree
    for ids in prompts:
        out = engine.generate(ids, max_new_tokens=new_tokens, speculate=False, stop_at_eos=False).token_ids
        text = list(ids) + list(out)
        drafter.start(list(ids), "greedy", None, None)
        for p in range(len(ids), len(text)):
            committed = text[:p]  # the root is text[p - 1]; node i drafts position p - 1 + depth
            drafter.accepted(committed, 0)
            drafts, found = drafter.propose(committed)
            if not found:
                continue
            right = [True] + [False] * (tree.size - 1)
            cls, values = drafter.confidences()
            classes = node_classes(cls, len(values))
            for i, (k, c) in enumerate(zip(classes, values), start=1):
                pos = p - 1 + tree.depths[i]
                if not right[tree.parents[i]] or pos >= len(text):
                    continue
                right[i] = drafts[i - 1] == text[pos]
                seen[k][bucket(c)] += 1
                accepted[k][bucket(c)] += right[i]
    return seen, accepted


def calibrate_on_steps(engine, prompts: list[list[int]], new_tokens: int, classes: int):
    """calibrate_confidence for drafters that draft from the target's hidden states (DSpark): greedy
    speculative decoding over the whole tree on the prompts, and at every step, for each node whose
    parent was accepted, its confidence and whether it was accepted too (greedy accepts the child
    that is the target's own token, so a node whose parent was accepted is right exactly when it is
    accepted). Returns (seen, accepted), each [classes][buckets]."""
    seen, accepted = empty_counts(classes), empty_counts(classes)
    tree = engine.tree
    node_of = {path: i for i, path in enumerate(tree.paths)}
    # The whole tree every step, also where the engine already holds a measured family (a re-measure).
    engine.record_confidences, family = True, engine.adaptive
    engine.adaptive = None
    try:
        for ids in prompts:
            stats = engine.generate(ids, max_new_tokens=new_tokens, stop_at_eos=False).stats
            for ranks, confidence in zip(stats.rank_paths, stats.confidences):
                if confidence is None:
                    continue
                cls, values = confidence
                on_path = {node_of[ranks[:d]] for d in range(len(ranks) + 1)}
                classes = node_classes(cls, len(values))
                for i, (k, c) in enumerate(zip(classes, values), start=1):
                    if tree.parents[i] in on_path:
                        seen[k][bucket(c)] += 1
                        accepted[k][bucket(c)] += i in on_path
    finally:
        engine.record_confidences, engine.adaptive = False, family
    return seen, accepted


def measure(engine, drafter, classes: int, texts: list[list[int]], progress: bool = False) -> dict:
    """The manifest's `adaptive` entry for a freshly built engine: the family, each member's
    latency on this machine, and the acceptance rate by confidence class and bucket, calibrated on
    the target's greedy text after each of `texts` (token ids) with `drafter` (a fresh runtime
    drafter whose confidences come in `classes` classes); a drafter that reads the target's hidden
    states is calibrated on the engine's own speculative steps instead."""
    tree = engine.tree
    mode = "greedy" if "greedy" in engine.modes else engine.modes[0]
    fused = any(name.startswith("fused") for name in engine.graphs)
    names = member_names(tree, fused)
    # A fused family also times the plain graph the engine runs while its drafter rests.
    latency = time_family(engine, mode, ["plain"] + names if fused else names)
    rest = {"rest_ms": latency.pop(0)} if fused else {}
    new_tokens = max(2, min(CALIBRATION_TOKENS, engine.max_len // 2))
    prompts = [ids[-(engine.max_len - new_tokens):] for ids in texts]
    if "greedy" not in engine.modes:  # no greedy graphs to produce the target's text with: the prior alone
        seen, accepted = empty_counts(classes), empty_counts(classes)
    elif drafter.needs_rows:
        seen, accepted = calibrate_on_steps(engine, prompts, new_tokens, classes)
    else:
        seen, accepted = calibrate_confidence(engine, drafter, prompts, new_tokens, classes)
    if progress:
        timed = ([rest["rest_ms"]] if rest else []) + latency
        print(f"adaptive: {len(timed)} step graphs timed ({', '.join(f'{t:.1f}' for t in timed)} ms), "
              f"{sum(map(sum, seen))} drafted nodes calibrated on {len(prompts)} prompts")
    return {"sizes": family_sizes(tree), "graphs": names, "fused": fused,
            "latency_ms": latency, **rest, "timed_mode": mode, "edges": list(EDGES), "seen": seen, "accepted": accepted,
            "rates": [[round(r, 4) for r in row] for row in rates_from_counts(seen, accepted)],
            "calibration": {"prompts": len(prompts), "new_tokens": new_tokens}}


def report_lines(entry: dict) -> list[str]:
    """`specc inspect`'s view of an adaptive engine: the family with its latencies, and the rates."""
    lines = ["k  graph        ms/call"]
    if "rest_ms" in entry:
        lines.append(f"0  plain        {entry['rest_ms']:.2f}  (the drafter rests; re-probed after 1, 2, 4 ... "
                     f"{REST_MAX} plain steps)")
    for k, name, ms in zip(entry["sizes"], entry["graphs"], entry["latency_ms"]):
        lines.append(f"{k:<2} {name:<12} {ms:.2f}")
    lo = [0.0] + entry["edges"]
    hi = entry["edges"] + [1.0]
    lines.append("acceptance rate by confidence class and bucket (nodes seen on calibration text):")
    lines.append("class  " + " ".join(f"[{a:.2f},{b:.2f})" for a, b in zip(lo, hi)))
    for c, (rates, seen) in enumerate(zip(entry["rates"], entry["seen"])):
        lines.append(f"{c:<6} " + " ".join(f"{r:.2f} ({n:>4})".ljust(11) for r, n in zip(rates, seen)))
    return lines
