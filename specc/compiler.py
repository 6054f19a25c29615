"""specc.compile and specc.load: the whole pipeline, top to bottom.

    compile: CompileConfig -> load the target and the drafter -> the tree (parsed, or measured by
             calibration) -> the modules to capture (build_modules) -> graph plans -> capture +
             passes -> lower (eager | inductor) -> artifact directory (manifest, safetensors, graphs)
    load:    manifest -> the same modules (build_modules) and plans -> graphs -> Engine

The drafter is a kind (specc/drafters/): everything drafter-specific is asked of it.
"""
from __future__ import annotations

import contextlib
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from specc.kernels.rows_linear import kernel_choice

from . import __version__, adaptive, calibrate, compile_clock, products
from .backends import check_device, get_backend, lower_graph, move_states, open_graph
from .config import CompileConfig
from .drafters import get_kind
from .errors import SpeccError
from .hybrid import branch_entry, with_ngram_branch
from .manifest import Graph, Manifest, Quant, Target, read, write
from .models import default_gguf, load_model, parse_dtype, sha256_file
from .pipeline import example_inputs
from .plans import build_program, graph_plans
from .quant import NONE, for_target, load_quant, quant_spec, quantize_, save_quant, weight_bytes
from .runtime import Engine
from .prefill import prefill_name
from .signature import SampledChildren, graph_name
from .target_module import TargetModule, module_state, sliding_window_limit
from .tree import Tree, tree_from_paths


@dataclass
class EngineModules:
    """What an engine captures: the target, the drafter's module (if it has graphs), and the shape of
    sampled children (None for top-k)."""
    target: TargetModule
    draft: nn.Module | None
    sampled: SampledChildren | None

    def by_name(self) -> dict[str, nn.Module | None]:
        return {"target": self.target, "draft": self.draft}

    def states(self) -> dict[str, dict[str, torch.Tensor]]:
        """The tensors each graph takes: the fused step's are the target's and the drafter's as draft.<name>."""
        target, draft = module_state(self.target), module_state(self.draft) if self.draft is not None else {}
        return {"target": target, "draft": draft, "fused": {**target, **{f"draft.{k}": v for k, v in draft.items()}}}


def build_modules(kind, target_hf, weights, entry: dict, tree: Tree, cache_len: int,
                  quant=None) -> EngineModules:
    """The one builder that compile and load share: from the drafter kind, its weights and its manifest
    entry. `quant`: the target's weight quantization (a name or a config), applied once the drafter has taken the float
    tensors it shares with the target (specc/quant.py)."""
    target = TargetModule(target_hf, cache_len, taps=kind.taps(entry, target_hf.config.num_hidden_layers))
    draft = kind.module(weights, target, entry, tree, cache_len)
    quantize_(target, quant)
    return EngineModules(target, draft, SampledChildren.from_entry(entry, target.vocab_size))


def compile(model=None, config: CompileConfig | None = None, **options) -> Path:
    """Compile MODEL (HF dir, .gguf, or None for the embedded default) into an engine directory.
    Give a CompileConfig, or its fields as keyword arguments; `model` overrides config.model."""
    cfg = config if config is not None else CompileConfig(model=model, **options)
    if config is not None and (model is not None or options):
        cfg = replace(config, **({"model": model} if model is not None else {}), **options)
    with compile_clock.clocked() as clock:
        return compile_engine(cfg, clock)


