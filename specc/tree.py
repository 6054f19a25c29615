"""Static token trees for speculative decoding.

A tree is described the way Medusa writes its "choices": every node is the path of
sibling ranks that leads to it from the root, e.g. (0, 1) is the second-ranked
candidate under the top-ranked candidate at depth 1.  The root is the empty path ().

The measured forms use an acceptance table: acceptance[d][r] is the probability that the
rank-r draft candidate at depth d+1 is the one the target accepts, given that its parent
was accepted (measure_acceptance estimates it from calibration runs).  Under greedy verification
the candidates of one depth exclude each other, so a row sums to at most 1.  A node at path
(r1, ..., rd) is reached with probability acceptance[0][r1] * ... * acceptance[d-1][rd],
and 0 when a rank lies beyond its row or the depth beyond the table.  expected_tokens
scores a tree by that model, sequoia builds the best tree for a node budget (Sequoia,
arXiv 2402.12374) and pick_tree weighs candidates by measured step time.
"""

from __future__ import annotations

import itertools
import json
import math
import numbers
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import networkx
import numpy as np
import torch

from specc.errors import SpeccError

# Tree attention masks and per-node buffers are sized by this; it also bounds the
# cost of a typo such as topk:10,10.
MAX_TREE_NODES = 256

_FORMS = "expected chain:K, topk:DEPTH,WIDTH, sequoia:BUDGET, auto or a JSON file of paths"
_JSON_FORM = 'expected a JSON file holding a list of paths such as [[0], [1], [0, 0]] or {"paths": [...]}'
_NAT = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class Tree:
    """A token tree; build it with tree_from_paths, chain, topk or parse_tree so the derived fields agree."""

    paths: tuple[tuple[int, ...], ...]  # node 0 is the root (); nodes sorted by (depth, path)
    parents: tuple[int, ...]  # parents[0] == -1
    depths: tuple[int, ...]  # depths[0] == 0
    ranks: tuple[int, ...]  # last element of the path; 0 for the root
    children: tuple[tuple[int, ...], ...]  # per node, sorted by rank
    first_child: tuple[int, ...]  # -1 for leaves
    next_sibling: tuple[int, ...]  # next child of the same parent by rank, -1 for the last one

    @property
    def size(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return self.depths[-1]  # nodes are sorted by depth

    @property
    def max_width(self) -> int:
        return max(len(c) for c in self.children)

    @property
    def is_chain(self) -> bool:
        return self.max_width <= 1

    def ancestor_mask(self) -> torch.Tensor:
        """bool [size, size]: [i, j] is True iff j is i or an ancestor of i (what node i may attend to)."""
        mask = torch.zeros(self.size, self.size, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] = mask[p]  # parents come before children, so row p is already complete
            mask[i, i] = True
        return mask

    def child_table(self) -> torch.Tensor:
        """int64 [size, max(1, max_width)]: children of each node by rank, padded with -1."""
        table = torch.full((self.size, max(1, self.max_width)), -1, dtype=torch.int64)
        for i, kids in enumerate(self.children):
            if kids:
                table[i, : len(kids)] = torch.tensor(kids, dtype=torch.int64)
        return table

    def to_manifest(self) -> dict:
        return {
            "paths": [list(p) for p in self.paths],
            "parents": list(self.parents),
            "depths": list(self.depths),
        }

    def to_networkx(self) -> networkx.DiGraph:
        """The tree as a DiGraph from parent to child, node i being node i, with its depth and rank."""
        g = networkx.DiGraph()
        for i in range(self.size):
            g.add_node(i, depth=self.depths[i], rank=self.ranks[i])
        for i, p in enumerate(self.parents):
            if p >= 0:
                g.add_edge(p, i)
        return g


def _show(value, limit: int = 40) -> str:
    # Keep messages to one readable line even for huge or multi-line inputs.
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _as_path(item) -> tuple[int, ...] | None:
    if isinstance(item, (str, bytes)) or not isinstance(item, (list, tuple)):
        return None
    # bool is an int subclass, but True as a rank is surely a mistake.
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in item):
        return None
    return tuple(item)


