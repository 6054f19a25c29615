"""specc.compile and specc.load: the whole pipeline, top to bottom.

    load target (+ drafter) -> capture each graph -> passes -> lower (eager | inductor)
    -> artifact directory (manifest + safetensors + graphs) -> Engine
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from . import __version__
from .backends import (EagerGraph, InductorGraph, check_backend, check_device, compile_inductor, move_states,
                       on_device)
from .capture import TargetModule, capture, causal_mask, sliding_window_limit
from .dflash import DFlashStep, check_fits, load_dflash, save_dflash
from .drafters import DraftModelDrafter, HiddenStateDrafter, NgramDrafter, check_drafter
from .errors import SpeccError
from .models import load_model, parse_dtype, sha256_file
from .mtp import MTPStep, check_engine_heads, load_mtp, save_deepseek_v3
from .pipeline import Pipeline, example_inputs
from . import calibrate
from .runtime import Engine
from .shipped import shipped_drafter
from .tree import Tree, chain, parse_tree, tree_from_paths
from specc.passes.compact_kv import compact_kv
from specc.passes.fuse_step import fuse_step
from specc.passes.matvec import matvec
from specc.passes.sample_last import sample_last
from specc.passes.tree_attention import tree_attention
from specc.passes.tree_inputs import tree_inputs
from specc.passes.verify import verify

FORMAT_VERSION = 1
MANIFEST = "specc.json"
# mtp chain:1 and dflash chain:3 (block 4): the fastest measured with the shipped SmolLM2 drafters
# (BENCHMARKS.md, 2026-11-30).
DEFAULT_TREE = {"none": "chain:0", "ngram": "chain:4", "draft-model": "chain:4", "dflash": "chain:3",
                "mtp": "chain:1"}


@dataclass(frozen=True)
class SampledChildren:
    """An engine whose drafter samples each node's children i.i.d. (`--children sampled`): its
    drafter graphs return q [q_rows, vocab] beside the drafts and take q_rows * width uniforms; its
    step graph takes that q and verifies with the min(1, p/q) rule."""
    q_rows: int  # one drafter distribution per depth (MTP) or block position (DFlash)
    vocab: int
    width: int  # draws per distribution: the tree's widest rank + 1

    @property
    def uniforms(self) -> int:
        return self.q_rows * self.width


@dataclass
class GraphPlan:
    name: str
    module: str  # "target" | "draft" | "dflash" | "mtp" | "fused": whose tensors the graph runs on
    T: int  # tokens per call
    pipeline: Pipeline
    fuse: tuple[str, str, str] | None = None  # (verify graph, drafter graph, drafter kind) for fuse_step
    sampled: SampledChildren | None = None  # for fuse_step: the extra inputs and outputs


def fused_state(target_state: dict, draft_state: dict) -> dict:
    """The tensors of a fused step graph: the target's under their own names, the drafter's as draft.<name>."""
    return {**target_state, **{f"draft.{k}": v for k, v in draft_state.items()}}


def graph_plans(tree: Tree, drafter: str, chunk: int, cache_len: int, backend: str = "eager",
                sampled: SampledChildren | None = None) -> list[GraphPlan]:
    """Which graphs an engine holds, and the passes that make each one from the captured model."""
    def start() -> Pipeline:
        # Inductor only: it turns few-row products into streaming reductions; eager would materialise them.
        return Pipeline().add("matvec", matvec) if backend == "inductor" else Pipeline()

    def decode(t: Tree, q: SampledChildren | None = None) -> Pipeline:
        # tree_attention: the specc op runs SDPA itself on CPU and the Triton kernel on CUDA.
        q_shape = (q.q_rows, q.vocab) if q else (None, None)
        return (start().add("tree_attention", tree_attention)
                .add("tree_inputs", lambda ep: tree_inputs(ep, t, cache_len))
                .add("verify", lambda ep: verify(ep, t, *q_shape)).add("compact_kv", lambda ep: compact_kv(ep, t)))

    prefill = (start().add("tree_inputs", lambda ep: tree_inputs(ep, chain(chunk - 1), cache_len))
               .add("sample_last", sample_last))
    plans = [GraphPlan("prefill", "target", chunk, prefill), GraphPlan("plain", "target", 1, decode(chain(0)))]
    if drafter != "none":
        plans.append(GraphPlan("step", "target", tree.size, decode(tree, sampled)))
    if drafter == "draft-model":
        plans.append(GraphPlan("draft_prefill", "draft", chunk, prefill))
        plans.append(GraphPlan("draft_step", "draft", 1, decode(chain(0))))
    if drafter == "dflash":
        # Context rows of a prefill chunk, and of one step (at most the tree's size are committed).
        plans.append(GraphPlan("dflash_prefill", "dflash", chunk, start()))
        plans.append(GraphPlan("dflash_step", "dflash", tree.size, start()))
    if drafter == "mtp":
        # Hidden rows of a prefill chunk, and of one step, as for dflash.
        plans.append(GraphPlan("mtp_prefill", "mtp", chunk, start()))
        plans.append(GraphPlan("mtp_step", "mtp", tree.size, start()))
    if drafter in ("dflash", "mtp"):
        plans.append(GraphPlan("fused", "fused", tree.size, Pipeline(), fuse=("step", f"{drafter}_step", drafter),
                               sampled=sampled))
    return plans


def build_program(plan: GraphPlan, module, dump_dir: Path | None = None, built: dict | None = None,
                  tree: Tree | None = None):
    """Capture `module` and run the plan's passes; a fused plan instead joins two graphs already `built`."""
    T = plan.T
    if plan.fuse is not None:
        verify_name, draft_name, kind = plan.fuse
        q = plan.sampled
        ep = fuse_step(built[verify_name], built[draft_name], kind, tree, q and (q.q_rows, q.vocab, q.uniforms))
        return plan.pipeline.run(ep, dump_dir=dump_dir, label=plan.name)
    if isinstance(module, DFlashStep):  # (taps [R, L*H], ctx_start, n_ctx, anchor)
        width = module.drafter.fc.in_features
        args = (torch.zeros(T, width, dtype=module.drafter.fc.weight.dtype), torch.tensor(0), torch.tensor(T),
                torch.tensor(0))
    elif isinstance(module, MTPStep):  # (hidden [R, H], next_tokens [R], ctx_start, n_ctx)
        w = module.eh_proj.weight
        args = (torch.zeros(T, w.shape[0], dtype=w.dtype), torch.zeros(T, dtype=torch.int64), torch.tensor(0),
                torch.tensor(T))
    else:
        args = (torch.zeros(1, T, dtype=torch.int64), torch.arange(T).view(1, T), torch.arange(T),
                causal_mask(T, 0, module.cache_len))
    if getattr(module, "sampled", False):  # sampled children: (temperature, top_p, uniforms) too
        args += (torch.tensor(0.0), torch.tensor(1.0), torch.zeros(module.q_rows * module.width))
    ep = capture(module, args)
    return plan.pipeline.run(ep, dump_dir=dump_dir, label=plan.name)


