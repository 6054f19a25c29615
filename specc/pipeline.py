"""The pass pipeline: named graph passes run in order, with an optional dump of the graph after each.

A graph pass (`Pipeline.add`) is a plain function `ExportedProgram -> ExportedProgram` that
rewrites nodes in place. A wrapping pass (`Pipeline.wrap`) changes the graph's signature (new
inputs or outputs): it wraps the module so far in a module of its own, `Uncaptured -> Uncaptured`.
Consecutive wrapping passes are captured once, together (`capture` costs about as much as the
first trace of the model: a 30-layer target pays it per capture), before the next graph pass or at
the end. Every pass has a docstring that states the invariant it establishes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Union

import torch
from torch import nn


@dataclass
class Uncaptured:
    """A module around earlier programs' modules, not captured yet, with example inputs for it."""
    module: nn.Module
    args: tuple


Program = Union[torch.export.ExportedProgram, Uncaptured]
Pass = Callable[[torch.export.ExportedProgram], torch.export.ExportedProgram]
WrapPass = Callable[[Uncaptured], Uncaptured]


@dataclass
class Pipeline:
    passes: list[tuple[str, Callable, bool]] = field(default_factory=list)  # (name, fn, wraps)

    def add(self, name: str, fn: Pass) -> "Pipeline":
        self.passes.append((name, fn, False))
        return self

    def wrap(self, name: str, fn: WrapPass) -> "Pipeline":
        self.passes.append((name, fn, True))
        return self

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.passes]

    def run(self, prog: Program, dump_dir: Path | None = None, label: str = "graph", first: int = 1,
            keep_uncaptured: bool = False) -> Program:
        """`first`: the number of the first pass in the dump (a pipeline continuing another's).
        `keep_uncaptured`: return trailing wrapping passes uncaptured (a first stage that other
        pipelines continue), else an ExportedProgram. A dump captures each stage for display only."""
        if dump_dir is not None and first == 1:
            dump_graph(captured(prog), Path(dump_dir) / f"{label}.00-capture.txt")
        for i, (name, fn, wraps) in enumerate(self.passes, start=first):
            prog = fn(uncaptured(prog)) if wraps else fn(captured(prog))
            if dump_dir is not None:
                dump_graph(captured(prog), Path(dump_dir) / f"{label}.{i:02d}-{name}.txt")
        return prog if keep_uncaptured else captured(prog)


def uncaptured(prog: Program) -> Uncaptured:
    return prog if isinstance(prog, Uncaptured) else Uncaptured(prog.module(), example_inputs(prog))


def captured(prog: Program) -> torch.export.ExportedProgram:
    return capture(prog.module, prog.args) if isinstance(prog, Uncaptured) else prog


def dump_graph(ep: torch.export.ExportedProgram, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    sig = "\n".join(f"# input  {s.kind.name:<16} {s.arg.name} <- {s.target}" for s in ep.graph_signature.input_specs)
    sig += "\n" + "\n".join(f"# output {s.kind.name:<16} {getattr(s.arg, 'name', s.arg)} -> {s.target}"
                            for s in ep.graph_signature.output_specs)
    path.write_text(sig + "\n\n" + ep.graph_module.print_readable(print_output=False))


def capture(module: nn.Module, example_args: tuple) -> torch.export.ExportedProgram:
    """torch.export with static shapes; cache writes stay in the graph as buffer mutations."""
    # Separate storage per input: aliased example inputs break later decompositions.
    example_args = tuple(a.clone() for a in example_args)
    with torch.no_grad():
        return torch.export.export(module, example_args, strict=False)



def example_inputs(ep: torch.export.ExportedProgram) -> tuple:
    """Fresh example user inputs with the program's static shapes and dtypes (zeros)."""
    out = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind.name != "USER_INPUT":
            continue
        val = ep.graph.find_nodes(op="placeholder", target=spec.arg.name)[0].meta["val"]
        out.append(torch.zeros(val.shape, dtype=val.dtype))
    return tuple(out)


def canonical_name(fqn: str) -> str:
    """Each retrace nests the previous module as `inner`; strip that to the name the runtime uses."""
    while fqn.startswith("inner."):
        fqn = fqn[len("inner."):]
    return fqn
