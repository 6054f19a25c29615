"""Where a T-row verify and the 1-row plain step part ways: row numerics, checked on one committed text.

Greedy speculation is lossless only if every row of a tree's verify computes the bits the plain step
computes for the same token at the same position: a last-bit difference flips an argmax on a near
tie, and bf16's 8-bit mantissa makes near ties common. This module builds an engine's two verify
programs for a target (the plain graph's and a tree's, with the engine's own passes and the backend's
lowering passes, logits out), fills their shared cache with the same text, and compares:

* `compare_rows`: each tree node's logits against the plain program's along the node's path (restoring
  the cache between), bit for bit, on the backend the engine runs (eager or inductor);
* `first_divergence`: node by node (the exported graphs run eagerly through an FX interpreter), the
  first op whose output for the root row differs between the two programs.

examples/row_divergence.py is the command; tests/test_row_invariance.py runs both on tiny models.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.fx import Interpreter

from .backends import EagerGraph, get_backend, lowering_passes, on_device
from .errors import SpeccError
from .pipeline import example_inputs
from .plans import GraphPlan, build_program, decode_plans
from .target_module import TargetModule, module_state
from .tree import Tree, chain


@dataclass
class RowReport:
    rows: int  # tree nodes compared
    differing_rows: list[int]  # nodes whose logits differ from the plain step's in any bit
    max_abs: float  # the largest difference of a logit over all nodes
    argmax_flips: list[int]  # nodes whose greedy token differs from the plain step's

    @property
    def identical(self) -> bool:
        return not self.differing_rows

    def as_dict(self) -> dict:
        return {"rows": self.rows, "differing_rows": self.differing_rows, "max_abs": self.max_abs,
                "argmax_flips": self.argmax_flips, "identical": self.identical}


@dataclass
class NodeDivergence:
    node: str  # the FX node's name (the same in both programs: one module traced twice)
    op: str  # its target
    occurrence: str  # which call of its op in graph order ("3 of 14": the third linear of fourteen)
    max_abs: float
    differing: int  # elements of the root row's output that differ
    checked: int  # nodes compared before it (inclusive)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def verify_program(target: TargetModule, tree: Tree, cache_len: int, backend: str, device: str = "cpu"):
    """The engine's verify program for `tree` before acceptance: (tokens [T], base_len []) -> (logits
    [1, T, V], *taps), with the passes the engine's step graph gets (decode_plans' first stage), then the
    backend's lowering passes (attend_prefix for inductor on CPU)."""
    base: GraphPlan = decode_plans("rows", "target", tree, cache_len, backend, ("greedy",))[0].base
    ep = build_program(base, {"target": target}, {}, tree)
    for _, fn in lowering_passes(backend, device):
        ep = fn(ep)
    return ep


class _Runner:
    """One program callable on a target's state (weights and the caches, shared by every program, on
    `device`, as an engine holds them)."""

    def __init__(self, ep, state: dict, backend: str, folder: Path, name: str, device: str):
        self.device = device
        ep = on_device(ep, device, state)  # the state is on the device already: shared, not copied
        run = get_backend(backend).run
        if run is None:
            raise SpeccError(f"row checks run the eager and inductor backends, not {backend}.")
        # the program already went through lowering_passes (verify_program)
        self.graph = run(ep, state, folder, name, tuple(a.to(device) for a in example_inputs(ep)), device)

    def __call__(self, tokens: list[int], base_len: int) -> torch.Tensor:
        out = self.graph(torch.tensor(tokens, device=self.device), torch.tensor(base_len, device=self.device))
        return (out[0] if isinstance(out, (tuple, list)) else out)[0].cpu()


def caches(state: dict) -> dict:
    return {k: v for k, v in state.items() if k.endswith(("k_cache", "v_cache"))}


def compare_rows(target: TargetModule, tree: Tree, context: list[int], drafts: list[int], backend: str = "eager",
                 device: str = "cpu", workdir: Path | None = None) -> RowReport:
    """Fill the cache with `context` through the plain program, then verify the tree (root drafts[0], the
    other nodes drafts[1:]) in one call and compare each node's logits with the plain program's logits
    along the node's path (ancestors first, the cache restored between). The target is captured on the
    CPU, as an engine's graphs are; its tensors run on `device`."""
    if len(drafts) != tree.size:
        raise ValueError(f"the tree has {tree.size} nodes, {len(drafts)} tokens were given")
    cache_len = target.cache_len
    if len(context) + tree.size > cache_len:
        raise ValueError("the context and the tree do not fit in the cache")
    state = {k: v.to(device) for k, v in module_state(target).items()}  # the same tensors on the CPU
    with tempfile.TemporaryDirectory(prefix="specc-rows-") as tmp:
        folder = Path(workdir or tmp)
        plain = _Runner(verify_program(target, chain(0), cache_len, backend, device), state, backend, folder,
                        "plain", device)
        step = _Runner(verify_program(target, tree, cache_len, backend, device), state, backend, folder,
                       "step", device)
        for pos, tok in enumerate(context):
            plain([tok], pos)
        base = len(context)
        saved = {k: v.clone() for k, v in caches(state).items()}

        def restore():
            for k, v in saved.items():
                state[k].copy_(v)

        rows = step(list(drafts), base)
        expected = []
        for node in range(tree.size):
            restore()
            path = _path(tree, node)
            for depth, n in enumerate(path):
                logits = plain([drafts[n]], base + depth)
            expected.append(logits[0])
        restore()
    differing, flips, worst = [], [], 0.0
    for node, want in enumerate(expected):
        got = rows[node]
        if not torch.equal(_bits(got), _bits(want)):
            differing.append(node)
            worst = max(worst, (got.double() - want.double()).abs().max().item())
        if int(got.argmax()) != int(want.argmax()):
            flips.append(node)
    return RowReport(tree.size, differing, worst, flips)