def compile_engine(cfg: CompileConfig, clock: compile_clock.CompileClock) -> Path:
    """The compile of `cfg`, its phases timed on `clock` (the manifest's compile_split)."""
    kind, out = get_kind(cfg.drafter), Path(cfg.output_dir)
    with compile_clock.phase("load"):
        target = load_model(cfg.model, cfg.torch_dtype)
    window = sliding_window_limit(target.model.config)
    if window is not None and cfg.max_len > window:
        raise SpeccError(f"the model uses sliding-window attention of {window} tokens; use --max-len {window} or less.")
    with compile_clock.phase("load"):
        weights = kind.load(cfg, target.model, target.tokenizer)
    tree, report = cfg.parsed_tree, None
    if cfg.measured_tree:
        cfg = replace(cfg, **kind.calibration_options(cfg, weights))
        with compile_clock.phase("tree"):  # calibration's compiles keep clocks of their own
            tree, report, picked = measure_tree(cfg, kind.calibration_depth(cfg, weights))
        if picked is not None and not cfg.adaptive:  # auto compiled the winner on this backend already: keep it
            return install_picked(picked, out, cfg.tree_spec, report)
        if picked is not None:  # an adaptive engine adds the family to the winner's tree: compiled below
            shutil.rmtree(picked.parent, ignore_errors=True)
    if cfg.ngram_branch:  # a hybrid tree: lookup's branch beside the drafter's (measured) tree
        tree = with_ngram_branch(tree, cfg.ngram_branch)
    entry = kind.entry(cfg, weights, tree)
    if cfg.ngram_branch:
        entry["ngram_branch"] = branch_entry(tree, cfg.ngram_branch)
    # A padded call writes past the prompt: room for the smallest chunk's padding (larger chunks pad
    # only where they fit, specc/prefill.py) and for a step's tree.
    cache_len = cfg.max_len + max(cfg.prefill_chunks[-1], tree.size)
    # gguf: the file's own blocks for the products (the float model above is what they decode to)
    quant = for_target(cfg.quant, lambda: gguf_path(target), target.model.config)
    modules = build_modules(kind, target.model, weights, entry, tree, cache_len, quant)
    plans = graph_plans(kind, tree, cfg.prefill_chunks[-1], cache_len, cfg.backend, modules.sampled, cfg.modes,
                        cfg.adaptive, cfg.prefill_chunks[:-1])
    with staging(out) as stage:
        # tensorrt: the graphs are exported on this machine's CPU and built on the GPU machine
        build_device = "cpu" if get_backend(cfg.backend).built_later else cfg.device
        states = move_states(modules.states(), build_device)
        timed = None
        timing = products.applies(cfg, weight_bytes(modules.target), cpu_kernels_used(cfg))
        # one bar over every lowering: the graphs, and before them the products' timing graphs (two per setting)
        bar = tqdm(total=len(plans) + (2 * len(products.timed_plans(plans, products.weight_widths(states["target"])))
                                       if timing else 0),
                   desc=f"compile ({cfg.backend})", unit="graph", disable=not cfg.progress)
        if timing:
            # the few-row products from timing the plain and the step graph both ways (specc/products.py)
            with compile_clock.remainder("products"):
                timed = products.measure_all(plans, modules.by_name(), tree, states["target"], build_device,
                                             cfg.progress, bar)
        with kernel_choice(**products.as_choice(timed)):
            graphs, seconds = build_graphs(cfg, plans, modules, tree, states, stage, build_device, bar)
        bar.close()
        if cfg.dump_ir:  # the shared first stages were copied into each graph's dump
            shutil.rmtree(Path(cfg.dump_ir) / ".base", ignore_errors=True)
        with compile_clock.phase("save"):
            target.model.save_pretrained(stage / "target")
            save_quant(quant, stage / "target")
            if target.tokenizer is not None:
                target.tokenizer.save_pretrained(stage / "target")
            kind.save(weights, stage / "draft", target.model)
        with compile_clock.phase("tensorrt"):
            trt = tensorrt_engines(stage, out, graphs, cfg.progress) if get_backend(cfg.backend).built_later else None
        manifest = make_manifest(stage, cfg, target, modules, entry, tree, report, graphs, cache_len, trt, timed,
                                 seconds)
        with compile_clock.phase("measure"):
            manifest = measure_engine(stage, manifest, cfg)
        manifest = replace(manifest, compile_split=clock.as_json())
        if cfg.progress:
            print(split_line(manifest.compile_split), flush=True)
        write(stage, manifest)  # the one write, once the engine is measured
    return out


