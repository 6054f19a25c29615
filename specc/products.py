"""The one-row product of a CPU float32 engine, chosen by timing both on the compiling machine.

A plain decode step multiplies one row by every weight. On CPU, rows_linear (kernels/rows_linear.py)
can compute it with the C++ product (kernels/dense_cpu.cpp) or with Inductor's streaming reduction,
and which is faster depends on the CPU: the C++ product won on one AVX-512 EPYC (12.9 against 16.2 ms
per plain step) and lost on a Zen 4 one (23.4 ms, slower than the reduction's 2-node step). The
plain graph is what every speedup is measured against and what an adaptive engine falls back to, so
`specc compile` lowers it both ways, times the two side by side and lowers every graph under the
faster (`one_row` in the manifest, with both times). Targets too small for the products to show
(below MIN_TIMED_BYTES of float32 weights, e.g. the tests' tiny models) keep the rule.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from specc.kernels.rows_linear import one_row_kernel

from .adaptive import time_calls
from .backends import InductorGraph, lower_graph
from .pipeline import example_inputs
from .plans import build_program

# Below this many bytes of float32 weights a step's fixed costs hide the products: the rule applies.
MIN_TIMED_BYTES = 32 << 20
CHOICES = {"cpp": True, "reduction": False}


def applies(cfg, bytes_per_token: int, cpu_kernels: bool) -> bool:
    """Whether to time the one-row product: Inductor on CPU, float32 weights, the C++ product built
    here, and a target that reads at least MIN_TIMED_BYTES of weights per token."""
    return cpu_kernels and cfg.backend == "inductor" and torch.device(cfg.device or "cpu").type == "cpu" \
        and cfg.torch_dtype == torch.float32 and cfg.quant == "none" and bytes_per_token >= MIN_TIMED_BYTES


def measure_one_row(plan, modules: dict, tree, state: dict[str, torch.Tensor], device: str) -> dict:
    """Lower the plain graph `plan` with each one-row product, time both (interleaved rounds,
    medians) and return the manifest's `one_row` entry: {"product": the faster, "ms": both}."""
    ep = build_program(plan, modules, {}, tree)
    args = example_inputs(ep)
    # ids and positions as zeros, temperature, top-p and uniforms as ones (as adaptive.time_family)
    args = tuple(torch.ones_like(a) if a.is_floating_point() else a for a in args)
    calls = []
    with tempfile.TemporaryDirectory(prefix="specc-one-row-") as tmp:
        for name, on in CHOICES.items():
            with one_row_kernel(on):
                entry = lower_graph("inductor", ep, state, Path(tmp), f"{plan.name}_{name}", args, device)
            calls.append((InductorGraph(Path(tmp) / entry["file"], state, entry["state_keys"]), args))
        ms = time_calls(calls, device)
    times = dict(zip(CHOICES, ms))
    return {"product": min(times, key=times.get), "ms": times}