def _paths_problem(paths) -> tuple[list[tuple[int, ...]], str | None]:
    """Normalise paths to sorted, deduplicated tuples with the root first, or say what is wrong with them.

    The node limit is left to the callers, which word it differently.
    """
    if isinstance(paths, (str, bytes, dict)) or not hasattr(paths, "__iter__"):
        return [], f"the paths must be a list of lists of integers, not {type(paths).__name__}"
    seen = {()}
    for item in paths:
        path = _as_path(item)
        if path is None:
            return [], f"the entry {_show(item)} is not a path (a list of integers)"
        neg = [x for x in path if x < 0]
        if neg:
            return [], f"the path {_show(list(path))} has rank {neg[0]}, but ranks must be non-negative"
        seen.add(path)
    ordered = sorted(seen, key=lambda p: (len(p), p))
    for path in ordered[1:]:
        if path[:-1] not in seen:
            return [], f"the path {_show(list(path))} is listed without its prefix {_show(list(path[:-1]))}"
    return ordered, None


def _build(ordered: list[tuple[int, ...]]) -> Tree:
    index = {p: i for i, p in enumerate(ordered)}
    parents = tuple(index[p[:-1]] if p else -1 for p in ordered)
    kids: list[list[int]] = [[] for _ in ordered]
    for i, p in enumerate(parents):
        if p >= 0:
            kids[p].append(i)  # same-parent paths differ only in rank, so index order is rank order
    first_child = tuple(k[0] if k else -1 for k in kids)
    next_sibling = [-1] * len(ordered)
    for k in kids:
        for a, b in zip(k, k[1:]):
            next_sibling[a] = b
    return Tree(
        paths=tuple(ordered),
        parents=parents,
        depths=tuple(len(p) for p in ordered),
        ranks=tuple(p[-1] if p else 0 for p in ordered),
        children=tuple(tuple(k) for k in kids),
        first_child=first_child,
        next_sibling=tuple(next_sibling),
    )


def tree_from_paths(paths) -> Tree:
    """Build a tree from Medusa-style paths; the root [] is optional and duplicates are ignored."""
    ordered, problem = _paths_problem(paths)
    if problem:
        raise SpeccError(f"Invalid token tree: {problem}.")
    if len(ordered) > MAX_TREE_NODES:
        raise SpeccError(f"Invalid token tree: it has {len(ordered)} nodes, more than the limit of {MAX_TREE_NODES}.")
    return _build(ordered)


