"""Lowering: each finished ExportedProgram becomes a callable `graph(state, *inputs)`.

* eager: the reference. The program is saved (specc/saved_program.py) and its module runs in
  Python with the engine's weights and caches bound in.
* inductor: an AOTInductor `.pt2` package. Weights and KV caches are *inputs* of the compiled
  graph (a dict), so one set of tensors in memory serves every graph of an engine, the packages
  hold code only, and a package can be reused for any model with the same graph (the compile
  cache is keyed on the graph text, shapes and versions, not on weight values).
* onnx: functional ONNX graphs run by onnxruntime (specc/onnx_backend.py).
* tensorrt: the onnx backend's graphs, which must pass the TensorRT lint (specc/trt_lint.py), built
  into TensorRT engines on the GPU machine that runs them (specc/tensorrt.py).
"""
from __future__ import annotations

import ast
import fcntl
import functools
import hashlib
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch.utils import _pytree as pytree
from torch import nn

from . import compile_clock
from .errors import SpeccError
from .models import cache_dir
from .pipeline import canonical_name
from .quant import WEIGHT_FORMATS
from .saved_program import load_program, save_program

def get_backend(name: str) -> "Backend":
    """The registered backend of that name (KINDS, at the end of this module), or one sentence why not."""
    if name not in KINDS:
        raise SpeccError(f"--backend {name!r} is unknown; use one of {', '.join(KINDS)}.")
    return KINDS[name]


def check_backend(name: str) -> "Backend":
    """get_backend, and what the backend needs installed (onnx) checked now."""
    backend = get_backend(name)
    if backend.requires is not None:
        backend.requires()
    return backend


def backends_with(test: Callable[["Backend"], bool]) -> str:
    """The names of the backends that pass `test`, for a sentence ("eager, inductor and onnx")."""
    names = [n for n, b in KINDS.items() if test(b)]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def check_device(device: str) -> str:
    """The device an engine runs on: cpu, or cuda[:N] where this machine has that GPU."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise SpeccError(f"--device {device!r} is not a device; use cpu or cuda (cuda:N for one of several GPUs).") \
            from None
    if d.type not in ("cpu", "cuda"):
        raise SpeccError(f"--device {device}: specc engines run on cpu or cuda.")
    if d.type == "cuda" and not torch.cuda.is_available():
        raise SpeccError(f"--device {device} needs a CUDA GPU and a CUDA build of torch; this machine has none "
                         f"(torch {torch.__version__}).")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise SpeccError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s).")
    if d.type == "cuda" and d.index is None:  # "cuda" is the current GPU: name it, so cuda and cuda:0 agree
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def move_states(states: dict[str, dict[str, torch.Tensor]], device: str) -> dict[str, dict[str, torch.Tensor]]:
    """Each graph's tensors on `device`. A tensor that several dicts hold (a shared head, a cache both
    the step and the fused graph write) stays one tensor there, so every graph still sees its writes."""
    if torch.device(device).type == "cpu":
        return states
    moved: dict[int, torch.Tensor] = {}

    def move(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in moved:
            moved[id(t)] = t.detach().to(device)
        return moved[id(t)]

    return {name: {k: move(t) for k, t in state.items()} for name, state in states.items()}


def on_device(ep: torch.export.ExportedProgram, device: str,
              state: dict[str, torch.Tensor] | None = None) -> torch.export.ExportedProgram:
    """A copy of the program for `device`: its devices written into its nodes (arange, zeros), its
    own small constants (tree masks, rotary tables) moved, and every tensor the engine owns (`state`,
    already on `device`: move_states) taken as it is, never copied. Programs are captured on CPU;
    this is how an engine's graphs reach a GPU.

    A copy: move_to_device_pass works in place, and the CPU program may still be needed (the fused
    step is built from the step and drafter programs after they were lowered). The copy shares
    tensors rather than copying them: the deep copy is told (through its memo) that each
    weight's copy is the engine's tensor on `device`, and each small constant's copy is the
    constant itself (move_to_device_pass then puts a moved one in the copy's table, never
    touching the original). move_to_device_pass (torch 2.11 and 2.13 alike) calls `.to(device)` on
    every state_dict and constants entry, which returns a tensor already there as it is, and wraps
    a parameter as `nn.Parameter(t)`, which shares its storage. So compiling N graphs for a GPU
    holds one set of weights there, not N (and no CPU copy either)."""
    target = torch.device(device)
    if target.type == "cpu":
        return ep
    import copy

    from torch.export.passes import move_to_device_pass

    params = set(ep.graph_signature.parameters)
    memo: dict[int, object] = {}
    for fqn, t in (*ep.state_dict.items(), *ep.constants.items()):
        if not isinstance(t, torch.Tensor) or id(t) in memo:
            continue
        own = state.get(canonical_name(fqn)) if state is not None else None
        if own is None:
            memo[id(t)] = t  # the graph's own constant: moved (copied) by the pass, into the copy only
            continue
        if own.device.type != target.type or (target.index is not None and own.device.index != target.index):
            raise ValueError(f"on_device: the engine's tensor {canonical_name(fqn)!r} is on {own.device}, not "
                             f"{device}; move the engine's tensors once (move_states) first.")
        if fqn in params and not isinstance(own, nn.Parameter):  # what the verifier wants (move_states
            own = nn.Parameter(own, requires_grad=False)          # gives plain tensors); the same storage
        memo[id(t)] = own
    return move_to_device_pass(copy.deepcopy(ep, memo), device)


def state_names(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, str]:
    """Map each of the module's parameter/buffer names that the engine owns to its canonical name."""
    names = {}
    for fqn, _ in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False)):
        canon = canonical_name(fqn)
        if canon in state:
            names[fqn] = canon
    return names


