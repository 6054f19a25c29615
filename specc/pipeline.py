"""The pass pipeline: named graph passes run in order, with an optional dump of the graph after each.

A pass is a plain function `ExportedProgram -> ExportedProgram` with a docstring that states the
invariant it establishes. Passes that change the graph's signature (new inputs or outputs) do it
by wrapping the previous program's module and capturing it again (`capture`); passes that only
rewrite nodes edit the FX graph in place.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

Pass = Callable[[torch.export.ExportedProgram], torch.export.ExportedProgram]


@dataclass
class Pipeline:
    passes: list[tuple[str, Pass]] = field(default_factory=list)

    def add(self, name: str, fn: Pass) -> "Pipeline":
        self.passes.append((name, fn))
        return self

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.passes]

    def run(self, ep: torch.export.ExportedProgram, dump_dir: Path | None = None, label: str = "graph",
            first: int = 1) -> torch.export.ExportedProgram:
        """`first`: the number of the first pass in the dump (a pipeline continuing another's)."""
        if dump_dir is not None and first == 1:
            dump_graph(ep, Path(dump_dir) / f"{label}.00-capture.txt")
        for i, (name, fn) in enumerate(self.passes, start=first):
            ep = fn(ep)
            if dump_dir is not None:
                dump_graph(ep, Path(dump_dir) / f"{label}.{i:02d}-{name}.txt")
        return ep


def dump_graph(ep: torch.export.ExportedProgram, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    sig = "\n".join(f"# input  {s.kind.name:<16} {s.arg.name} <- {s.target}" for s in ep.graph_signature.input_specs)
    sig += "\n" + "\n".join(f"# output {s.kind.name:<16} {getattr(s.arg, 'name', s.arg)} -> {s.target}"
                            for s in ep.graph_signature.output_specs)
    path.write_text(sig + "\n\n" + ep.graph_module.print_readable(print_output=False))


def capture(module: nn.Module, example_args: tuple) -> torch.export.ExportedProgram:
    """torch.export with static shapes; cache writes stay in the graph as buffer mutations. Passes
    that change a graph's signature capture a module wrapping the previous program's module."""
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
