"""specc.json, an engine's manifest, as one typed object: read, checked and written only here.

The compiler fills a `Manifest` (after the post-build measurements, specc/compiler.py) and writes it
once; `specc.load`, `specc inspect`, `specc build` and the benchmarks read it back with `read`. The
JSON keeps the layout engines have always had (a graph's backend fields sit beside its common ones);
what older engines of this format wrote differently is mapped here (`from_json`) and nowhere else.

The drafter's entry (`drafter`) and the tree's (`tree`) stay dictionaries: each drafter kind owns
its entry's keys (specc/drafters/), and the tree's report is what calibration measured.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import SpeccError
from .signature import MODES

MANIFEST = "specc.json"
FORMAT_VERSION = 4  # 2: one DraftSignature for DFlash and MTP graphs, drafter graphs named draft_*;
                    # 3: eager graphs saved (program JSON + safetensors), not captured again on load;
                    # 4: one graph per sampling mode (plain_greedy, step_top_p, ...), no torch.cond


@dataclass
class Graph:
    """One compiled graph: which module it runs, its rows and inputs, and what its backend wrote."""
    module: str  # target | draft | fused
    tokens: int  # rows a call verifies or prefills
    inputs: list  # [[shape...], "torch.<dtype>"] per input, in call order
    mode: str | None = None  # the sampling mode of a graph that samples
    passes: list = field(default_factory=list)  # the FX passes after capture
    lowering: list = field(default_factory=list)  # the backend's own passes before it compiles
    lowered: dict = field(default_factory=dict)  # the backend's fields (files, state keys, caches): its own format

    COMMON = ("module", "tokens", "inputs", "mode", "passes", "lowering")

    def input_specs(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [(tuple(s), getattr(torch, d.replace("torch.", ""))) for s, d in self.inputs]

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in self.COMMON if k != "lowering" or self.lowering}
        return {**out, **self.lowered}

    @classmethod
    def from_json(cls, d: dict) -> "Graph":
        return cls(**{k: d[k] for k in cls.COMMON if k in d}, lowered={k: v for k, v in d.items() if k not in cls.COMMON})


@dataclass
class Target:
    name: str
    source: str
    arch: str
    num_layers: int
    vocab_size: int
    eos_token_ids: list
    config: dict  # the Hugging Face config, as to_dict() gives it
    weights_sha256: str | None = None


@dataclass
class Quant:
    """What each decoded token reads: the target's weights (quantized as `target` spells it,
    specc.quant.quant_spec) and the drafter's own."""
    target: str = "none"
    drafter: str = "none"
    bytes_per_token: dict = field(default_factory=dict)


ABSENT_WHEN_NONE = ("products", "adaptive", "prefill_ms", "tensorrt", "compile_split")  # optional sections, left out when unset


@dataclass
class Manifest:
    target: Target
    drafter: dict  # the drafter kind's entry ("kind" and what its load_saved needs)
    tree: dict  # spec, paths, parents, depths, ranks, and a measured tree's report
    backend: str
    device: str
    dtype: str
    modes: list
    max_len: int
    prefill_chunk: int  # the smallest chunk: the one the drafters' graphs take
    prefill_chunks: list
    cache_len: int
    graphs: dict  # name -> Graph
    quant: Quant = field(default_factory=Quant)
    files: dict = field(default_factory=dict)  # path -> sha256 of every file but this one
    compile_s: dict = field(default_factory=dict)  # seconds each graph took to build
    compile_split: dict | None = None  # where the compile's time went (specc/compile_clock.py)
    cpu_kernels: bool = False  # the graphs call specc's C++ CPU products (kernels/cpu_kernels.py)
    products: dict | None = None  # float32's few-row product choices, timed at compile (specc/products.py)
    adaptive: dict | None = None  # the family and its calibration (specc/adaptive.py)
    prefill_ms: dict | None = None  # each prefill call size's milliseconds, timed at compile
    tensorrt: dict | None = None  # whether and where its TensorRT engines were built (specc/tensorrt.py)
    format_version: int = FORMAT_VERSION
    specc_version: str = ""
    torch_version: str = ""
    triton_version: str | None = None
    transformers_version: str = ""
    platform: str = ""

    def to_json(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ABSENT_WHEN_NONE and v is None:
                continue
            if f.name == "graphs":
                v = {name: g.to_json() for name, g in v.items()}
            elif dataclasses.is_dataclass(v):
                v = dataclasses.asdict(v)
            out[f.name] = v
        return out

    @classmethod
    def from_json(cls, d: dict) -> "Manifest":
        d = dict(d)
        quant = dict(d.pop("quant", {}))
        if quant.pop("cpu_kernel", False):  # engines before `cpu_kernels` kept the flag under quant
            d["cpu_kernels"] = True
        d.setdefault("device", "cpu")
        d.setdefault("modes", list(MODES))  # engines from before `modes` was recorded carry them all
        d.setdefault("prefill_chunks", [d["prefill_chunk"]])
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names and k not in ("target", "graphs")},
                   target=Target(**d["target"]), quant=Quant(**quant),
                   graphs={name: Graph.from_json(g) for name, g in d["graphs"].items()})


def read(path) -> Manifest:
    """An engine directory's manifest, or one sentence saying why it cannot be read."""
    path = Path(path)
    mf = path / MANIFEST
    if not mf.is_file():
        raise SpeccError(f"{str(path)!r} is not a specc engine directory (no {MANIFEST}); create one with `specc compile`.")
    try:
        d = json.loads(mf.read_text())
    except ValueError:
        raise SpeccError(f"{mf} is not valid JSON; compile the engine again.") from None
    if not isinstance(d, dict) or d.get("format_version") != FORMAT_VERSION:
        version = d.get("format_version") if isinstance(d, dict) else None
        raise SpeccError(f"engine format {version} is not the format this specc reads ({FORMAT_VERSION}); compile "
                         f"the engine again.")
    try:
        return Manifest.from_json(d)
    except (KeyError, TypeError) as e:
        raise SpeccError(f"{mf} lacks what an engine manifest holds ({e}); compile the engine again.") from None


def write(path, manifest: Manifest) -> None:
    """The one place specc.json is written: whole, then renamed over the old one."""
    path = Path(path)
    tmp = path / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest.to_json(), indent=1, default=str))
    tmp.replace(path / MANIFEST)
