"""The device check's scripts run here as far as a CPU allows (the GPU machine gives 15 minutes in
all: a script that breaks there on a renamed function wastes them): the environment report and
the cost curve's dry run."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from conftest import cli_env

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(script: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", str(EXAMPLES / script), *map(str, args)], env=cli_env(),
                          capture_output=True, text=True, timeout=300)


def test_environment_report(tmp_path):
    proc = run("gpu_check.py", "--env-only", "--json", tmp_path / "env.json")
    env = json.loads((tmp_path / "env.json").read_text())["environment"]
    assert env["torch"] == torch.__version__ and env["specc_ops"] is True
    assert env["cuda_available"] == torch.cuda.is_available()
    assert proc.returncode == (0 if torch.cuda.is_available() else 1), proc.stderr  # no GPU: the report says so


def test_cost_curve_dry_run(tmp_path):
    proc = run("gpu_cost_curve.py", "--device", "cpu", "--shapes", "smollm2", "--layers", "1", "--Ts", "1,3",
               "--context", "16", "--reps", "2", "--json", tmp_path / "curve.json")
    assert proc.returncode == 0, proc.stderr
    row = json.loads((tmp_path / "curve.json").read_text())["shapes"]["smollm2"]
    assert row["layers_built"] == 1 and row["layers_full"] == 30
    assert row["c"]["1"] == 1.0 and row["c"]["3"] > 0 and row["ms"]["3"] > 0
    assert row["ms_per_layer_upper"]["1"] == row["ms"]["1"]  # one layer built
    assert "c(T) = 1.000" in proc.stdout
    if not torch.cuda.is_available():  # the real run refuses in one sentence
        proc = run("gpu_cost_curve.py")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "CUDA" in proc.stderr


def test_engine_section_dry_run(tmp_path):
    """The engine section end to end on the CPU with an eager engine of one layer (on a GPU it runs
    inductor, with and without CUDA graphs, and counts launches with the profiler)."""
    proc = run("gpu_check.py", "--device", "cpu", "--backend", "eager", "--layers", "1", "--skip-kernels",
               "--new-tokens", "6", "--prompts", "1", "--rounds", "1", "--json", tmp_path / "out.json")
    assert proc.returncode == 0, proc.stderr
    engine = json.loads((tmp_path / "out.json").read_text())["engine"]
    assert set(engine["launch"]["ms_per_step"]) == {"plain", "unfused", "fused"}
    assert engine["launch"]["identical_runs"] == "1/1"  # fp32 on the CPU: the three paths agree
    assert "cuda_graphs" not in engine  # CPU: skipped, not faked
    assert "fused: one graph" in proc.stdout


def test_rows_section_dry_run(tmp_path):
    """The rows section on the CPU, eager: each verify row equals the plain step's (the CPU kernels
    guarantee it for chains and trees alike)."""
    proc = run("gpu_check.py", "--rows", "--device", "cpu", "--row-backends", "eager", "--layers", "1",
               "--json", tmp_path / "rows.json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert {(r["dtype"], r["tree"]) for r in rows} == {(d, t) for d in ("bfloat16", "float32")
                                                      for t in ("chain:4", "topk:2,2")}
    assert all(r["identical"] for r in rows), rows
