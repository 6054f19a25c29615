"""`CompileConfig`: everything `specc compile` takes, validated when it is made.

The CLI builds one from its arguments, `specc.compile(model, config)` or keyword arguments build
one, and calibration derives variants with `dataclasses.replace` (which validates again). A bad
field raises SpeccError with one sentence that names the option and says what to use instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .backends import backends_with, check_backend, check_device, get_backend
from .drafters import get_kind, kinds_with
from .errors import SpeccError
from .manifest import MANIFEST
from .models import parse_dtype
from .quant import parse_quant, quant_spec
from .signature import MODES
from .tree import MAX_TREE_NODES, Tree, chain, is_measured, parse_tree

CHILDREN = ("topk", "sampled")
MAX_NGRAM_BRANCH = 16  # deeper than lookup's continuations usefully reach
DRAFTER_OPTIONS = {"drafter_path": "--drafter-path", "drafter_layers": "--drafter-layers", "block_size": "--block-size",
                   "ngram_corpus": "--ngram-corpus"}


@dataclass(frozen=True)
class CompileConfig:
    output_dir: str | Path | None = None
    model: str | Path | None = None  # HF directory, .gguf file, or None: the embedded SmolLM2
    drafter: str = "none"
    tree: str | None = None  # None: the drafter kind's default
    backend: str = "eager"
    device: str | None = None  # cpu; cuda for tensorrt (its engines are built and run on the GPU machine)
    drafter_path: str | Path | None = None
    drafter_layers: int | None = None
    block_size: int | None = None
    # ngram: a table of what followed each short context in a corpus (specc/corpus.py): "sharegpt",
    # "none", or a .jsonl file of {"text": ...} or {"ids": [...]} lines; None: sharegpt when the
    # target's tokenizer has a chat template, else none.
    ngram_corpus: str | Path | None = None
    children: str = "topk"
    # The sampling modes whose graphs the engine carries (greedy, sample, top_p): a string "a,b" or a tuple.
    modes: str | tuple[str, ...] = MODES
    dtype: str = "float32"
    max_len: int = 1024
    # Prompt tokens per prefill call: one size, or several ("128,32" or a tuple), each a chunk graph
    # (specc/prefill.py covers a prompt with the cheapest calls); a tuple once parsed, largest first.
    # `prefill_chunks`: those the engine gets (none past --max-len); its smallest is the chunk the
    # drafters' graphs take.
    prefill_chunk: int | str | tuple[int, ...] = (128, 32)
    dump_ir: str | Path | None = None
    progress: bool = True
    # A family of step graphs (the tree's node-count prefixes, down to plain), timed at compile time;
    # per step the runtime verifies the one with the most expected tokens per second (specc/adaptive.py).
    adaptive: bool = False
    # Hybrid trees (specc/hybrid.py): a chain of this many nodes under the root that the runtime fills
    # with prompt lookup's continuation, beside a model drafter's tree. 0: none.
    ngram_branch: int = 0
    # Weight-only quantization of the target's linear layers (specc/quant.py): a config object
    # (Int8WeightOnly(), Int4WeightOnly(symmetric=True), GGUFFile()) or its --quant string ("none",
    # "int8", "int8:group_size=32", "int4", "gguf", ...); the config once parsed, None for none.
    quant: object = None
    # Called as each graph of the engine is finished (captured, passes run, lowered) with its name and
    # seconds, so a caller can report a slow compile as it happens (examples/gpu_check.py prints a
    # line per graph); the manifest's `compile_s` keeps the same figures.
    on_graph: Callable[[str, float], None] | None = field(default=None, compare=False, repr=False)
    # Derived in __post_init__: the parsed tree (a stand-in chain for a measured spec) and the dtype.
    tree_spec: str = field(init=False)
    prefill_chunks: tuple[int, ...] = field(init=False)
    parsed_tree: Tree = field(init=False, repr=False, compare=False)
    torch_dtype: torch.dtype = field(init=False, repr=False)

    def __post_init__(self):
        if self.output_dir is None:
            raise SpeccError("an output directory is required (-o DIR).")
        out = Path(self.output_dir)
        if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / MANIFEST).is_file())):
            raise SpeccError(f"output {str(out)!r} exists and is not a specc engine directory; refusing to overwrite it.")
        kind = get_kind(self.drafter)
        backend = check_backend(self.backend)
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen)
        if backend.built_later:
            # The graphs are exported here and built into engines where they run (`specc build`).
            if torch.device(self.device or backend.devices[0]).type not in backend.devices:
                raise SpeccError(f"{backend.label} engines run on CUDA GPUs; use --backend {backend.name} with "
                                 f"--device cuda.")
            set_("device", self.device or backend.devices[0])
        else:
            set_("device", check_device(self.device or "cpu"))
        set_("torch_dtype", parse_dtype(self.dtype))
        if self.torch_dtype not in backend.dtypes:
            raise SpeccError(backend.dtype_refusal)
        set_("modes", parse_modes(self.modes))
        if self.children not in CHILDREN:
            raise SpeccError(f"--children {self.children!r} is unknown; use topk or sampled.")
        if self.children == "sampled" and not kind.SAMPLED_CHILDREN:
            raise SpeccError("--children sampled draws drafts from the drafter's distribution over tokens; use it "
                             f"with --drafter {kinds_with('SAMPLED_CHILDREN')}.")
        if not 2 <= self.max_len <= 1 << 20:
            raise SpeccError(f"--max-len {self.max_len} is out of range; use a length from 2 to 1048576.")
        set_("prefill_chunk", parse_chunks(self.prefill_chunk))  # a tuple, so that `replace` keeps them all
        # a chunk longer than the longest context would only pad; the smallest stays whatever its size
        set_("prefill_chunks", tuple(c for c in self.prefill_chunk if c <= self.max_len) or self.prefill_chunk[-1:])
        for name, flag in DRAFTER_OPTIONS.items():
            if getattr(self, name) is not None and name not in kind.OPTIONS:
                raise SpeccError(f"{flag} only applies to --drafter {kinds_with('OPTIONS', name)}.")
        set_("tree_spec", self.tree or kind.DEFAULT_TREE)
        set_("parsed_tree", self._check_tree(kind))
        if self.adaptive:
            if not kind.ADAPTIVE:
                raise SpeccError(f"--adaptive needs a drafter whose drafts come with confidences; in this version "
                                 f"that is --drafter {kinds_with('ADAPTIVE')}.")
            if backend.built_later:
                raise SpeccError(f"--adaptive times its step graphs where they are compiled, which a {backend.name} "
                                 f"engine cannot do before `specc build`; use --backend onnx or inductor.")
            if self.ngram_branch:
                raise SpeccError("--adaptive chooses from the drafter's confidences, which prompt lookup's branch "
                                 "lacks; use --adaptive or --ngram-branch, not both.")
        self._check_ngram_branch(kind)
        self._check_quant(backend)
        kind.check(self)

    def _check_quant(self, backend) -> None:
        object.__setattr__(self, "quant", q := parse_quant(self.quant))
        if q is None:
            return
        if hasattr(q, "check"):
            q.check(self)
        if q.weights not in backend.weights:
            raise SpeccError(f"--quant {quant_spec(q)} runs on the {backends_with(lambda b: q.weights in b.weights)} "
                             f"backends; {backend.weight_refusal[q.weights]}.")

    def _check_ngram_branch(self, kind) -> None:
        k = self.ngram_branch
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_NGRAM_BRANCH:
            raise SpeccError(f"--ngram-branch {k!r} is out of range; use 0 (none) to {MAX_NGRAM_BRANCH} nodes.")
        if not k:
            return
        if not kind.NGRAM_BRANCH:
            raise SpeccError(f"--ngram-branch adds prompt lookup's continuation to a model drafter's tree; use it with "
                             f"--drafter {kinds_with('NGRAM_BRANCH')}.")
        if self.children == "sampled":
            raise SpeccError("--ngram-branch overwrites drafts, and children sampled from the drafter must stay the "
                             "drafter's own draws to be verified exactly; use --children topk.")
        if self.tree_spec.strip() == "auto":
            raise SpeccError("--ngram-branch adds a branch to a tree you give, and --tree auto picks among compiled "
                             "engines; pass the tree auto picked, or --tree sequoia:BUDGET.")
        size = self.parsed_tree.size if not self.measured_tree else int(self.tree_spec.partition(":")[2])  # sequoia's budget
        if size + k > MAX_TREE_NODES:
            raise SpeccError(f"--tree {self.tree_spec} with --ngram-branch {k} has {size + k} nodes, more than the "
                             f"limit of {MAX_TREE_NODES}.")

    def _check_tree(self, kind) -> Tree:
        spec = self.tree_spec
        if is_measured(spec):
            if get_backend(self.backend).built_later:
                raise SpeccError(f"--tree {spec} is measured by running candidate engines, which a {self.backend} "
                                 f"engine cannot do before `specc build`; measure it with --backend onnx or inductor "
                                 f"and pass the tree it picked.")
            if spec.strip() != "auto":
                parse_tree(spec, acceptance=[[1.0]])  # the form and budget; the tree itself is measured
            if not kind.MEASURED_TREES:
                raise SpeccError(f"--tree {spec} is built from how often a drafter's ranked candidates are "
                                 f"accepted; use it with --drafter {kinds_with('MEASURED_TREES')}.")
            return chain(1)  # replaced by the measured tree before any use
        tree = parse_tree(spec)
        if not kind.DRAFTS and tree.size > 1:
            raise SpeccError(f"--tree {spec} needs a drafter to fill it; add --drafter ngram or draft-model.")
        if kind.DRAFTS and tree.size < 2:
            raise SpeccError(f"--tree {spec} has no draft tokens; use chain:K with K >= 1.")
        if not kind.FILLS_TREES and not tree.is_chain:
            raise SpeccError(f"the {self.drafter} drafter proposes a chain in this version; use --tree chain:K.")
        return tree

    @property
    def measured_tree(self) -> bool:
        return is_measured(self.tree_spec)


def parse_modes(modes) -> tuple[str, ...]:
    """--modes: a comma-separated subset of MODES, kept in MODES' order."""
    names = [m.strip() for m in modes.split(",")] if isinstance(modes, str) else list(modes)
    unknown = [m for m in names if m not in MODES]
    if unknown or not names:
        raise SpeccError(f"--modes {','.join(names)!r} is not a list of sampling modes; use one or more of "
                         f"{','.join(MODES)} (greedy: temperature 0; sample: temperature > 0; top_p: with top-p < 1).")
    return tuple(m for m in MODES if m in names)


def parse_chunks(value) -> tuple[int, ...]:
    """--prefill-chunk's sizes, largest first: an int, "128,32", or a sequence of ints."""
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, (tuple, list)) else [value]
    try:
        chunks = sorted({int(str(c).strip()) for c in items}, reverse=True)
    except ValueError:
        chunks = []
    if not chunks or not all(1 <= c <= 4096 for c in chunks):
        raise SpeccError(f"--prefill-chunk {value!r} is not a list of chunk sizes from 1 to 4096 (e.g. 128,32).")
    return tuple(chunks)
