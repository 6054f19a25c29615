"""The sm_90a build check (kernels/hopper_build.py): every Triton kernel, in the launches the launchers make
at SmolLM2, Qwen3-8B and Llama-3-70B shapes (bf16, fp16, fp32; 1-64 tree nodes; every GGUF block type),
compiled for the H100 by Triton's own compiler with no GPU, and its resources read back from the cubin."""
from __future__ import annotations

import pytest
import torch

from specc.kernels import hopper_build as hb
from specc.kernels.triton_support import HAS_TRITON, recording

WHY = hb.available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no sm_90a build here: {WHY}")


@pytest.fixture(scope="module")
def built():
    labelled = [la for shape in hb.SHAPES.values() for dtype in hb.DTYPES for la in hb.shape_launches(shape, dtype)]
    return labelled, hb.build(labelled)


def launched_kernels() -> set[str]:
    """Every `*_kernel` Triton function the kernel modules define (helpers they call are not launched)."""
    import importlib

    names = set()
    for mod in ("tree_attention", "tree_accept", "compact_kv", "gguf_linear", "rows_linear"):
        m = importlib.import_module(f"specc.kernels.{mod}")
        names |= {k for k, v in vars(m).items() if k.endswith("_kernel") and hasattr(v, "fn")}
    return names


def test_every_kernel_builds_for_sm90_without_spills(built):
    labelled, rows = built
    assert {b.kernel for b in rows} == launched_kernels()  # none left out of the launches
    assert sum(b.launches for b in rows) == len(labelled)
    bad = {f"{b.kernel} [{b.config}]": b.problems() for b in rows if b.problems()}
    assert not bad, hb.table([b for b in rows if b.problems()])
    for b in rows:
        assert b.registers > 0 and b.spill_stores == 0 and b.spill_loads == 0 and b.local == 0 and b.stack == 0


def test_attention_and_products_use_the_tensor_cores_in_16_bit(built):
    _, rows = built
    for b in rows:
        sixteen = "bfloat16" in b.config or "float16" in b.config
        if b.kernel in ("_tree_attention_kernel", "_rows_linear_kernel") and sixteen:
            assert b.hmma or b.hgmma, (b.kernel, b.config)
        if b.kernel == "_tree_attention_kernel":
            # the per-dtype configuration keeps several blocks resident per SM (attention_config)
            assert b.blocks_per_sm >= 3, (b.config, b.registers, b.shared)


def test_launches_come_from_the_launchers():
    """What the check compiles is what the launchers launch: their grids and constexprs at a shape."""
    from specc.kernels.tree_attention import ROW_BLOCK, attention_config

    s = hb.SHAPES["qwen3-8b"]
    launches = hb.shape_launches(s, torch.float32, tree_sizes=(8,), gguf=())
    att, combine = [la for label, la in launches if label == "qwen3-8b float32 T=8 attention"]
    assert (att.name, combine.name) == ("_tree_attention_kernel", "_combine_kernel")
    G = s.heads // s.kv_heads
    assert att.args["BLOCK_M"] == ROW_BLOCK and att.grid[:2] == (s.kv_heads, -(-G * 8 // ROW_BLOCK))
    assert att.num_warps == attention_config(torch.float32)["num_warps"]
    assert att.args["PRECISION"] == "ieee" and att.args["INTERPRETED"] is False  # not the interpreter's path
    # recorded, never run: a meta tensor has no data
    with recording() as got:
        from specc.kernels.compact_kv import compact_kv_triton

        compact_kv_triton(torch.empty(1, 2, 16, 8, device="meta"), torch.empty(3, dtype=torch.int64, device="meta"),
                          torch.empty((), dtype=torch.int64, device="meta"))
    assert [la.name for la in got] == ["_compact_kv_kernel"] and got[0].args["n"] == 3


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_specialise_agrees_with_tritons_launcher():
    """specialise() derives what Triton's launcher derives from real arguments (where this Triton exposes it)."""
    native = pytest.importorskip("triton._C.libtriton").native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import MockTensor

    from specc.kernels.tree_accept import _sum_partial_kernel

    fn = hb.jit_function(_sum_partial_kernel)
    for V, stride, chunk in ((49152, 49152, 1024), (37, 37, 16), (1, 1, 1), (2 ** 31 + 16, 3, 48)):
        args = dict(x_ptr=torch.empty(1, device="meta"), out_ptr=torch.empty(1, device="meta"), V=V, stride=stride,
                    CHUNK=chunk, SPLITS=4, BLOCK_V=16)
        sig, cex, attrs = hb.specialise(fn, args)
        for p in fn.params:
            if p.is_constexpr:
                continue
            a = args[p.name]
            ty, spec = native(CUDABackend, MockTensor(a.dtype) if isinstance(a, torch.Tensor) else a, False, True, True)
            assert sig[p.name] == ty, p.name
            assert ((p.num,) in attrs) == (isinstance(spec, str) and "D" in spec), p.name
            if ty == "constexpr":
                assert cex[(p.num,)] == spec


def test_table_and_problems():
    ok = hb.Built("k", "c", 1, "", 4, 2, ok=True, registers=64, spill_stores=0, spill_loads=0, shared=1024,
                  hmma=2, blocks_per_sm=8)
    assert ok.problems() == [] and ok.mma == "mma.sync"
    spilled = hb.Built("k", "c", 1, "", 4, 2, ok=True, registers=255, spill_stores=328, spill_loads=288, stack=512)
    assert any("spills" in p for p in spilled.problems()) and any("local" in p for p in spilled.problems())
    assert "over the" in hb.Built("k", "c", 1, "", 4, 2, ok=True, spill_stores=0, spill_loads=0,
                                  shared=300_000).problems()[0]
    assert hb.Built("k", "c", 1, "", 4, 2, ok=False, error="boom").problems() == ["does not compile: boom"]
    assert "| k | c |" in hb.table([ok])
    assert hb._occupancy(255, 4, 0) == 2 and hb._occupancy(64, 4, 151616) == 1 and hb._occupancy(32, 4, 0) == 16


def test_builds_under_the_interpreter_with_a_cold_cache(built, tmp_path):
    """With TRITON_INTERPRET=1 (as the kernel tests set it) every @triton.jit function, Triton's own tl.max
    and tl.sum among them, is an interpreter function: the build must compile them all the same, and
    with a cold Triton cache nothing can come from an earlier, uninterpreted build."""
    import json
    import os
    import subprocess
    import sys

    script = ("import json, sys, torch; from specc.kernels import hopper_build as hb; "
              "rows = hb.build(hb.shape_launches(hb.SHAPES['smollm2'], torch.bfloat16, tree_sizes=(1, 8), gguf=('Q4_0',))); "
              "json.dump(hb.as_dicts(rows), sys.stdout)")
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_CACHE_DIR=str(tmp_path / "triton"))
    out = subprocess.run([sys.executable, "-P", "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    cold = json.loads(out.stdout)
    assert cold and all(r["ok"] and not r["problems"] for r in cold), [r["error"] for r in cold if r["problems"]]
    key = ("kernel", "signature", "num_warps", "num_stages")
    warm = {tuple(getattr(b, k) for k in key): b for b in built[1] if "bfloat16" in b.dtypes.split("/")}
    for r in cold:
        b = warm[tuple(r[k] for k in key)]
        assert (r["registers"], r["shared"], r["hmma"], r["hgmma"]) == (b.registers, b.shared, b.hmma, b.hgmma), r