def chain(k: int) -> Tree:
    """The root plus k nodes in a line; chain(0) is plain decoding."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0 or k + 1 > MAX_TREE_NODES:
        raise SpeccError(f"A chain needs 0 <= K <= {MAX_TREE_NODES - 1}, got {_show(k)}.")
    return _build([(0,) * d for d in range(k + 1)])


def _topk_size(depth: int, width: int) -> int | None:
    """Exact node count, or None when it is astronomically large (so topk:999999,9 costs nothing)."""
    if width == 1:
        return depth + 1
    size, layer = 1, 1
    for _ in range(depth):
        layer *= width
        size += layer
        if size > 10**9:
            return None
    return size


def topk(depth: int, width: int) -> Tree:
    """Full tree: every node shallower than depth has width children ranked 0..width-1."""
    for name, v in (("depth", depth), ("width", width)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise SpeccError(f"A topk tree needs {name} >= 1, got {_show(v)}.")
    size = _topk_size(depth, width)
    if size is None or size > MAX_TREE_NODES:
        raise SpeccError(f"A topk tree of depth {depth} and width {width} exceeds {MAX_TREE_NODES} nodes.")
    layers = [[()]]
    for _ in range(depth):
        layers.append([p + (r,) for p in layers[-1] for r in range(width)])
    return _build(sorted((p for layer in layers for p in layer), key=lambda p: (len(p), p)))


def _nat(text: str) -> int | None:
    if not _NAT.fullmatch(text):
        return None
    # Python refuses to parse very long digit strings; anything that long is out of range anyway.
    return int(text) if len(text) <= 18 else 10**18


def _malformed(spec: str, why: str, expected: str = _FORMS) -> SpeccError:
    return SpeccError(f"--tree {_show(spec, 300)} is malformed: {why}; {expected}.")


def _too_big(spec: str, nodes: int | None) -> SpeccError:
    count = "over a billion" if nodes is None else str(nodes)
    return SpeccError(
        f"--tree {_show(spec, 300)} would have {count} nodes, more than the limit of {MAX_TREE_NODES}; "
        "choose a smaller chain:K, topk:DEPTH,WIDTH or JSON file of paths."
    )


def _sequoia_needs_acceptance(spec: str) -> SpeccError:
    return SpeccError(
        f"--tree {_show(spec, 300)} needs a measured per-rank acceptance table, which the compiler "
        "measures from the drafter before it builds the tree."
    )


def _auto_is_compiler_level() -> SpeccError:
    return SpeccError(
        "--tree 'auto' is resolved by the compiler, which measures per-rank acceptance and step times "
        "and picks the fastest tree, so it cannot be parsed on its own."
    )


def _load_json_tree(spec: str) -> Tree:
    try:
        text = Path(spec).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror.lower() if isinstance(e, OSError) and e.strerror else "it is not UTF-8 text"
        raise _malformed(spec, f"the file cannot be read ({why})") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        where = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise _malformed(spec, f"the file is not valid JSON{where}", _JSON_FORM) from None
    if isinstance(data, dict):
        if "paths" not in data:
            raise _malformed(spec, 'the JSON object has no "paths" key', _JSON_FORM)
        data = data["paths"]
    if not isinstance(data, list):
        raise _malformed(spec, f"the JSON holds a {type(data).__name__}, not a list of paths", _JSON_FORM)
    ordered, problem = _paths_problem(data)
    if problem:
        raise _malformed(spec, problem, _JSON_FORM)
    if len(ordered) > MAX_TREE_NODES:
        raise _too_big(spec, len(ordered))
    return _build(ordered)


def is_measured(spec: str) -> bool:
    """Whether a --tree spec is built from measured acceptance at compile time (sequoia:BUDGET, auto)."""
    s = spec.strip()
    return s == "auto" or s.startswith("sequoia:")


def parse_tree(spec: str, acceptance=None) -> Tree:
    """Parse a --tree value: chain:K, topk:DEPTH,WIDTH, sequoia:BUDGET or a JSON file of paths.

    sequoia:BUDGET needs `acceptance` (see the module docstring); the other forms ignore it.
    auto is always refused here: the compiler resolves it by measuring candidates (pick_tree).
    """
    s = spec.strip()
    kind, colon, arg = s.partition(":")
    if s == "auto":
        raise _auto_is_compiler_level()
    if kind == "chain" and colon:
        k = _nat(arg)
        if k is None:
            raise _malformed(spec, "K must be a non-negative integer")
        if k + 1 > MAX_TREE_NODES:
            raise _too_big(spec, k + 1 if k < 10**9 else None)
        return chain(k)
    if kind == "topk" and colon:
        parts = arg.split(",")
        nums = [_nat(p.strip()) for p in parts]
        if len(parts) != 2 or None in nums:
            raise _malformed(spec, "DEPTH and WIDTH must be two integers separated by a comma")
        depth, width = nums
        if depth < 1 or width < 1:
            raise _malformed(spec, "DEPTH and WIDTH must both be at least 1")
        size = _topk_size(depth, width)
        if size is None or size > MAX_TREE_NODES:
            raise _too_big(spec, size)
        return topk(depth, width)
    if kind == "sequoia" and colon:
        budget = _nat(arg)
        if budget is None or budget < 1:
            raise _malformed(spec, "BUDGET must be a positive integer")
        if budget > MAX_TREE_NODES:
            raise _too_big(spec, budget if budget < 10**9 else None)
        if acceptance is None:
            raise _sequoia_needs_acceptance(spec)
        return sequoia(acceptance, budget)
    if os.path.isfile(spec):
        return _load_json_tree(spec)
    if os.path.exists(spec):
        raise _malformed(spec, "the path exists but is not a file")
    if kind in ("chain", "topk", "sequoia", "auto"):
        raise _malformed(spec, f"{kind} needs its arguments after a colon" if not colon else f"{kind} takes no arguments")
    if not s:
        raise _malformed(spec, "it is empty")
    if s.endswith(".json") or "/" in s or os.sep in s:
        raise _malformed(spec, "no such file")
    if colon:
        raise _malformed(spec, f"{_show(kind)} is not a known tree kind")
    raise _malformed(spec, "it is neither a known tree kind nor an existing file")


# ---------------------------------------------------------------------------------------
# Measured forms: acceptance tables, expected tokens, Sequoia trees and the timed pick.

# Two DP candidates whose values differ by less than this (relative) count as a tie, so
# tie-breaking does not hinge on floating-point rounding.
_TIE = 1e-12


def _acceptance_table(acceptance) -> tuple[tuple[float, ...], ...]:
    """Validate an acceptance table (see the module docstring) and return it as tuples of floats."""

    def bad(why: str) -> SpeccError:
        return SpeccError(f"Invalid acceptance table: {why}.")

    def is_seq(x) -> bool:
        return not isinstance(x, (str, bytes, dict, Mapping)) and isinstance(x, (Sequence, np.ndarray))

    if not is_seq(acceptance):
        raise bad(f"expected a list of per-depth lists of probabilities, not {type(acceptance).__name__}")
    if len(acceptance) == 0:
        raise bad("it has no rows (one list of per-rank probabilities per depth is needed)")
    rows = []
    for d, row in enumerate(acceptance):
        if not is_seq(row):
            raise bad(f"row {d} is {_show(row)}, not a list of probabilities")
        if len(row) == 0:
            raise bad(f"row {d} is empty")
        values = []
        for r, v in enumerate(row):
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise bad(f"acceptance[{d}][{r}] is {_show(v)}, not a number")
            v = float(v)
            if not 0.0 <= v <= 1.0:  # also refuses NaN
                raise bad(f"acceptance[{d}][{r}] is {v!r}, outside [0, 1]")
            values.append(v)
        total = math.fsum(values)
        if total > 1.0 + 1e-6:
            raise bad(
                f"row {d} sums to {total:.6g}, but the candidates of one depth exclude each other, "
                "so a row can sum to at most 1"
            )
        rows.append(tuple(values))
    return tuple(rows)


def _path_probabilities(tree: Tree, table: tuple[tuple[float, ...], ...]) -> list[float]:
    prob = [1.0] * tree.size
    for i in range(1, tree.size):
        d, r = tree.depths[i] - 1, tree.ranks[i]
        a = table[d][r] if d < len(table) and r < len(table[d]) else 0.0
        prob[i] = prob[tree.parents[i]] * a  # parents come before children
    return prob


def expected_tokens(tree: Tree, acceptance) -> float:
    """Expected tokens committed per step: 1 (the bonus token) + the reach probability of every non-root node."""
    prob = _path_probabilities(tree, _acceptance_table(acceptance))
    return 1.0 + math.fsum(prob[1:])


def sequoia(acceptance, budget: int, max_depth: int | None = None) -> Tree:
    """The tree of `budget` nodes (root included, so budget 1 is plain decoding) with the most expected tokens.

    Dynamic programming over (depth, node count), as in Sequoia (arXiv 2402.12374): since a
    node's reach probability depends only on its depth and rank, the best subtree of n nodes
    under a node at depth d is the same everywhere:

        best(d, 1) = 1
        best(d, n) = 1 + max over m_0 + m_1 + ... = n - 1 of sum_r acceptance[d][r] * best(d + 1, m_r)

    (m_r = 0 leaves out the rank-r child), and expected_tokens of the result is best(0, budget).
    The split over ranks is a knapsack solved rank by rank.  With B = budget, D = max_depth and
    W = the longest row, it costs O(D * W * B^2) arithmetic (vectorised over the B^2 part) and
    O(D * W * B) memory; for B = 256 it takes milliseconds to a few tenths of a second.

    Nodes are drawn only from ranks with non-zero acceptance and depths up to max_depth (which
    defaults to, and is capped by, the table's depth).  Zero-probability nodes would add
    nothing, so when fewer than `budget` useful nodes exist the tree holds all of them and is
    smaller than the budget; otherwise it has exactly `budget` nodes.

    Ties (values within a relative 1e-12) are broken deterministically: at every node the
    lowest-ranked child gets as many of the subtree's nodes as possible, then the next rank,
    and so on; each child's subtree follows the same rule.  So among equally good trees the
    one leaning to lower ranks wins, even over a shallower one.
    """
    table = _acceptance_table(acceptance)
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or not 1 <= budget <= MAX_TREE_NODES:
        raise SpeccError(f"A Sequoia tree needs a budget from 1 to {MAX_TREE_NODES} nodes, got {_show(budget)}.")
    budget = int(budget)
    if max_depth is None:
        max_depth = len(table)
    if isinstance(max_depth, bool) or not isinstance(max_depth, numbers.Integral) or max_depth < 0:
        raise SpeccError(f"A Sequoia tree needs max_depth >= 0, got {_show(max_depth)}.")
    # A tree of `budget` nodes is never deeper than budget - 1.
    depth = min(int(max_depth), len(table), budget - 1)
    useful = [[r for r, a in enumerate(table[d]) if a > 0.0] for d in range(depth)]
    size, choice = _sequoia_choices(table, useful, budget)
    paths = _sequoia_paths(useful, choice, size)
    assert len(paths) == size
    return _build(sorted(paths, key=lambda p: (len(p), p)))


def _sequoia_choices(table, useful: list[list[int]], budget: int) -> tuple[int, list[dict[int, np.ndarray]]]:
    """Sequoia's dynamic program, bottom-up from the deepest level (len(useful)) to the root: the tree's
    size (budget, or fewer when fewer useful nodes exist) and choice[d][r][k], the nodes given to the
    rank-r child of a depth-d node when ranks r, r+1, ... share k nodes (see sequoia for the rule)."""
    depth = len(useful)
    # cap[d]: most nodes a subtree under a depth-d node can hold (saturated at budget).
    cap = [1] * (depth + 1)
    for d in reversed(range(depth)):
        cap[d] = min(budget, 1 + len(useful[d]) * cap[d + 1])
    size = min(budget, cap[0])
    # limit[d]: the largest subtree worth solving at depth d (it needs d ancestors).
    limit = [max(1, min(size - d, cap[d])) for d in range(depth + 1)]

    # best[d][n] for n in 1..limit[d] (index 0 unused); -inf marks a size that cannot be filled.
    best: list[np.ndarray] = [np.empty(0)] * (depth + 1)
    best[depth] = np.array([-np.inf, 1.0])
    choice: list[dict[int, np.ndarray]] = [{} for _ in range(depth + 1)]
    for d in reversed(range(depth)):
        spare = limit[d] - 1  # nodes below a depth-d node
        held = np.full(spare + 1, -np.inf)  # best sum over the ranks processed so far, per node count
        held[0] = 0.0
        child_most = min(spare, limit[d + 1])
        ks = np.arange(spare + 1)[:, None]
        ms = np.arange(child_most + 1)[None, :]
        rest = ks - ms  # nodes left for the higher ranks
        fits = rest >= 0
        rest = np.where(fits, rest, 0)
        rows = np.arange(spare + 1)
        for r in reversed(useful[d]):
            gain = np.empty(child_most + 1)
            gain[0] = 0.0
            gain[1:] = table[d][r] * best[d + 1][1 : child_most + 1]
            value = np.where(fits, gain[None, :] + held[rest], -np.inf)  # [k, m]
            top = value.max(axis=1)
            near = value >= (top - _TIE * np.maximum(1.0, np.abs(top)))[:, None]
            pick = child_most - np.argmax(near[:, ::-1], axis=1)  # the largest m among the near-best
            choice[d][r] = pick
            held = value[rows, pick]
        best[d] = np.concatenate(([-np.inf], 1.0 + held))
    return size, choice


def _sequoia_paths(useful: list[list[int]], choice: list[dict[int, np.ndarray]], size: int) -> list[tuple[int, ...]]:
    """The paths of the `size`-node tree the DP's choices describe, handing out each node's nodes rank by rank."""
    depth = len(useful)
    paths: list[tuple[int, ...]] = []
    stack: list[tuple[tuple[int, ...], int]] = [((), size)]
    while stack:
        path, n = stack.pop()
        paths.append(path)
        left = n - 1
        for r in useful[len(path)] if len(path) < depth else ():
            if left == 0:
                break
            m = int(choice[len(path)][r][left])
            if m:
                stack.append((path + (r,), m))
                left -= m
        assert left == 0, "sequoia: the DP's reconstruction lost nodes"
    return paths


def pick_tree(candidates, acceptance, step_seconds) -> tuple[int, list[dict]]:
    """Pick the candidate tree with the most expected tokens per second.

    candidates: a list of (spec, Tree); step_seconds: a mapping from tree size to the measured
    seconds of one step (draft + verify) at that size.  Returns the winner's index and one
    report row per candidate, in the given order.  Throughputs within a relative 1e-9 of the
    best count as a tie, which goes to the smaller tree (then the earlier candidate).
    """
    table = _acceptance_table(acceptance)
    if isinstance(candidates, (str, bytes)) or not isinstance(candidates, Iterable):
        raise SpeccError(f"pick_tree needs a list of (spec, tree) candidates, not {type(candidates).__name__}.")
    candidates = list(candidates)
    if not candidates:
        raise SpeccError("pick_tree needs at least one candidate tree.")
    if not isinstance(step_seconds, Mapping):
        raise SpeccError(
            f"pick_tree needs step times as a mapping from tree size to seconds, not {type(step_seconds).__name__}."
        )
    rows = []
    for item in candidates:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], Tree)):
            raise SpeccError(f"pick_tree got the candidate {_show(item)}, not a (spec, tree) pair.")
        spec, tree = item
        if tree.size not in step_seconds:
            raise SpeccError(f"pick_tree has no measured step time for the {tree.size}-node tree {_show(spec)}.")
        sec = step_seconds[tree.size]
        if isinstance(sec, bool) or not isinstance(sec, numbers.Real) or not 0.0 < float(sec) < math.inf:
            raise SpeccError(
                f"pick_tree got the step time {_show(sec)} for {tree.size} nodes; "
                "it must be a positive number of seconds."
            )
        tokens = 1.0 + math.fsum(_path_probabilities(tree, table)[1:])
        rows.append(
            {
                "tree": spec,
                "nodes": tree.size,
                "depth": tree.max_depth,
                "expected_tokens": tokens,
                "step_ms": float(sec) * 1000.0,
                "expected_tokens_per_s": tokens / float(sec),
            }
        )
    top = max(row["expected_tokens_per_s"] for row in rows)
    near = [i for i, row in enumerate(rows) if row["expected_tokens_per_s"] >= top * (1.0 - 1e-9)]
    return min(near, key=lambda i: (rows[i]["nodes"], i)), rows


def measure_acceptance(records, tree: Tree) -> list[list[float]]:
    """Estimate an acceptance table from greedy steps verified with `tree` (a topk tree, or a comb:
    the rank-0 chain with ranked siblings at every depth).

    Each record is the accepted path of one step as a tuple of ranks, e.g. (0, 2) (rank 0 at
    depth 1, then rank 2 at depth 2) or () when nothing was accepted.  The estimate is the
    conditional-on-parent one that expected_tokens and sequoia use:

        acceptance[d][r] = #steps that accepted rank r at depth d+1
                           / #steps that accepted a depth-d node holding a rank-r child

    so a step that stopped at a leaf (nothing drafted below it) counts for no deeper rank.  Like
    Sequoia it pools all parents of a depth.  The table has the tree's depth and width; a rank
    never offered gets 0.
    """
    if not isinstance(tree, Tree):
        raise SpeccError(f"measure_acceptance needs the Tree the records came from, not {type(tree).__name__}.")
    depth, width = tree.max_depth, tree.max_width
    index = {p: i for i, p in enumerate(tree.paths)}
    hits = [[0] * width for _ in range(depth)]
    offered = [[0] * width for _ in range(depth)]
    for record in records:
        path = _as_path(record)
        if path is None or path not in index:
            raise SpeccError(f"measure_acceptance got the record {_show(record)}, which is not a path of the tree.")
        for d in range(len(path) + 1):
            for kid in tree.children[index[path[:d]]]:  # what was drafted below the accepted node
                offered[d][tree.ranks[kid]] += 1
            if d < len(path):
                hits[d][path[d]] += 1
    return [[h / o if o else 0.0 for h, o in zip(hits[d], offered[d])] for d in range(depth)]


def _layout(graph: networkx.DiGraph) -> dict[int, tuple[float, float]]:
    """(x, y) per node of a tree's DiGraph (Tree.to_networkx): y = -depth, leaves in consecutive x slots in
    depth-first rank order and parents over the middle of their children, so edges never cross."""
    # Post-order places a node's children before it and visits the leaves in depth-first order;
    # siblings' node indices are in rank order, so sorting them visits children by rank.
    x: dict[int, float] = {}
    slots = itertools.count()
    for i in networkx.dfs_postorder_nodes(graph, 0, sort_neighbors=sorted):
        kids = sorted(graph.successors(i))
        x[i] = (x[kids[0]] + x[kids[-1]]) / 2 if kids else float(next(slots))
    return {i: (x[i], -float(graph.nodes[i]["depth"])) for i in graph}


def draw_tree(tree: Tree, png_path, labels=None) -> None:
    """Write a PNG of the tree: root on top, one row per depth, node index (or labels[i]) in each circle."""
    # Figure + the Agg canvas directly, and networkx drawing onto its axes (never pyplot's current ones),
    # so drawing never touches pyplot's global backend or figure state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if labels is not None and len(labels) != tree.size:
        raise ValueError(f"draw_tree got {len(labels)} labels for a tree of {tree.size} nodes")
    graph = tree.to_networkx()
    pos = _layout(graph)
    leaves = sum(1 for _, out in graph.out_degree() if out == 0)
    rows = tree.max_depth + 1
    width_in = min(40.0, max(4.0, 1.0 + 0.5 * leaves))
    height_in = min(24.0, max(2.5, 1.2 + 0.8 * rows))
    # Shrink nodes and text when many must share the canvas.
    spacing_in = min(width_in / max(leaves, 1), height_in / rows)
    node_pt = max(4.0, min(26.0, 0.6 * spacing_in * 72))
    font_pt = max(3.0, node_pt * 0.42)

    fig = Figure(figsize=(width_in, height_in), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    networkx.draw_networkx_edges(graph, pos, ax=ax, arrows=False, edge_color="0.55", width=0.8)
    networkx.draw_networkx_nodes(graph, pos, ax=ax, node_size=node_pt**2, node_color="#cfe3f7",
                                 edgecolors="#2f5d8a", linewidths=0.8)
    text = {i: str(i) if labels is None else str(labels[i]) for i in graph}
    networkx.draw_networkx_labels(graph, pos, labels=text, ax=ax, font_size=font_pt)
    xs = [px for px, _ in pos.values()]
    ax.set_title(f"token tree: {tree.size} nodes, depth {tree.max_depth}, max width {tree.max_width}")
    ax.set_xlim(min(xs) - 0.7, max(xs) + 0.7)
    ax.set_ylim(-tree.max_depth - 0.7, 0.7)
    ax.set_axis_off()
    fig.tight_layout()
    fig.savefig(png_path)