def build_graphs(cfg: CompileConfig, plans: list, modules: EngineModules, tree: Tree, states: dict, stage: Path,
                 device: str, bar) -> tuple[dict, dict]:
    """Capture, run the passes on and lower every plan into `stage`, in order (a plan may build on an
    earlier one's program); returns ({name: Graph}, {name: seconds}: the manifest's compile_s)."""
    built, graphs, seconds = {}, {}, {}
    for plan in plans:
        bar.set_postfix_str(plan.name)
        t0 = time.perf_counter()
        with compile_clock.building(plan.name):
            with compile_clock.phase("capture"):
                ep = built[plan.name] = build_program(plan, modules.by_name(), built, tree,
                                                      Path(cfg.dump_ir) if cfg.dump_ir else None)
            args = example_inputs(ep)
            with compile_clock.remainder("lower"):
                lowered = lower_graph(cfg.backend, ep, states[plan.module], stage, plan.name, args, device)
        graphs[plan.name] = Graph.from_json({
            "module": plan.module, "tokens": plan.T, "inputs": [[list(a.shape), str(a.dtype)] for a in args],
            "mode": plan.mode, "passes": plan.passes, **lowered})
        seconds[plan.name] = round(time.perf_counter() - t0, 2)
        bar.update()
        if cfg.on_graph is not None:
            cfg.on_graph(plan.name, seconds[plan.name])
    return graphs, seconds


def split_line(split: dict) -> str:
    """One line: the compile's seconds and its largest phases."""
    phases = sorted(((s, p) for p, s in split["phases"].items() if s >= 0.05), reverse=True)
    hits = f", {split['cache_hits']} of {len(split['graphs'])} graphs from the compile cache" if split["graphs"] else ""
    return (f"compiled in {split['total_s']:.0f} s: " + ", ".join(f"{p} {s:.0f} s" for s, p in phases) + hits)


def gguf_path(target) -> Path:
    """The GGUF file a target was loaded from (CompileConfig allows --quant gguf only for one)."""
    return default_gguf() if target.source == "default" else Path(target.source)


def measure_engine(stage: Path, manifest: Manifest, cfg: CompileConfig) -> Manifest:
    """The post-build stage: what can only be measured on the built engine (opened from `manifest`,
    not from disk), merged into the manifest that is then written once. Each prefill call size's
    milliseconds (several chunks, where the graphs were built where they run); an adaptive engine's
    family timed and its drafter's confidences calibrated (on an engine with those prefill times)."""
    if len(cfg.prefill_chunks) > 1 and not get_backend(cfg.backend).built_later:
        manifest = replace(manifest, prefill_ms=measure_prefill(open_engine(stage, manifest), cfg.progress))
    if cfg.adaptive:
        manifest = replace(manifest, adaptive=measure_family(open_engine(stage, manifest), cfg.progress))
    return manifest


def measure_prefill(engine: Engine, progress: bool) -> dict:
    """The milliseconds of each prefill call size on this machine (1: the one-token graph), for the
    manifest's `prefill_ms`: what the runtime's prefill plan weighs (specc/prefill.py)."""
    mode = "greedy" if "greedy" in engine.modes else engine.modes[0]
    calls = []
    for size in [1] + list(engine.chunks):
        key = graph_name("plain" if size == 1 else prefill_name(size, engine.chunk), mode)
        # a whole chunk at the cache's start (its inputs: tokens, start, valid tokens, then sampling's)
        args = [torch.zeros(s, dtype=d, device=engine.device) for s, d in engine.manifest.graphs[key].input_specs()]
        if size > 1:
            args[2] = torch.tensor(size, device=engine.device)
        calls.append((engine.graphs[key], [a if a.dtype != torch.float32 else a + 1 for a in args]))
    ms = adaptive.time_calls([(fn, tuple(args)) for fn, args in calls], engine.device)
    timed = {str(size): t for size, t in zip([1] + list(engine.chunks), ms)}
    if progress:
        print("prefill: " + ", ".join(f"{k} {'token' if k == '1' else 'tokens'} {v:.1f} ms"
                                      for k, v in timed.items()) + " a call")
    return timed


