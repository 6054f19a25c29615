"""The few-row products of a CPU float32 engine, chosen by timing both kinds on the compiling machine.

rows_linear (kernels/rows_linear.py) computes a decode step's few-row products either with the C++
product (kernels/dense_cpu.cpp) or with Inductor's streaming reduction, and which is faster depends
on the CPU: at one row the C++ product won on one AVX-512 EPYC (12.9 against 16.2 ms per plain step)
and lost on a Zen 4 one (22.4 against 14.1 ms). So `specc compile` lowers the plain graph (one row)
and the whole tree's step graph (its products of many rows: more input rows than the reduction keeps
in cache, rows_linear.many_rows; the others keep the reduction) both ways, times each pair side by
side and lowers every graph under the faster. The manifest's `products` holds each choice with both
times (and, for many rows, from how many rows that is at each weight width). The plain graph matters
most: every speedup is measured against it and an adaptive engine falls back to it. A choice is kept
in the compile cache's folder (timings_dir), keyed by the machine, torch, the kernels' code and the
graph, so compiling the same target again on the same machine lowers each graph once. Targets too
small for the products to show (below MIN_TIMED_BYTES of weights read per token, e.g. the tests'
tiny models) keep the rule.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

from specc.kernels.rows_linear import kernel_choice, many_rows

from . import compile_clock
from .adaptive import time_calls
from .backends import InductorGraph, get_backend, lower_graph
from .models import cache_dir
from .pipeline import example_inputs
from .plans import build_program

# Below this many bytes of weights per token a step's fixed costs hide the products: the rule applies.
MIN_TIMED_BYTES = 32 << 20
CHOICES = {"cpp": True, "reduction": False}


def applies(cfg, bytes_per_token: int, cpu_kernels: bool) -> bool:
    """Whether to time the products: Inductor on CPU, float32 weights, the C++ product built here,
    and a target that reads at least MIN_TIMED_BYTES of weights per token."""
    return cpu_kernels and get_backend(cfg.backend).native_cpu and torch.device(cfg.device or "cpu").type == "cpu" \
        and cfg.torch_dtype == torch.float32 and cfg.quant is None and bytes_per_token >= MIN_TIMED_BYTES


def timed_plans(plans: list, widths: set[int]) -> dict:
    """What to time: {"one_row": the first plain graph, "many_rows": the first whole-tree step graph
    when some product of it, over weights of these input widths, has many rows}. The many-rows choice
    timed there applies to every product with many rows, also at widths or row counts that graph does
    not have (a 5-node tree over SmolLM2 times only its 1536-wide rows; the 576-wide rows of other
    graphs with 7 or more, and a drafter's own products, follow the same choice)."""
    out = {"one_row": next(p for p in plans if p.name.startswith("plain"))}
    step = next((p for p in plans if p.module == "target" and p.name.startswith("step_")), None)
    if step is not None and any(many_rows(step.T, k) for k in widths):
        out["many_rows"] = step
    return out


def weight_widths(state: dict[str, torch.Tensor]) -> set[int]:
    """The input widths of the target's float matrices (what its products' rows are as wide as)."""
    return {t.shape[1] for t in state.values() if t.dim() == 2 and t.is_floating_point()}


def rows_from(widths: set[int], most: int) -> dict[int, int]:
    """{input width: the fewest rows, up to `most`, that count as many there} (for the manifest)."""
    firsts = {k: next((r for r in range(2, most + 1) if many_rows(r, k)), None) for k in sorted(widths)}
    return {k: r for k, r in firsts.items() if r is not None}


def measure(setting: str, plan, modules: dict, tree, state: dict[str, torch.Tensor], device: str,
            chosen: dict | None = None, bar=None) -> dict:
    """Lower `plan` with the C++ product and with the reduction for `setting` ("one_row" or
    "many_rows"; the settings already `chosen` as given), time both (interleaved rounds, medians) and
    return {"product": the faster, "graph": the plan's name, "ms": both}. The program is captured
    afresh (the main loop captures it again: a few seconds, and --dump-ir's files stay whole)."""
    with compile_clock.phase("capture"):
        ep = build_program(plan, modules, {}, tree)
    args = example_inputs(ep)
    # ids and positions as zeros, temperature, top-p and uniforms as ones (as adaptive.time_family)
    args = tuple(torch.ones_like(a) if a.is_floating_point() else a for a in args)
    calls = []
    with tempfile.TemporaryDirectory(prefix="specc-products-") as tmp:
        for name, on in CHOICES.items():
            if bar is not None:
                bar.set_postfix_str(f"{plan.name}, timing {name} products")
            with kernel_choice(**{**(chosen or {}), setting: on}), \
                    compile_clock.building(f"{plan.name} ({name} products, timed)"):
                with compile_clock.remainder("lower"):
                    entry = lower_graph("inductor", ep, state, Path(tmp), f"{plan.name}_{name}", args, device)
            calls.append((InductorGraph(Path(tmp) / entry["file"], state, entry["state_keys"]), args))
            if bar is not None:
                bar.update()
        ms = time_calls(calls, device)
    times = dict(zip(CHOICES, ms))
    out = {"product": min(times, key=times.get), "graph": plan.name, "ms": times}
    if setting == "many_rows":  # what "many" meant for this target: the rule of rows_linear.many_rows
        out["from_rows"] = {str(k): r for k, r in rows_from(weight_widths(state), plan.T).items()}
    return out


def timing_key(setting: str, plan, tree, state: dict[str, torch.Tensor], chosen: dict) -> str:
    """What a timed choice depends on: this machine (CPU, instruction sets, threads), torch and the
    kernels' code, the graph timed (its name and rows, the tree, every weight's name and shape) and
    the choices made before it. Not the weights' values: the products take as long whatever they hold."""
    from .backends import kernel_sources
    from .benchfile import cpu_model

    h = hashlib.sha256()
    for part in (setting, plan.name, str(plan.T), json.dumps(tree.parents), json.dumps(sorted(chosen.items())),
                 cpu_model(), str(os.cpu_count()), str(torch.get_num_threads()), torch.__version__, kernel_sources(),
                 json.dumps(sorted((k, list(v.shape), str(v.dtype)) for k, v in state.items()))):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:32]


