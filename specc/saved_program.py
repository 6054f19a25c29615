"""An eager engine's graphs on disk, so that loading one never captures again (capturing a 30-layer
model's graphs costs minutes; reading them back costs seconds).

A graph is two files: `NAME.json`, the program in torch.export's JSON schema (no pickle), and
`NAME.safetensors`, the tensors the program holds that the engine does not own (rotary tables,
tree constants). The engine's own weights and caches are not written again: the safetensors
metadata lists their names, and loading binds the engine's tensors to them.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import types
import typing
import unittest.mock
from pathlib import Path

import torch

from .errors import SpeccError
from .pipeline import canonical_name


def save_program(ep: torch.export.ExportedProgram, state: dict[str, torch.Tensor], folder: Path,
                 name: str) -> dict:
    """Write graph `name` of an engine into folder/graphs; returns its manifest fields."""
    from safetensors.torch import save_file
    from torch._export.serde import serialize as serde

    # torch's serializer checks that its canonical form is well defined by building it from a deep
    # copy of the whole serialized program and discarding it: most of the time of a save, never
    # part of what is written.
    # torch 2.11 (the GPU machine's) cannot skip the tensors, which are written here separately: it
    # pickles them into the artifact, which is then dropped (slower, same files).
    skip = {"serialize_state_dict": False, "serialize_constants": False, "serialize_example_inputs": False}
    if not skip.keys() <= inspect.signature(serde.serialize).parameters.keys():
        skip = {}
    with unittest.mock.patch.object(serde, "canonicalize", lambda program, constants=None: program):
        art = serde.serialize(ep, **skip)
    own: dict[str, list[str]] = {"state_dict": [], "constants": []}
    tensors = {}
    for group, values in (("state_dict", ep.state_dict), ("constants", ep.constants)):
        for fqn, value in values.items():
            if canonical_name(fqn) in state:
                own[group].append(fqn)
            elif isinstance(value, torch.Tensor):
                tensors[f"{group}/{fqn}"] = value.detach().cpu().contiguous().clone()
            else:
                raise SpeccError(f"graph {name} holds a {type(value).__name__} constant {fqn!r}, which an "
                                 f"eager engine cannot save; use --backend inductor.")
    rel = f"graphs/{name}"
    (folder / f"{rel}.json").write_text(json.dumps(without_stack_traces(json.loads(art.exported_program))))
    save_file(tensors, str(folder / f"{rel}.safetensors"), metadata={"own": json.dumps(own)})
    return {"file": f"{rel}.json", "tensors": f"{rel}.safetensors"}


def without_stack_traces(node):
    """The serialized program minus the nodes' stack traces: they name this process's generated
    modules and this checkout's paths, so the same engine compiled twice would differ in bytes."""
    if isinstance(node, dict):
        return {k: without_stack_traces(v) for k, v in node.items() if k != "stack_trace"}
    if isinstance(node, list):
        return [without_stack_traces(v) for v in node]
    return node


def load_program(folder: Path, entry: dict, state: dict[str, torch.Tensor]) -> torch.export.ExportedProgram:
    """The program save_program wrote, with the engine's own tensors bound in by name."""
    from safetensors import safe_open
    from torch._export.serde import schema
    from torch._export.serde.serialize import ExportedProgramDeserializer

    values: dict[str, dict[str, torch.Tensor]] = {"state_dict": {}, "constants": {}}
    with safe_open(str(folder / entry["tensors"]), "pt") as f:
        own = json.loads(f.metadata()["own"])
        for key in f.keys():
            group, _, fqn = key.partition("/")
            values[group][fqn] = f.get_tensor(key)
    program = from_json(schema.ExportedProgram, json.loads((folder / entry["file"]).read_text()))
    params = {spec.value.parameter_name for spec in program.graph_module.signature.input_specs
              if spec.type == "parameter"}
    for group, names in own.items():
        for fqn in names:
            if canonical_name(fqn) not in state:
                raise SpeccError(f"graph {Path(entry['file']).stem} needs tensor {canonical_name(fqn)!r}, which the "
                                 f"engine does not have.")
            value = state[canonical_name(fqn)]
            if fqn in params and not isinstance(value, torch.nn.Parameter):  # moved tensors (move_states) are
                value = torch.nn.Parameter(value, requires_grad=False)       # plain: the same storage, wrapped
            values[group][fqn] = value
    return ExportedProgramDeserializer().deserialize(program, values["state_dict"], values["constants"], None)


def from_json(cls, data):
    """JSON -> torch.export's schema dataclasses. torch's own reader asks typing for every object's
    field types again (most of a load's time); the answers are the same for a class, so ask once."""
    from torch._export.serde import schema
    from torch._export.serde.union import _Union

    if isinstance(cls, (str, typing.ForwardRef)):
        cls = getattr(schema, cls.__forward_arg__ if isinstance(cls, typing.ForwardRef) else cls)
    origin = typing.get_origin(cls)
    if origin is typing.Annotated:
        return from_json(typing.get_args(cls)[0], data)
    if origin in (typing.Union, types.UnionType):  # Optional[X]
        if data is None:
            return None
        (inner,) = [a for a in typing.get_args(cls) if a is not type(None)]
        return from_json(inner, data)
    if isinstance(cls, type) and issubclass(cls, _Union):  # one field set: {"name": value}
        ((field, value),) = data.items()
        return cls.create(**{field: from_json(field_types(cls)[field], value)})
    if dataclasses.is_dataclass(cls):
        types_ = field_types(cls)
        return cls(**{k: from_json(types_[k], v) for k, v in data.items() if k in types_})
    if origin is list:
        (item,) = typing.get_args(cls)
        return [from_json(item, v) for v in data]
    if origin is dict:
        _, item = typing.get_args(cls)
        return {k: from_json(item, v) for k, v in data.items()}
    if cls is float:
        return float(data)  # JSON writes 1.0 as 1
    return data


@functools.cache
def field_types(cls) -> dict:
    from torch._export.serde import schema

    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in typing.get_type_hints(cls, globalns=vars(schema)).items() if k in names}