def measure_family(engine: Engine, progress: bool) -> dict:
    """An adaptive engine's family timed and its drafter's confidences calibrated on the built
    engine (specc/adaptive.py), for its manifest's `adaptive`."""
    m = engine.manifest
    chat = engine.tokenizer is not None and bool(getattr(engine.tokenizer, "chat_template", None))
    texts = [engine.encode(p, chat) for p in calibrate.calibration_inputs(engine.tokenizer, m.target.vocab_size,
                                                                          adaptive.CALIBRATION_PROMPTS)]
    kind = get_kind(m.drafter["kind"])
    # The engine's own drafter: calibration runs the target plainly (ngram) or runs the engine itself.
    return adaptive.measure(engine, engine.drafter, kind.confidence_classes(m.drafter, engine.tree), texts, progress)


def tensorrt_engines(stage: Path, out: Path, graphs: dict, progress: bool) -> dict:
    """Build the TensorRT engines now where TensorRT and a GPU are here; else mark them unbuilt, and say so."""
    from .tensorrt import build_engines, require_tensorrt, unbuilt

    try:
        require_tensorrt()
    except SpeccError as why:
        reason = str(why).split(" (")[0].split(";")[0].rstrip(".")
        print(f"specc: wrote the ONNX graphs but not the TensorRT engines ({reason}): run `specc build {out}` on the "
              f"GPU machine that will run this engine.", file=sys.stderr)
        return unbuilt()
    return build_engines(stage, {name: g.lowered for name, g in graphs.items()}, progress)


def build(path, progress: bool = True) -> Path:
    """`specc build DIR`: build a tensorrt engine directory's TensorRT engines on this machine, in place;
    the manifest is rewritten last (with the plans' hashes), so a failed build leaves the engine as it was."""
    from .tensorrt import build_engines, plan_files

    path = Path(path)
    manifest = read(path)
    if not get_backend(manifest.backend).built_later:
        raise SpeccError(f"{str(path)!r} is a {manifest.backend} engine; `specc build` builds the TensorRT engines "
                         f"of one compiled with --backend tensorrt.")
    verify_files(path, {k: v for k, v in manifest.files.items() if not k.endswith(".plan")})
    lowered = {name: g.lowered for name, g in manifest.graphs.items()}
    plans = [path / p for g in lowered.values() for _, p in plan_files(g)]
    try:
        info = build_engines(path, lowered, progress)
    except BaseException:
        for p in plans:
            if p.name not in manifest.files:
                p.unlink(missing_ok=True)
        raise
    files = dict(manifest.files)
    for p in plans:
        files[str(p.relative_to(path))] = sha256_file(p)
    write(path, replace(manifest, tensorrt=info, files=files))
    return path


