"""The few-row products of a CPU float32 engine, chosen by timing both kinds on the compiling machine.

rows_linear (kernels/rows_linear.py) computes a decode step's few-row products either with the C++
product (kernels/dense_cpu.cpp) or with Inductor's streaming reduction, and which is faster depends
on the CPU: at one row the C++ product won on one AVX-512 EPYC (12.9 against 16.2 ms per plain step)
and lost on a Zen 4 one (22.4 against 14.1 ms). So `specc compile` lowers the plain graph (one row)
and the whole tree's step graph (its products of many rows: more input rows than the reduction keeps
in cache, rows_linear.many_rows; the others keep the reduction) both ways, times each pair side by
side and lowers every graph under the faster. The manifest's `products` holds each choice with both
times (and, for many rows, from how many rows that is at each weight width). The plain graph matters
most: every speedup is measured against it and an adaptive engine falls back to it. Targets too
small for the products to show (below MIN_TIMED_BYTES of weights read per token, e.g. the tests'
tiny models) keep the rule.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from specc.kernels.rows_linear import kernel_choice, many_rows

from .adaptive import time_calls
from .backends import InductorGraph, get_backend, lower_graph
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
            chosen: dict | None = None) -> dict:
    """Lower `plan` with the C++ product and with the reduction for `setting` ("one_row" or
    "many_rows"; the settings already `chosen` as given), time both (interleaved rounds, medians) and
    return {"product": the faster, "graph": the plan's name, "ms": both}. The program is captured
    afresh (the main loop captures it again: a few seconds, and --dump-ir's files stay whole)."""
    ep = build_program(plan, modules, {}, tree)
    args = example_inputs(ep)
    # ids and positions as zeros, temperature, top-p and uniforms as ones (as adaptive.time_family)
    args = tuple(torch.ones_like(a) if a.is_floating_point() else a for a in args)
    calls = []
    with tempfile.TemporaryDirectory(prefix="specc-products-") as tmp:
        for name, on in CHOICES.items():
            with kernel_choice(**{**(chosen or {}), setting: on}):
                entry = lower_graph("inductor", ep, state, Path(tmp), f"{plan.name}_{name}", args, device)
            calls.append((InductorGraph(Path(tmp) / entry["file"], state, entry["state_keys"]), args))
        ms = time_calls(calls, device)
    times = dict(zip(CHOICES, ms))
    out = {"product": min(times, key=times.get), "graph": plan.name, "ms": times}
    if setting == "many_rows":  # what "many" meant for this target: the rule of rows_linear.many_rows
        out["from_rows"] = {str(k): r for k, r in rows_from(weight_widths(state), plan.T).items()}
    return out


def measure_all(plans: list, modules: dict, tree, state: dict[str, torch.Tensor], device: str,
                progress: bool = False) -> dict:
    """The manifest's `products`: each timed setting's choice (measure), one after the other."""
    out = {}
    for setting, plan in timed_plans(plans, weight_widths(state)).items():
        out[setting] = measure(setting, plan, modules, tree, state, device, as_choice(out))
        if progress:
            r = out[setting]
            print(f"{setting.replace('_', '-')} products: {r['product']} ({r['graph']} " + ", ".join(
                f"{k} {v:.1f} ms" for k, v in r["ms"].items()) + ")", flush=True)
    return out


def as_choice(products: dict | None) -> dict:
    """kernel_choice's arguments for a manifest's `products`."""
    return {k: CHOICES[v["product"]] for k, v in (products or {}).items()}