def _drafter_model(drafter: str, drafter_path, drafter_layers, target, dtype):
    """The draft model's HF module, and its manifest entry."""
    if drafter_path is None:
        n = drafter_layers or max(1, target.model.config.num_hidden_layers // 4)
        return target.model, n, {"source": "target", "layers": n}
    d = load_model(drafter_path, dtype, with_tokenizer=False)
    tv, dv = target.model.lm_head.out_features, d.model.lm_head.out_features
    if tv != dv:
        raise SpeccError(f"the drafter's vocabulary ({dv} tokens) differs from the target's ({tv} tokens); "
                         f"a draft model must share the target's tokenizer.")
    n = drafter_layers or d.model.config.num_hidden_layers
    return d.model, n, {"source": "model", "layers": n, "name": d.name}


def _mtp_step(heads, target_module: TargetModule, cache_len: int, tree: Tree, sampled: bool = False) -> MTPStep:
    t = target_module
    return MTPStep(heads, t.embed_tokens, t.norm, t.w_head, t.rotary_emb, cache_len, tree.max_depth, tree, sampled)


def _sampled_children(draft_module, vocab: int) -> SampledChildren | None:
    if not getattr(draft_module, "sampled", False):
        return None
    return SampledChildren(draft_module.q_rows, vocab, draft_module.width)


CHILDREN = ("topk", "sampled")


def _target_taps(entry: dict, num_layers: int) -> tuple[int, ...]:
    """The target taps a drafter's manifest entry implies."""
    if entry["kind"] == "mtp":
        return (num_layers,)
    return tuple(entry.get("target_layer_ids", ()))


def _eos_ids(model) -> list[int]:
    ids = []
    for cfg in (getattr(model, "generation_config", None), model.config):
        e = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if e is not None:
            ids += list(e) if isinstance(e, (list, tuple)) else [e]
    return sorted(set(int(i) for i in ids))


def compile(model=None, drafter: str = "none", tree: str | None = None, backend: str = "eager",
            output_dir=None, drafter_path=None, drafter_layers: int | None = None, dtype: str = "float32",
            max_len: int = 1024, prefill_chunk: int = 32, dump_ir=None, progress: bool = True,
            block_size: int | None = None, device: str = "cpu", children: str = "topk") -> Path:
    """Compile MODEL (HF dir, .gguf, or None for the embedded default) into an engine directory that
    runs on `device` (inductor graphs are compiled for it; an eager engine loads anywhere)."""
    # 1. Check every argument before any slow work.
    if output_dir is None:
        raise SpeccError("an output directory is required (-o DIR).")
    out = Path(output_dir)
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / MANIFEST).is_file())):
        raise SpeccError(f"output {str(out)!r} exists and is not a specc engine directory; refusing to overwrite it.")
    check_backend(backend)
    check_drafter(drafter)
    device = check_device(device)
    if children not in CHILDREN:
        raise SpeccError(f"--children {children!r} is unknown; use topk or sampled.")
    if children == "sampled" and drafter not in ("dflash", "mtp"):
        raise SpeccError("--children sampled draws drafts from the drafter's distribution over tokens; use it with "
                         "--drafter dflash or mtp.")
    torch_dtype = parse_dtype(dtype)
    if not 2 <= max_len <= 1 << 20:
        raise SpeccError(f"--max-len {max_len} is out of range; use a length from 2 to 1048576.")
    if not 1 <= prefill_chunk <= 4096:
        raise SpeccError(f"--prefill-chunk {prefill_chunk} is out of range; use 1 to 4096.")
    tree_spec = tree or DEFAULT_TREE.get(drafter, "chain:4")
    measured = calibrate.is_measured(tree_spec)
    if measured:
        if tree_spec.strip() != "auto":
            parse_tree(tree_spec, acceptance=[[1.0]])  # the form and budget; the tree itself is measured below
        if drafter not in ("ngram", "mtp", "dflash"):
            raise SpeccError(f"--tree {tree_spec} is built from how often a drafter's ranked candidates are "
                             f"accepted; use it with --drafter ngram, mtp or dflash.")
    tr = chain(1) if measured else parse_tree(tree_spec)  # a measured tree replaces this before any use
    if drafter == "none" and tr.size > 1:
        raise SpeccError(f"--tree {tree_spec} needs a drafter to fill it; add --drafter ngram or draft-model.")
    if drafter != "none" and tr.size < 2:
        raise SpeccError(f"--tree {tree_spec} has no draft tokens; use chain:K with K >= 1.")
    if drafter not in ("draft-model", "dflash", "mtp") and drafter_path is not None:
        raise SpeccError("--drafter-path only applies to --drafter draft-model, dflash or mtp.")
    if drafter != "draft-model" and drafter_layers is not None:
        raise SpeccError("--drafter-layers only applies to --drafter draft-model.")
    if drafter == "draft-model" and not tr.is_chain:
        raise SpeccError(f"the {drafter} drafter proposes a chain in this version; use --tree chain:K.")
    if drafter in ("dflash", "mtp") and drafter_path is None and model is None:
        drafter_path = shipped_drafter(drafter)  # trained for the embedded SmolLM2 and shipped with specc
    dflash = None
    if drafter == "dflash":
        if drafter_path is None:
            raise SpeccError("--drafter dflash needs --drafter-path DIR, a DFlash drafter directory "
                             "(config.json + safetensors), e.g. one written by `specc train`.")
        dflash = load_dflash(drafter_path, torch_dtype)
        trained = dflash.config.block_size
        if block_size is not None and not 2 <= block_size <= trained:
            raise SpeccError(f"--block-size {block_size} is out of range: this DFlash drafter was trained on blocks "
                             f"of {trained} and runs on blocks of 2 to {trained}.")
    elif block_size is not None:
        raise SpeccError("--block-size only applies to --drafter dflash.")
    if drafter == "mtp" and drafter_path is None:
        raise SpeccError("--drafter mtp needs --drafter-path DIR, an MTP checkpoint in the DeepSeek-V3 or "
                         "Qwen3-Next layout, e.g. one written by `specc train --drafter mtp`.")
    tree_report = None
    if measured:
        def build(tree_file, backend_, engine_dir):
            compile(model, drafter, tree_file, backend_ or backend, engine_dir, drafter_path, drafter_layers, dtype,
                    max_len, prefill_chunk, None, False, block_size, device, children)
            return load(engine_dir)

        limit = calibrate.max_depth(drafter, (block_size or dflash.config.block_size) if dflash else None)
        out.parent.mkdir(parents=True, exist_ok=True)
        work = calibrate.staging(out.parent, out.name)
        try:
            tr, tree_report, picked = calibrate.resolve(tree_spec, drafter, build, limit, work, progress)
            if picked is not None:  # auto compiled the winner on this backend already: keep that engine
                return _install_picked(picked, out, tree_spec, tree_report)
        finally:
            calibrate.cleanup(work)
    if drafter == "dflash":
        # The shortest block that reaches the tree's depth: drafting cost grows with the block.
        block_size = min(trained, max(2, tr.max_depth + 1)) if block_size is None else block_size
        if tr.max_depth + 1 > block_size:
            raise SpeccError(f"--tree {tree_spec} is {tr.max_depth} drafts deep, but the DFlash drafter's block of "
                             f"{block_size} gives {block_size - 1}.")

    # 2. Load the models.
    target = load_model(model, torch_dtype)
    cfg = target.model.config
    window = sliding_window_limit(cfg)
    if window is not None and max_len > window:
        raise SpeccError(f"the model uses sliding-window attention of {window} tokens; use --max-len {window} or less.")
    cache_len = max_len + max(prefill_chunk, tr.size)
    taps = ()
    if dflash is not None:
        check_fits(dflash.config, cfg)
        taps = tuple(dflash.config.target_layer_ids)
    heads = None
    if drafter == "mtp":
        heads = load_mtp(drafter_path, target.model)  # refuses a checkpoint of another hidden size
        check_engine_heads(heads)
        taps = (cfg.num_hidden_layers,)  # the hidden after the final norm
    target_module = TargetModule(target.model, cache_len, taps=taps)
    draft_module, draft_entry = None, {"kind": drafter}
    if drafter == "draft-model":
        hf, n, info = _drafter_model(drafter, drafter_path, drafter_layers, target, torch_dtype)
        draft_module = TargetModule(hf, cache_len, n_layers=n,
                                    share=target_module if info["source"] == "target" else None)
        draft_entry.update(info)
        draft_hf = hf if info["source"] == "model" else None
    elif drafter == "dflash":
        draft_module = DFlashStep(dflash, target_module.embed_tokens, target_module.w_head, cache_len, block_size, tr,
                                  sampled=children == "sampled")
        c = dflash.config
        draft_entry.update({"block_size": block_size, "trained_block_size": c.block_size, "num_layers": c.num_layers,
                            "target_layer_ids": c.target_layer_ids, "mask_token_id": c.mask_token_id})
    elif drafter == "mtp":
        draft_module = _mtp_step(heads, target_module, cache_len, tr, sampled=children == "sampled")
        c = heads.config
        draft_entry.update({"depth": tr.max_depth, "trained_depth": c.depth, "num_modules": c.num_modules,
                            "order": c.order, "feedback": c.feedback, "has_final_norm": c.has_final_norm})
    elif drafter == "ngram":
        # min_ngram 3 measured best of 1..3 on MT-Bench and HumanEval (BENCHMARKS.md).
        draft_entry.update({"max_ngram": 4, "min_ngram": 3})

    # 3. Capture, run the passes, lower; everything goes to a staging directory first.
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        sampled = _sampled_children(draft_module, target_module.vocab_size)
        if drafter in ("dflash", "mtp"):
            draft_entry["children"] = children
        if sampled is not None:
            draft_entry.update({"q_rows": sampled.q_rows, "width": sampled.width})
        plans = graph_plans(tr, drafter, prefill_chunk, cache_len, backend, sampled)
        graphs, built = {}, {}
        if backend == "inductor":  # the tensors each graph takes, on the device its code is compiled for
            states = {"target": target_module.state(), "draft": draft_module.state() if draft_module else {}}
            states["fused"] = fused_state(states["target"], states["draft"])
            states = move_states(states, device)
        bar = tqdm(plans, desc=f"compile ({backend})", unit="graph", disable=not progress)
        for plan in bar:
            bar.set_postfix_str(plan.name)
            module = target_module if plan.module == "target" else draft_module
            ep = built[plan.name] = build_program(plan, module, Path(dump_ir) if dump_ir else None, built, tr)
            args = example_inputs(ep)
            passes = ([f"fuse_step({plan.fuse[0]}, {plan.fuse[1]})"] if plan.fuse else []) + plan.pipeline.names
            entry = {"module": plan.module, "tokens": plan.T, "passes": passes,
                     "inputs": [[list(a.shape), str(a.dtype)] for a in args], "file": None}
            if backend == "inductor":
                (stage / "graphs").mkdir(exist_ok=True)
                rel = f"graphs/{plan.name}.pt2"
                state = states["fused" if plan.fuse else "target" if plan.module == "target" else "draft"]
                entry["state_keys"] = compile_inductor(on_device(ep, device), state, stage / rel,
                                                       tuple(a.to(device) for a in args))
                entry["file"] = rel
            graphs[plan.name] = entry
        bar.close()

        # 4. Weights (safetensors) and tokenizer.
        target.model.save_pretrained(stage / "target")
        if target.tokenizer is not None:
            target.tokenizer.save_pretrained(stage / "target")
        if drafter == "draft-model" and draft_hf is not None:
            draft_hf.save_pretrained(stage / "draft")
        if dflash is not None:
            save_dflash(dflash, stage / "draft")
        if heads is not None:  # the engine holds the target's head and embedding: no copies
            save_deepseek_v3(heads, stage / "draft", target.model, shared_copies=False)
        for p in stage.rglob("*"):
            if p.suffix in (".bin", ".pkl", ".pickle", ".pt"):
                raise SpeccError(f"refusing to write pickled file {p.name} into the engine.")

        # 5. Manifest: versions, what was compiled, and the sha256 of every file.
        try:
            import triton
            triton_version = triton.__version__
        except ImportError:
            triton_version = None
        import transformers

        files = {str(p.relative_to(stage)): sha256_file(p) for p in sorted(stage.rglob("*")) if p.is_file()}
        manifest = {
            "format_version": FORMAT_VERSION, "specc_version": __version__, "torch_version": torch.__version__,
            "triton_version": triton_version, "transformers_version": transformers.__version__,
            "platform": platform.machine(),
            "target": {"name": target.name, "source": target.source, "arch": target_module.arch,
                       "num_layers": cfg.num_hidden_layers, "vocab_size": target_module.vocab_size,
                       "eos_token_ids": _eos_ids(target.model), "config": cfg.to_dict(),
                       "weights_sha256": files.get("target/model.safetensors")},
            "drafter": draft_entry, "tree": {"spec": tree_spec, **tr.to_manifest(), **(tree_report or {})},
            "backend": backend, "device": device, "dtype": str(torch_dtype).replace("torch.", ""), "max_len": max_len,
            "prefill_chunk": prefill_chunk, "cache_len": cache_len, "graphs": graphs, "files": files,
        }
        (stage / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))

        # 6. Swap the finished directory into place.
        _swap_into_place(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return out


def _install_picked(picked: Path, out: Path, tree_spec: str, report: dict) -> Path:
    """Move the engine `--tree auto` picked into place, its manifest naming the spec and the report."""
    manifest = json.loads((picked / MANIFEST).read_text())
    manifest["tree"].update({"spec": tree_spec, **report})
    (picked / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
    _swap_into_place(picked, out)
    return out


def _swap_into_place(finished: Path, out: Path) -> None:
    """Rename a finished engine directory to `out`, replacing an older engine there only at the end."""
    if out.exists():
        trash = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(trash)
        finished.rename(out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        finished.rename(out)


def read_manifest(path) -> dict:
    path = Path(path)
    mf = path / MANIFEST
    if not mf.is_file():
        raise SpeccError(f"{str(path)!r} is not a specc engine directory (no {MANIFEST}); create one with `specc compile`.")
    try:
        manifest = json.loads(mf.read_text())
    except ValueError:
        raise SpeccError(f"{mf} is not valid JSON; compile the engine again.") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise SpeccError(f"engine format {manifest.get('format_version')} is not the format this specc reads "
                         f"({FORMAT_VERSION}); compile the engine again.")
    return manifest


def verify_files(path: Path, manifest: dict) -> None:
    for rel, digest in manifest["files"].items():
        f = path / rel
        if not f.is_file():
            raise SpeccError(f"engine file {rel} is missing from {str(path)!r}; compile the engine again.")
        if sha256_file(f) != digest:
            raise SpeccError(f"engine file {rel} does not match its recorded sha256, so the engine was modified "
                             f"or damaged; compile it again.")


def load(path, check_hashes: bool = True, device: str | None = None) -> Engine:
    """Open an engine directory: validate manifest, hashes, versions and shapes, then build the runtime.
    `device`: where an eager engine runs (default: the device it was compiled for); an inductor
    engine runs only on the device its graphs were compiled for."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    manifest = read_manifest(path)
    if check_hashes:
        verify_files(path, manifest)
    backend = manifest["backend"]
    if backend == "inductor" and manifest["torch_version"] != torch.__version__:
        raise SpeccError(f"the engine's graphs were built with torch {manifest['torch_version']} but this is torch "
                         f"{torch.__version__}; compile the engine again.")
    compiled_for = manifest.get("device", "cpu")
    device = check_device(device or compiled_for)
    if backend == "inductor" and device != check_device(compiled_for):
        raise SpeccError(f"this engine's graphs were compiled for {compiled_for}; run it there, or compile it again "
                         f"with --device {device}.")
    dtype = parse_dtype(manifest["dtype"])
    model = AutoModelForCausalLM.from_pretrained(path / "target", dtype=dtype).eval().requires_grad_(False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path / "target")
    except Exception:
        tokenizer = None
    cache_len, chunk = manifest["cache_len"], manifest["prefill_chunk"]
    tr = tree_from_paths(manifest["tree"]["paths"])
    dr = manifest["drafter"]
    modules = {"target": TargetModule(model, cache_len, taps=_target_taps(dr, model.config.num_hidden_layers))}
    if dr["kind"] == "draft-model":
        hf = model if dr["source"] == "target" else AutoModelForCausalLM.from_pretrained(
            path / "draft", dtype=dtype).eval().requires_grad_(False)
        modules["draft"] = TargetModule(hf, cache_len, n_layers=dr["layers"],
                                        share=modules["target"] if dr["source"] == "target" else None)
    if dr["kind"] == "dflash":
        dflash = load_dflash(path / "draft", dtype)
        modules["dflash"] = DFlashStep(dflash, modules["target"].embed_tokens, modules["target"].w_head, cache_len,
                                       dr["block_size"], tr, sampled=dr.get("children") == "sampled")
    if dr["kind"] == "mtp":
        modules["mtp"] = _mtp_step(load_mtp(path / "draft", model), modules["target"], cache_len, tr,
                                   sampled=dr.get("children") == "sampled")
    sampled = _sampled_children(modules.get(dr["kind"]), modules["target"].vocab_size)
    states = {k: m.state() for k, m in modules.items()}
    if dr["kind"] in ("dflash", "mtp"):
        states["fused"] = fused_state(states["target"], states[dr["kind"]])
    states = move_states(states, device)
    graphs, built = {}, {}
    plans = {p.name: p for p in graph_plans(tr, dr["kind"], chunk, cache_len, backend, sampled)}
    for name, entry in manifest["graphs"].items():
        if name not in plans or plans[name].T != entry["tokens"]:
            raise SpeccError(f"graph {name} in the manifest does not match this engine's tree and drafter; "
                             f"compile the engine again.")
        state = states[entry["module"]]
        if backend == "eager":
            built[name] = build_program(plans[name], modules.get(entry["module"]), None, built, tr)
            graphs[name] = EagerGraph(on_device(built[name], device), state)
        else:
            graphs[name] = InductorGraph(path / entry["file"], state, entry["state_keys"])
        graphs[name] = _checked(graphs[name], name, entry["inputs"])
    drafter = None
    if dr["kind"] == "ngram":
        drafter = NgramDrafter(tr, dr.get("max_ngram", 4), dr.get("min_ngram", 3))
    elif dr["kind"] == "draft-model":
        drafter = DraftModelDrafter(tr, graphs["draft_prefill"], graphs["draft_step"], chunk, device)
    elif dr["kind"] in ("dflash", "mtp"):
        k = dr["kind"]
        drafter = HiddenStateDrafter(k, tr, graphs[f"{k}_prefill"], graphs[f"{k}_step"], chunk, device,
                                     sampled.uniforms if sampled else 0)
    return Engine(manifest, graphs, tokenizer, drafter, tr, path=path, device=device)


def _checked(graph, name: str, inputs: list):
    """Compiled graphs do not check shapes (a wrong one reads out of bounds): check them on every call."""
    expected = [(tuple(s), d) for s, d in inputs]

    def call(*args):
        for i, (a, (shape, dt)) in enumerate(zip(args, expected)):
            if tuple(a.shape) != shape or str(a.dtype) != dt:
                raise SpeccError(f"graph {name} input {i} has shape {tuple(a.shape)} {a.dtype}, expected {shape} {dt}.")
        return graph(*args)

    return call