def measure_tree(cfg: CompileConfig, depth_limit: int):
    """A tree built from acceptance measured at compile time (`--tree sequoia:BUDGET | auto`): the tree,
    its report, and for auto the engine directory of the winning candidate."""
    def build(tree_file: str, backend: str | None, engine_dir: Path):
        # The calibration engine (backend "eager") only decodes greedily, its prompts through the one
        # prefill chunk its drafter needs; auto's candidates may become the engine.
        calibration = {} if backend is None else {"modes": ("greedy",), "prefill_chunk": cfg.prefill_chunks[-1]}
        compile(config=replace(cfg, tree=tree_file, backend=backend or cfg.backend, output_dir=engine_dir,
                               dump_ir=None, progress=False, adaptive=False, ngram_branch=0,
                               **{"modes": cfg.modes, **calibration}))
        return load(engine_dir)

    out = Path(cfg.output_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = calibrate.staging(out.parent, out.name)
    try:
        tree, report, picked = calibrate.resolve(cfg.tree_spec, cfg.drafter, build, depth_limit, work, cfg.progress)
        if picked is not None:  # out of the work folder before it is removed
            kept = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-")) / "engine"
            picked.rename(kept)
            picked = kept
        return tree, report, picked
    finally:
        calibrate.cleanup(work)


def make_manifest(stage: Path, cfg: CompileConfig, target, modules: EngineModules, entry: dict, tree: Tree,
                  report: dict | None, graphs: dict, cache_len: int, trt: dict | None = None,
                  timed_products: dict | None = None, compile_s: dict | None = None) -> Manifest:
    """specc.json's contents: versions, what was compiled, and the sha256 of every file (never a pickle)."""
    import transformers

    for p in stage.rglob("*"):
        if p.suffix in (".bin", ".pkl", ".pickle", ".pt"):
            raise SpeccError(f"refusing to write pickled file {p.name} into the engine.")
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    files = {str(p.relative_to(stage)): sha256_file(p) for p in sorted(stage.rglob("*")) if p.is_file()}
    hf_cfg = target.model.config
    return Manifest(
        specc_version=__version__, torch_version=torch.__version__, triton_version=triton_version,
        transformers_version=transformers.__version__, platform=platform.machine(),
        target=Target(name=target.name, source=target.source, arch=modules.target.arch,
                      num_layers=hf_cfg.num_hidden_layers, vocab_size=modules.target.vocab_size,
                      eos_token_ids=eos_ids(target.model), config=hf_cfg.to_dict(),
                      weights_sha256=files.get("target/model.safetensors")),
        drafter=entry, tree={"spec": cfg.tree_spec, **tree.to_manifest(), **(report or {})},
        backend=cfg.backend, device=cfg.device, dtype=str(cfg.torch_dtype).replace("torch.", ""),
        modes=list(cfg.modes), max_len=cfg.max_len, prefill_chunk=cfg.prefill_chunks[-1],
        prefill_chunks=list(cfg.prefill_chunks), cache_len=cache_len, graphs=graphs, compile_s=compile_s or {},
        quant=Quant(target=quant_spec(cfg.quant), drafter=NONE, bytes_per_token={
            "target": weight_bytes(modules.target), "drafter": weight_bytes(modules.draft, shared=modules.target)}),
        cpu_kernels=cpu_kernels_used(cfg), products=timed_products,
        adaptive={"sizes": adaptive.family_sizes(tree)} if cfg.adaptive else None, tensorrt=trt, files=files)


def cpu_kernels_used(cfg: CompileConfig) -> bool:
    """Whether an engine's graphs may call the specc_cpu ops: Inductor on CPU, where they built here.
    Every decode graph's attention does (rows_attention, tree_attention's CPU body), and the products of
    float32 activations (rows_linear's body, over float32 or int8 weights) and of GGUF blocks."""
    from specc.kernels.cpu_kernels import load_cpu_kernel

    return get_backend(cfg.backend).native_cpu and torch.device(cfg.device or "cpu").type == "cpu" and load_cpu_kernel()


def eos_ids(model) -> list[int]:
    ids = []
    for cfg in (getattr(model, "generation_config", None), model.config):
        e = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if e is not None:
            ids += list(e) if isinstance(e, (list, tuple)) else [e]
    return sorted(set(int(i) for i in ids))


@contextlib.contextmanager
def staging(out: Path):
    """A fresh directory beside `out` to build the engine in; renamed to `out` only when complete,
    removed on any failure (so no half-written engine is ever left at `out`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        yield stage
        swap_into_place(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def install_picked(picked: Path, out: Path, tree_spec: str, report: dict) -> Path:
    """Move the engine `--tree auto` picked into place, its manifest naming the spec and the report."""
    manifest = read(picked)
    write(picked, replace(manifest, tree={**manifest.tree, "spec": tree_spec, **report}))
    holder = picked.parent
    swap_into_place(picked, out)
    shutil.rmtree(holder, ignore_errors=True)
    return out


def swap_into_place(finished: Path, out: Path) -> None:
    """Rename a finished engine directory to `out`, replacing an older engine there only at the end."""
    if out.exists():
        trash = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(trash)
        finished.rename(out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        finished.rename(out)


def verify_files(path: Path, files: dict) -> None:
    for rel, digest in files.items():
        f = path / rel
        if not f.is_file():
            raise SpeccError(f"engine file {rel} is missing from {str(path)!r}; compile the engine again.")
        if sha256_file(f) != digest:
            raise SpeccError(f"engine file {rel} does not match its recorded sha256, so the engine was modified "
                             f"or damaged; compile it again.")


def load(path, check_hashes: bool = True, device: str | None = None, cuda_graphs: bool = True) -> Engine:
    """Open an engine directory: validate manifest, hashes, versions and shapes, then build the runtime.
    `device`: where an eager engine runs (default: the device it was compiled for); an inductor
    engine runs only on the device its graphs were compiled for. `cuda_graphs`: on CUDA, capture
    the decode calls once and replay them (specc/cuda_graphs.py); ignored on other devices."""
    path = Path(path)
    manifest = read(path)
    if check_hashes:
        verify_files(path, manifest.files)
    return open_engine(path, manifest, device, cuda_graphs)


def open_engine(path: Path, manifest: Manifest, device: str | None = None, cuda_graphs: bool = True) -> Engine:
    """The engine in `path` as `manifest` describes it (read from its specc.json, or, while it is being
    built, the manifest about to be written)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    backend = get_backend(manifest.backend)
    if backend.check_loadable is not None:  # tensorrt: its engines built
        backend.check_loadable(manifest, path)
    device = run_device(manifest, device)
    # onnxruntime and TensorRT run their own launches: CUDA-graph capture is for the torch backends
    cuda_graphs = cuda_graphs and torch.device(device).type == "cuda" and backend.cuda_graphs
    dtype = parse_dtype(manifest.dtype)
    model = AutoModelForCausalLM.from_pretrained(path / "target", dtype=dtype).eval().requires_grad_(False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path / "target")
    except Exception:
        tokenizer = None
    entry, tree = manifest.drafter, tree_from_paths(manifest.tree["paths"])
    kind, cache_len, chunk = get_kind(entry["kind"]), manifest.cache_len, manifest.prefill_chunk
    weights = kind.load_saved(path / "draft", entry, model, dtype)
    quant = load_quant(manifest.quant.target, path / "target")
    if manifest.cpu_kernels:
        from specc.kernels.cpu_kernels import load_cpu_kernel, load_error

        if not load_cpu_kernel():
            raise SpeccError(f"this engine's graphs call specc's C++ CPU products, which could not be built here "
                             f"({load_error() or 'turned off by SPECC_CPU_KERNELS=0'}); compile the engine on this "
                             f"machine.")
    modules = build_modules(kind, model, weights, entry, tree, cache_len, quant)
    plans = {p.name: p for p in graph_plans(kind, tree, chunk, cache_len, manifest.backend, modules.sampled,
                                            manifest.modes, manifest.adaptive is not None,
                                            manifest.prefill_chunks[:-1])}
    states = move_states(modules.states(), device)
    graphs = {}
    for name, g in manifest.graphs.items():
        if name not in plans or plans[name].T != g.tokens:
            raise SpeccError(f"graph {name} in the manifest does not match this engine's tree and drafter; "
                             f"compile the engine again.")
        graphs[name] = checked(open_graph(manifest.backend, path, g.lowered, states[g.module], device, cuda_graphs),
                               name, g.inputs)
    drafter = kind.runtime(graphs, tree, entry, chunk, device, weights)
    return Engine(manifest, graphs, tokenizer, drafter, tree, path=path, device=device, cuda_graphs=cuda_graphs)


def run_device(manifest: Manifest, device: str | None) -> str:
    """Where an engine runs: its graphs' versions and device must match this machine (inductor)."""
    backend, compiled_for = get_backend(manifest.backend), manifest.device
    if backend.locked and manifest.torch_version != torch.__version__:
        raise SpeccError(f"the engine's graphs were built with torch {manifest.torch_version} but this is torch "
                         f"{torch.__version__}; compile the engine again.")
    device = check_device(device or compiled_for)
    if backend.locked and device != check_device(compiled_for):
        raise SpeccError(f"this engine's graphs were compiled for {compiled_for}; run it there, or compile it again "
                         f"with --device {device}.")
    return device


def checked(graph, name: str, inputs: list):
    """Compiled graphs do not check shapes (a wrong one reads out of bounds): check them on every call."""
    expected = [(tuple(s), d) for s, d in inputs]

    def call(*args):
        for i, (a, (shape, dt)) in enumerate(zip(args, expected)):
            if tuple(a.shape) != shape or str(a.dtype) != dt:
                raise SpeccError(f"graph {name} input {i} has shape {tuple(a.shape)} {a.dtype}, expected {shape} {dt}.")
        return graph(*args)

    call.inner = graph  # the backend's callable (an EagerGraph's .module is the program, for inspection)
    return call
