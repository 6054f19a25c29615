"""The few-row products of a CPU float32 engine, chosen by timing both kinds on the compiling machine.

rows_linear (kernels/rows_linear.py) computes a decode step's few-row products either with the C++
product (kernels/dense_cpu.cpp) or with Inductor's streaming reduction, and which is faster depends
on the CPU: at one row the C++ product won on one AVX-512 EPYC (12.9 against 16.2 ms per plain step)
and lost on a Zen 4 one (22.4 against 14.1 ms). So `specc compile` lowers the plain graph (one row)
and the whole tree's step graph (KERNEL_MIN_ROWS rows or more; 2-4 rows keep the reduction) both
ways, times each pair side by side and lowers every graph under the faster. The manifest's
`products` holds each choice with both times. The plain graph matters most: every speedup is
measured against it and an adaptive engine falls back to it. Targets too small for the products to
show (below MIN_TIMED_BYTES of weights read per token, e.g. the tests' tiny models) keep the rule.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from specc.kernels.rows_linear import KERNEL_MIN_ROWS, kernel_choice

from .adaptive import time_calls
from .backends import InductorGraph, lower_graph
from .pipeline import example_inputs
from .plans import build_program
from .quant import FLOAT

# Below this many bytes of weights per token a step's fixed costs hide the products: the rule applies.
MIN_TIMED_BYTES = 32 << 20
CHOICES = {"cpp": True, "reduction": False}


def applies(cfg, bytes_per_token: int, cpu_kernels: bool) -> bool:
    """Whether to time the products: Inductor on CPU, float32 weights, the C++ product built here,
    and a target that reads at least MIN_TIMED_BYTES of weights per token."""
    return cpu_kernels and cfg.backend == "inductor" and torch.device(cfg.device or "cpu").type == "cpu" \
        and cfg.torch_dtype == torch.float32 and cfg.quant == FLOAT and bytes_per_token >= MIN_TIMED_BYTES


def timed_plans(plans: list) -> dict:
    """What to time: {"one_row": the first plain graph, "many_rows": the first whole-tree step graph
    when it verifies KERNEL_MIN_ROWS nodes or more}."""
    out = {"one_row": next(p for p in plans if p.name.startswith("plain"))}
    step = next((p for p in plans if p.module == "target" and p.name.startswith("step_")), None)
    if step is not None and step.T >= KERNEL_MIN_ROWS:
        out["many_rows"] = step
    return out


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
    return {"product": min(times, key=times.get), "graph": plan.name, "ms": times}


def measure_all(plans: list, modules: dict, tree, state: dict[str, torch.Tensor], device: str,
                progress: bool = False) -> dict:
    """The manifest's `products`: each timed setting's choice (measure), one after the other."""
    out = {}
    for setting, plan in timed_plans(plans).items():
        out[setting] = measure(setting, plan, modules, tree, state, device, as_choice(out))
        if progress:
            r = out[setting]
            print(f"{setting.replace('_', '-')} products: {r['product']} ({r['graph']} " + ", ".join(
                f"{k} {v:.1f} ms" for k, v in r["ms"].items()) + ")", flush=True)
    return out


def as_choice(products: dict | None) -> dict:
    """kernel_choice's arguments for a manifest's `products`."""
    return {k: CHOICES[v["product"]] for k, v in (products or {}).items()}
