"""Static token trees for speculative decoding.

A tree is described the way Medusa writes its "choices": every node is the path of
sibling ranks that leads to it from the root, e.g. (0, 1) is the second-ranked
candidate under the top-ranked candidate at depth 1.  The root is the empty path ().
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import networkx
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


def _needs_acceptance(form: str) -> SpeccError:
    return SpeccError(
        f"--tree {form} needs measured per-rank acceptance, which this version of specc does not "
        "provide yet; use chain:K, topk:DEPTH,WIDTH or a JSON file of paths."
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


def parse_tree(spec: str) -> Tree:
    """Parse a --tree value: chain:K, topk:DEPTH,WIDTH, sequoia:BUDGET, auto, or a JSON file of paths."""
    s = spec.strip()
    kind, colon, arg = s.partition(":")
    if s == "auto":
        raise _needs_acceptance("auto")
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
        raise _needs_acceptance("sequoia:BUDGET")
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


def _layout(tree: Tree) -> list[tuple[float, float]]:
    # Leaves get consecutive x slots in depth-first rank order and parents sit over
    # the middle of their children, so edges never cross.
    x = [0.0] * tree.size
    next_slot = 0.0
    order: list[int] = []
    stack = [0]
    while stack:
        i = stack.pop()
        order.append(i)
        stack.extend(reversed(tree.children[i]))
    for i in order:
        if not tree.children[i]:
            x[i] = next_slot
            next_slot += 1
    for i in reversed(order):  # children are visited after parents in pre-order
        kids = tree.children[i]
        if kids:
            x[i] = (x[kids[0]] + x[kids[-1]]) / 2
    return [(x[i], -float(tree.depths[i])) for i in range(tree.size)]


def draw_tree(tree: Tree, png_path, labels=None) -> None:
    """Write a PNG of the tree: root on top, one row per depth, node index (or labels[i]) in each circle."""
    # Figure + the Agg canvas directly, so drawing never touches pyplot's global backend state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if labels is not None and len(labels) != tree.size:
        raise ValueError(f"draw_tree got {len(labels)} labels for a tree of {tree.size} nodes")
    pos = _layout(tree)
    leaves = sum(1 for c in tree.children if not c)
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
    for i, p in enumerate(tree.parents):
        if p >= 0:
            ax.plot([pos[p][0], pos[i][0]], [pos[p][1], pos[i][1]], color="0.55", linewidth=0.8, zorder=1)
    xs, ys = zip(*pos)
    ax.scatter(xs, ys, s=node_pt**2, color="#cfe3f7", edgecolors="#2f5d8a", linewidths=0.8, zorder=2)
    for i, (px, py) in enumerate(pos):
        text = str(i) if labels is None else str(labels[i])
        ax.text(px, py, text, ha="center", va="center", fontsize=font_pt, zorder=3)
    ax.set_title(f"token tree: {tree.size} nodes, depth {tree.max_depth}, max width {tree.max_width}")
    ax.set_xlim(min(xs) - 0.7, max(xs) + 0.7)
    ax.set_ylim(-tree.max_depth - 0.7, 0.7)
    ax.set_axis_off()
    fig.tight_layout()
    fig.savefig(png_path)