def _path(tree: Tree, node: int) -> list[int]:
    """Nodes from the root to `node`, inclusive."""
    out = [node]
    while tree.parents[out[-1]] >= 0:
        out.append(tree.parents[out[-1]])
    return out[::-1]


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()]) \
        if t.is_floating_point() else t


class _Recorder(Interpreter):
    """Runs a graph module eagerly and keeps every call_function node's output."""

    def __init__(self, gm):
        super().__init__(gm)
        self.values: dict[str, torch.Tensor] = {}

    def run_node(self, n):
        out = super().run_node(n)
        if n.op == "call_function" and isinstance(out, torch.Tensor):
            self.values[n.name] = out.detach().clone()
        return out


def _root_row(plain: torch.Tensor, step: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The root row of a node's output in both programs, where the shapes tell which dimension holds the
    rows: the one dimension where they differ, of size 1 (plain) and T, or G and G*T (grouped query
    rows, row g*T + t). None for outputs that carry no rows (equal shapes) or cannot be matched."""
    if plain.dim() != step.dim() or plain.shape == step.shape:
        return None
    dims = [d for d in range(plain.dim()) if plain.shape[d] != step.shape[d]]
    if len(dims) != 1:
        return None
    d = dims[0]
    p, s = plain.shape[d], step.shape[d]
    if s != p * T:
        return None
    shape = list(step.shape)
    grouped = step.reshape(shape[:d] + [p, T] + shape[d + 1:]).select(d + 1, 0)
    return plain, grouped


def first_divergence(target: TargetModule, tree: Tree, context: list[int], drafts: list[int],
                     backend: str = "eager", device: str = "cpu") -> NodeDivergence | None:
    """Run the plain program on the root and the tree's program on the whole tree (same cache: `context`
    written first), both eagerly node by node, and return the first node (in graph order) whose output
    for the root row differs in any bit; None when none does. The programs are the backend's (its passes
    and lowering passes), run eagerly: this finds where the graphs' math makes rows differ; a compiled
    backend may differ further in how it fuses and orders the sums (compare_rows checks that)."""
    plain_ep = verify_program(target, chain(0), target.cache_len, backend, device)
    step_ep = verify_program(target, tree, target.cache_len, backend, device)
    return diverging_node(plain_ep, step_ep, module_state(target), context, drafts)


def diverging_node(plain_ep, step_ep, state: dict, context: list[int], drafts: list[int]) -> NodeDivergence | None:
    """first_divergence on two given verify programs over the tensors `state` (left as it was found)."""
    T = len(drafts)
    saved = {k: v.clone() for k, v in caches(state).items()}
    fill = EagerGraph(plain_ep, state)
    for pos, tok in enumerate(context):
        fill(torch.tensor([tok]), torch.tensor(pos))
    filled = {k: v.clone() for k, v in caches(state).items()}
    values = []
    for ep, tokens in ((plain_ep, drafts[:1]), (step_ep, drafts)):
        for k, v in filled.items():
            state[k].copy_(v)
        rec = _Recorder(EagerGraph(ep, state).module)
        with torch.no_grad():
            rec.run(torch.tensor(tokens), torch.tensor(len(context)))
        values.append(rec.values)
    for k, v in saved.items():
        state[k].copy_(v)
    nodes = {n.name: n for n in step_ep.graph.nodes}
    checked = 0
    for name, plain_val in values[0].items():
        step_val, node = values[1].get(name), nodes.get(name)
        if step_val is None or node is None or not plain_val.is_floating_point():
            continue  # integer and boolean values are the tree's bookkeeping (slots, ancestor tables)
        pair = _root_row(plain_val, step_val, T)
        if pair is None:
            continue
        checked += 1
        a, b = pair
        if not torch.equal(_bits(a), _bits(b)):
            diff = (a.double() - b.double()).abs()
            return NodeDivergence(name, str(node.target), _occurrence(node), float(diff.max()),
                                  int((_bits(a) != _bits(b)).sum()), checked)
    return None


def _occurrence(node) -> str:
    """Which call of its op the node is ("3 of 14"): with the model's layer order, where it sits
    (the graphs are retraced wrappers, so their nodes keep no module path)."""
    same = [n for n in node.graph.nodes if n.op == "call_function" and n.target is node.target]
    return f"{same.index(node) + 1} of {len(same)}"


def random_text(vocab: int, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, max(3, vocab), (n,), generator=g).tolist()


__all__ = ["RowReport", "NodeDivergence", "verify_program", "compare_rows", "first_divergence", "diverging_node",
           "random_text"]