def _set_tensor(module: nn.Module, fqn: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = fqn.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[leaf] = value


class EagerGraph:
    """Runs an exported program's module with the engine's weights and caches bound in place."""

    def __init__(self, ep: torch.export.ExportedProgram, state: dict[str, torch.Tensor]):
        self.module = ep.module()
        for fqn, canon in state_names(self.module, state).items():
            _set_tensor(self.module, fqn, state[canon])

    def __call__(self, *args):
        with torch.no_grad():
            return self.module(*args)


class Lifted(nn.Module):
    """The program with the engine's tensors as an explicit dict input (for AOTInductor)."""

    def __init__(self, module: nn.Module, names: dict[str, str]):
        super().__init__()
        # Not a registered submodule: its own copies of the engine's tensors must not become extra
        # (aliased) inputs or packaged constants; functional_call swaps the dict's tensors in.
        object.__setattr__(self, "module", module)
        self.names = names

    def forward(self, state, *args):
        return torch.func.functional_call(self.module, {fqn: state[c] for fqn, c in self.names.items()}, args)


def lift(ep: torch.export.ExportedProgram, state: dict[str, torch.Tensor], example_args: tuple):
    """Export the program again with the engine's tensors it uses as a leading dict input."""
    module = ep.module()
    names = state_names(module, state)
    sub = {k: state[k] for k in sorted(set(names.values()))}
    with torch.no_grad():
        return torch.export.export(Lifted(module, names), (sub, *example_args), strict=False), sub


# C++ comments, and the string and character literals that may hold comment-like text (kept).
_CPP_COMMENT_OR_LITERAL = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|//[^\n]*|/\*.*?\*/', re.S)


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return tree


def code_text(path: Path) -> str:
    """A source file's code without its comments: for Python its syntax tree without docstrings
    (layout and comments are not in it), for C++ the text with comments removed and blank lines
    dropped. The compile cache keys on this, so that editing a kernel's documentation does not
    recompile every engine (a SmolLM2 adaptive engine takes about 14 minutes here)."""
    text = path.read_text()
    if path.suffix == ".py":
        return ast.dump(_without_docstrings(ast.parse(text)))
    if 'R"' in text:  # a raw string literal, which the pattern cannot skip: keep every byte
        return text
    # a backslash-newline joins lines before comments are seen (a // comment can run on), so join first
    code = _CPP_COMMENT_OR_LITERAL.sub(lambda m: " " if m.group(0)[0] == "/" else m.group(0),
                                       text.replace("\\\n", ""))
    return "\n".join(line.rstrip() for line in code.splitlines() if line.strip())


def kernel_sources() -> str:
    """The specc ops are triton_ops whose bodies Inductor inlines (the acceptance rules' entry points
    in acceptance.py pick them): their code is part of the compiled code."""
    import specc.kernels
    from specc.kernels.cpu_kernels import load_cpu_kernel
    from specc.kernels.rows_linear import choice_key

    folder = Path(specc.kernels.__file__).parent
    files = sorted(folder.glob("*.py")) + sorted(folder.glob("*.cpp")) + [Path(__file__).parent / "acceptance.py"]
    # whether gguf_linear's CPU body calls the C++ product or the reference decides the compiled code
    return "".join(f"{p.name}\n{code_text(p)}\n" for p in files) + f"cpu_kernel={load_cpu_kernel()}," + choice_key()


# Inductor keeps a fused bf16/fp16 chain in float32 and rounds once at the store, so a graph's
# numerics depend on what it fused: the T-row step graph and the 1-row plain graph of one bf16
# engine then disagree on near-ties (measured: a tiny bf16 engine's speculative greedy output left
# its plain decoding after 22 tokens). Rounding where eager rounds makes every graph of an engine,
# and the eager engine, compute each row alike. No effect on float32 graphs.
# Contraction: the C++ few-row product sums in the order of Inductor's reduction (dense_cpu.cpp), with
# one fused multiply-add per product as Inductor's `acc + w * x` becomes with contraction on; without
# it both would round twice, and the product at one row is 8-10% slower (measured, 2026-12-07).
# GCC contracts by a heuristic, not always: tuned for a CPU whose FMA latency it deems costly (-march=
# native on an AVX2 AMD EPYC, Zen 2/3) it leaves a reduction's single accumulator chain as a multiply
# and an add (the 1-row product) and fuses the independent chains of a T-row one, so a verify row lost
# the plain step's bits (measured there, 2026-12-07: 1 row against 4 or 7 rows of Inductor's own
# reduction). --param=avoid-fma-max-bits=0 turns the heuristic off: every `acc + w * x` is one FMA.
# (A GCC param; Inductor splits its flags on spaces, so it rides on the contraction flag.)
@functools.cache
def inductor_configs() -> dict:
    from torch._inductor.cpp_builder import is_gcc

    return {"emulate_precision_casts": True,
            "cpp.enable_floating_point_contract_flag": "fast --param=avoid-fma-max-bits=0" if is_gcc() else "fast"}


def cache_key(lifted_ep: torch.export.ExportedProgram, sub: dict, example_args: tuple) -> str:
    """What the compiled code depends on: graph text, shapes, dtypes, versions, and the exact bytes
    of the graph's own constants (tree masks, child tables), the kernels' code (inlined) -- not the
    engine's weights, which are inputs."""
    h = hashlib.sha256()
    for part in (lifted_ep.graph_module.code,
                 repr([(k, tuple(v.shape), str(v.dtype)) for k, v in sub.items()]),
                 repr([(tuple(a.shape), str(a.dtype)) for a in example_args]),
                 torch.__version__, "specc-aoti-3", repr(sorted(inductor_configs().items())), kernel_sources()):
        h.update(part.encode())
    for name, c in sorted(lifted_ep.constants.items()):
        h.update(name.encode())
        if isinstance(c, torch.Tensor):
            h.update(f"{tuple(c.shape)}{c.dtype}".encode())
            h.update(c.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(c).encode())
    return h.hexdigest()[:32]


def lowering_passes(backend: str, device: str) -> list[tuple[str, Callable]]:
    """Passes that run on the program just before the backend compiles it, as they depend on the
    device (the graph plans do not: one plan serves every device)."""
    return get_backend(backend).passes(device)


def _inductor_passes(device: str) -> list[tuple[str, Callable]]:
    """On CPU, attention over the cache's filled prefix; on CUDA, every decode product row-invariant."""
    if torch.device(device).type == "cpu":
        from specc.passes.attend_prefix import attend_prefix

        return [("attend_prefix", attend_prefix)]
    if torch.device(device).type == "cuda":
        from specc.passes.matvec import decode_products

        return [("decode_products", decode_products)]
    return []


def compile_inductor(ep: torch.export.ExportedProgram, state: dict[str, torch.Tensor], out_path: Path,
                     example_args: tuple, passes: list[tuple[str, Callable]] = ()) -> list[str]:
    """Compile to an AOTInductor package at out_path (through the compile cache), after running
    `passes` (lowering_passes) on the lifted program; returns the state keys it takes."""
    with compile_clock.phase("lift"):
        lifted_ep, sub = lift(ep, state, example_args)
        for _, fn in passes:
            lifted_ep = fn(lifted_ep)
    keys = list(sub)
    key = cache_key(lifted_ep, sub, example_args)
    cached = cache_dir() / "aoti" / f"{key}.pt2"
    cached.parent.mkdir(parents=True, exist_ok=True)
    # One compile per graph at a time on this machine: a second process compiling the same graph
    # (two engines of one model built side by side) waits for the first and takes its package.
    with open(cached.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        compile_clock.mark_cached(cached.is_file())
        if not cached.is_file():
            tmp = cached.with_suffix(f".tmp{os.getpid()}.pt2")
            try:
                with compile_clock.inductor_phases():
                    torch._inductor.aoti_compile_and_package(lifted_ep, package_path=str(tmp),
                                                             inductor_configs=dict(inductor_configs()))  # torch adds to it
                tmp.replace(cached)
            finally:
                tmp.unlink(missing_ok=True)
    shutil.copyfile(cached, out_path)
    return keys


class InductorGraph:
    def __init__(self, path: Path, state: dict[str, torch.Tensor], keys: list[str], single_threaded: bool = False):
        missing = [k for k in keys if k not in state]
        if missing:
            raise SpeccError(f"graph {path.name} needs tensor {missing[0]!r}, which the engine does not have.")
        # single_threaded: the runner CUDA graphs can capture (specc/cuda_graphs.py)
        self.runner = torch._inductor.aoti_load_package(str(path), run_single_threaded=single_threaded)
        self.state = {k: state[k] for k in keys}
        # The package's own __call__ parses its call spec and flattens the ~270 engine tensors on
        # every call (0.6 ms of a 15 ms CPU step for SmolLM2): do both once. specc's programs take
        # (state dict, *tensors); anything else takes the package's general path.
        in_spec, out_spec = (pytree.treespec_loads(s) for s in self.runner.loader.get_call_spec())
        self.out_spec, self.flat_state = out_spec, None
        if in_spec.children_specs[0].children_specs[0] == pytree.tree_structure(self.state):
            self.flat_state = pytree.tree_leaves(self.state)

    def __call__(self, *args):
        with torch.no_grad():
            if self.flat_state is None:
                return self.runner(self.state, *args)
            # boxed_run consumes its list: a fresh one per call
            return pytree.tree_unflatten(self.runner.loader.boxed_run([*self.flat_state, *args]), self.out_spec)


def require_trt_clean(folder: Path, entry: dict) -> None:
    """A graph TensorRT would refuse never reaches a tensorrt engine: the lint's first error, in one sentence."""
    from .trt_lint import graph_files, lint_file
    from .trt_ops import TRT_VERSION

    for f in graph_files(entry):
        errors = [x for x in lint_file(folder / f, f) if x.severity == "error"]
        if errors:
            hint = " (top-p sorts the vocabulary: leave top_p out of --modes)" if "TopK with K" in errors[0].message else ""
            raise SpeccError(f"graph {f} would not build in TensorRT {TRT_VERSION}: {errors[0].op} "
                             f"{errors[0].message}{hint}.")


def lower_graph(backend: str, ep: torch.export.ExportedProgram, state: dict[str, torch.Tensor], folder: Path,
                name: str, example_args: tuple, device: str) -> dict:
    """Lower one finished program into the engine directory `folder`; returns its manifest fields
    (the file, relative to `folder`, and what loading it needs)."""
    (folder / "graphs").mkdir(exist_ok=True)
    return get_backend(backend).lower(ep, state, folder, name, example_args, device)


def open_graph(backend: str, folder: Path, entry: dict, state: dict[str, torch.Tensor], device: str,
               cuda_graphs: bool = False):
    """The callable for one graph of an engine."""
    return get_backend(backend).open(folder, entry, state, device, cuda_graphs)


# -- the backends -----------------------------------------------------------------------------------

def _lower_eager(ep, state, folder, name, example_args, device) -> dict:
    return save_program(ep, state, folder, name)


def _open_eager(folder, entry, state, device, cuda_graphs=False):
    return EagerGraph(on_device(load_program(folder, entry, state), device, state), state)


def _lower_inductor(ep, state, folder, name, example_args, device) -> dict:
    rel, passes = f"graphs/{name}.pt2", _inductor_passes(device)
    keys = compile_inductor(on_device(ep, device, state), state, folder / rel,
                            tuple(a.to(device) for a in example_args), passes)
    return {"file": rel, "state_keys": keys, "lowering": [n for n, _ in passes]}


def _open_inductor(folder, entry, state, device, cuda_graphs=False):
    return InductorGraph(folder / entry["file"], state, entry["state_keys"], single_threaded=cuda_graphs)


def _run_eager(ep, state, folder, name, example_args, device):
    return EagerGraph(ep, state)


def _run_inductor(ep, state, folder, name, example_args, device):
    path = folder / f"{name}.pt2"
    return InductorGraph(path, state, compile_inductor(ep, state, path, example_args))


def _lower_onnx(ep, state, folder, name, example_args, device) -> dict:
    from .onnx_backend import lower_onnx

    return lower_onnx(ep, state, folder, name)


def _open_onnx(folder, entry, state, device, cuda_graphs=False):
    from .onnx_backend import OnnxGraph

    return OnnxGraph(folder, entry, state, device)


def _lower_tensorrt(ep, state, folder, name, example_args, device) -> dict:
    entry = _lower_onnx(ep, state, folder, name, example_args, device)
    require_trt_clean(folder, entry)
    return entry


def _open_tensorrt(folder, entry, state, device, cuda_graphs=False):
    from .tensorrt import TensorRTGraph

    return TensorRTGraph(folder, entry, state, device)


def _require_onnx() -> None:
    from .onnx_backend import require_onnx

    require_onnx()


def _check_built(manifest, folder: Path) -> None:
    from .tensorrt import check_built

    check_built(manifest, folder)


@dataclass(frozen=True)
class Backend:
    """What one backend is: how it lowers a finished program and opens what it wrote, and what it
    supports, which the compile options are checked against (CompileConfig) and the compiler and
    runtime look up instead of testing its name."""
    name: str
    label: str  # how a sentence names its engines
    lower: Callable  # (ep, state, folder, name, example_args, device) -> the graph's manifest fields
    open: Callable  # (folder, entry, state, device, cuda_graphs) -> graph(*inputs)
    dtypes: tuple = (torch.float32, torch.bfloat16, torch.float16)
    dtype_refusal: str = ""  # the sentence for another dtype
    weights: tuple = WEIGHT_FORMATS  # the quantized weights its graphs compute with (specc.quant)
    weight_refusal: dict = field(default_factory=dict)  # weight format -> what is missing for it here
    devices: tuple = ("cpu", "cuda")  # device types its engines run on
    built_later: bool = False  # graphs exported here and built into engines where they run (`specc build`)
    products: str = "none"  # which graphs' few-row products the plans rewrite: all, verify (decode graphs), none
    native_cpu: bool = False  # its graphs are native code on CPU, which may call specc's C++ products
    cuda_graphs: bool = False  # its CUDA calls can be captured as CUDA graphs
    locked: bool = False  # its engines run only under the torch version and on the device they were compiled for
    onnx_files: bool = False  # its graphs are ONNX files (what `specc inspect --trt-lint` reads)
    passes: Callable = lambda device: []  # lowering passes by device (lowering_passes)
    run: Callable | None = None  # (lowered ep, state, folder, name, example_args, device) -> graph: row checks
    requires: Callable | None = None  # what it needs installed, checked when an engine is configured
    check_loadable: Callable | None = None  # (manifest, folder) before an engine loads


ONNX_BLOCKS = "the ONNX lowering of block-quantized weights (int4, int8:group_size=32, gguf) is not built yet"
KINDS: dict[str, Backend] = {b.name: b for b in (
    Backend("eager", "eager", _lower_eager, _open_eager, products="verify", cuda_graphs=True, run=_run_eager),
    Backend("inductor", "AOTInductor", _lower_inductor, _open_inductor, products="all", native_cpu=True,
            cuda_graphs=True, locked=True, passes=_inductor_passes, run=_run_inductor),
    Backend("onnx", "ONNX", _lower_onnx, _open_onnx, dtypes=(torch.float32, torch.float16),
            dtype_refusal="the onnx backend runs float32 and float16 engines (onnxruntime has few bfloat16 "
                          "kernels); use --dtype float32 or float16.",
            weights=("float", "int8"), weight_refusal={"blocks": ONNX_BLOCKS}, onnx_files=True,
            requires=_require_onnx),
    Backend("tensorrt", "TensorRT", _lower_tensorrt, _open_tensorrt, weights=("float",),
            weight_refusal={"blocks": ONNX_BLOCKS, "int8": "TensorRT engines of int8 weights are not built yet"},
            devices=("cuda",), built_later=True, onnx_files=True, requires=_require_onnx, check_loadable=_check_built),
)}