def timings_dir() -> Path:
    """Where a machine keeps the choices it timed (the compile cache's folder): a second compile of
    the same target, tree and graph takes the choice instead of lowering both graphs again."""
    return cache_dir() / "products"


def measure_all(plans: list, modules: dict, tree, state: dict[str, torch.Tensor], device: str,
                progress: bool = False, bar=None) -> dict:
    """The manifest's `products`: each timed setting's choice (measure), one after the other, or the
    choice this machine timed for the same graph before (`timed_before` says when); `bar` (a tqdm
    bar) advances by one per graph lowered or skipped."""
    out = {}
    for setting, plan in timed_plans(plans, weight_widths(state)).items():
        kept = timings_dir() / f"{timing_key(setting, plan, tree, state, as_choice(out))}.json"
        if kept.is_file():
            out[setting] = {**json.loads(kept.read_text()), "timed_before": True}
            if bar is not None:
                bar.update(2)
        else:
            out[setting] = measure(setting, plan, modules, tree, state, device, as_choice(out), bar)
            kept.parent.mkdir(parents=True, exist_ok=True)
            tmp = kept.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(out[setting]))
            tmp.replace(kept)
        if progress:
            r = out[setting]
            line = (f"{setting.replace('_', '-')} products: {r['product']} ({r['graph']} " + ", ".join(
                f"{k} {v:.1f} ms" for k, v in r["ms"].items()) + (", timed before on this machine" if
                                                                  r.get("timed_before") else "") + ")")
            (bar.write if bar is not None else print)(line)
    return out


def as_choice(products: dict | None) -> dict:
    """kernel_choice's arguments for a manifest's `products`."""
    return {k: CHOICES[v["product"]] for k, v in (products or {}).items()}
