"""The device check's scripts run here as far as a CPU allows (the GPU machine gives 15 minutes in
all: a script that breaks there on a renamed function wastes them): the environment report, the
cost curve's dry run, the engine and rows sections' dry runs, and the setup (examples/gpu_setup.py)
on fake folder trees and faked package metadata."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import cli_env

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import gpu_setup  # noqa: E402


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
    # only the graphs the timed runs call (greedy, one prefill size), each compile's seconds as it finished
    per_graph = engine["compile_s_per_graph"]
    assert set(per_graph) == {"prefill_greedy", "plain_greedy", "step_greedy", "draft_prefill", "draft_step",
                              "fused_greedy"}, per_graph
    assert all(s >= 0 for s in per_graph.values()) and sum(per_graph.values()) <= engine["compile_s"] + 0.5
    lines = [line for line in proc.stdout.splitlines() if line.strip().startswith("compiled ") and " in " in line]
    assert [line.split()[1] for line in lines[:len(per_graph)]] == list(per_graph)  # a line per graph, in order


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


# ---- setup: the Triton pin

PIN = 'triton==3.6.0; platform_system == "Linux" and platform_machine == "x86_64"'


def test_triton_pin_is_read_from_torch_metadata():
    assert gpu_setup.triton_pin(["filelock", "sympy>=1.13.3", PIN]) == "3.6.0"
    assert gpu_setup.triton_pin(["filelock", "sympy>=1.13.3"]) is None  # a CPU build of torch
    assert gpu_setup.triton_pin(None) is None
    assert gpu_setup.triton_pin(['triton==3.6.0; platform_system == "Windows"']) is None  # the marker does not hold
    assert gpu_setup.triton_pin(["pytorch-triton==3.6.0+git1234"]) == "3.6.0+git1234"


def test_a_triton_other_than_torchs_pin_is_refused():
    ok, sentence = gpu_setup.check_triton("2.11.0", ["filelock", PIN], "3.7.1")
    assert not ok and sentence.startswith("refused:")
    assert sentence.count(". ") == 0 and sentence.endswith(".")  # one sentence
    assert "triton==3.6.0" in sentence and "3.7.1" in sentence
    assert "works with triton 3.6 and silently falls back with 3.7" in sentence
    assert not gpu_setup.check_triton("2.11.0", [PIN], None)[0]  # pinned, and none installed
    ok, sentence = gpu_setup.check_triton("2.11.0", [PIN], "3.6.0")
    assert ok and "the version torch 2.11.0 pins" in sentence
    ok, sentence = gpu_setup.check_triton("2.13.0+cpu", ["filelock"], "3.7.1")  # this machine's torch
    assert ok and "pins no Triton version" in sentence


def _fake_metadata(root: Path) -> Path:
    """A folder that, first on PYTHONPATH, makes importlib.metadata see torch 2.11.0 (pinning triton
    3.6.0) beside triton 3.7.1."""
    for name, version, requires in (("torch", "2.11.0", ["filelock", PIN]), ("triton", "3.7.1", [])):
        info = root / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                       + "".join(f"Requires-Dist: {r}\n" for r in requires))
    return root


def test_setup_refuses_the_wrong_triton_and_the_check_stops(tmp_path):
    """With torch's metadata pinning 3.6.0 and 3.7.1 installed, gpu_setup.py exits 3 with the sentence, and
    gpu_check.sh stops after its setup section (nothing else is run)."""
    env = {**cli_env(), "PYTHONPATH": str(_fake_metadata(tmp_path / "meta"))}
    proc = subprocess.run([sys.executable, "-P", str(EXAMPLES / "gpu_setup.py"), tmp_path / "out"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stdout.startswith("refused: torch 2.11.0 pins triton==3.6.0 but triton 3.7.1 is installed")
    report = json.loads((tmp_path / "out" / "setup.json").read_text())["triton"]
    assert report["ok"] is False and report["pin"] == "3.6.0" and report["installed"] == "3.7.1"
    proc = subprocess.run(["bash", str(EXAMPLES / "gpu_check.sh"), tmp_path / "check"],
                          env={**env, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "stopped after setup: refused: torch 2.11.0 pins triton==3.6.0" in proc.stderr
    sections = json.loads((tmp_path / "check" / "sections.json").read_text())
    assert [(r["section"], r["exit"]) for r in sections] == [("setup", 3)]


# ---- setup: CUDA_HOME and libcuda.so on fake folder trees

HEADERS = ("cuda.h", "cuda_runtime.h", "cuda_runtime_api.h", "cuda_bf16.h", "cuda_fp16.h", "cuda_fp8.h")


def _touch(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for n in names:
        (folder / n).write_text(f"// {n}\n")
    return folder


def _fake_torch(root: Path, cuda: bool = True) -> Path:
    torch_dir = root / "site" / "torch"
    _touch(torch_dir / "include" / "torch" / "csrc" / "inductor" / "aoti_runtime")
    (torch_dir / "include" / "torch" / "csrc" / "inductor" / "aoti_runtime" / "device_utils.h").write_text(
        "#ifdef USE_CUDA\n#include <cuda.h>\n#include <cuda_runtime_api.h>\n#endif\n")
    (torch_dir / "include" / "torch" / "csrc" / "inductor" / "aoti_runtime" / "utils_cuda.h").write_text(
        "#include <cuda.h>\n#include <cuda_runtime.h>\n#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n"
        "#include <cuda_fp8.h>\n")
    _touch(torch_dir / "lib", *(["libtorch_cuda.so"] if cuda else ["libtorch_cpu.so"]))
    return torch_dir


def _setup(tmp_path, **kw):
    defaults = dict(env={}, site_dirs=[tmp_path / "site"], which=lambda _: None,
                    usr_local_cuda=tmp_path / "usr-local-cuda", lib_dirs=[tmp_path / "driver"], loaded=[],
                    check_compile=False)
    if "torch_dir" not in kw:
        kw["torch_dir"] = _fake_torch(tmp_path)
    return gpu_setup.setup(tmp_path / "out", **{**defaults, **kw})


def test_setup_reads_the_headers_from_torchs_own_includes(tmp_path):
    assert gpu_setup.aoti_cuda_headers(_fake_torch(tmp_path) / "include") == (
        "cuda.h", "cuda_runtime_api.h", "cuda_runtime.h", "cuda_bf16.h", "cuda_fp16.h", "cuda_fp8.h")
    assert gpu_setup.aoti_cuda_headers(tmp_path / "nowhere") == gpu_setup.AOTI_CUDA_HEADERS
    real = gpu_setup.aoti_cuda_headers(Path(torch.__file__).parent / "include")  # this torch's headers
    assert {"cuda.h", "cuda_runtime_api.h"} <= set(real)


def test_setup_makes_cuda_home_from_the_pip_wheels_and_triton(tmp_path):
    """No toolkit: CUDA_HOME is made from nvidia-cuda-runtime's headers (first) and Triton's (for the rest),
    and the driver's libcuda.so.1 becomes an unversioned libcuda.so on LIBRARY_PATH."""
    site = tmp_path / "site"
    runtime = _touch(site / "nvidia" / "cuda_runtime" / "include", *[h for h in HEADERS if h != "cuda.h"])
    _touch(runtime / "crt", "host_config.h")
    triton = _touch(site / "triton" / "backends" / "nvidia" / "include", *HEADERS)
    _touch(site / "triton" / "backends" / "nvidia" / "bin", "ptxas")
    _touch(tmp_path / "driver", "libcuda.so.1")
    s = _setup(tmp_path, env={"LIBRARY_PATH": "/opt/x"})
    assert s.missing == []
    home = tmp_path / "out" / "cuda_home"
    assert s.env["CUDA_HOME"] == str(home)
    assert (home / "include" / "cuda_runtime_api.h").resolve() == runtime / "cuda_runtime_api.h"  # the wheel's
    assert (home / "include" / "cuda.h").resolve() == triton / "cuda.h"  # only Triton has it
    assert (home / "include" / "crt" / "host_config.h").is_file()
    assert (home / "bin" / "ptxas").resolve() == site / "triton" / "backends" / "nvidia" / "bin" / "ptxas"
    for link in (tmp_path / "out" / "cuda_lib" / "libcuda.so", home / "lib64" / "libcuda.so"):
        assert link.resolve() == tmp_path / "driver" / "libcuda.so.1"
    assert s.env["LIBRARY_PATH"] == f"{tmp_path / 'out' / 'cuda_lib'}:/opt/x"
    assert f"  cuda.h: from {triton}" in s.log
    assert "export CUDA_HOME=" in gpu_setup.env_file(s.env)


def test_setup_keeps_a_complete_toolkit_and_prefers_the_loaded_driver(tmp_path):
    toolkit = tmp_path / "cuda-12.8"
    _touch(toolkit / "include", *HEADERS)
    loaded = _touch(tmp_path / "nvidia-driver", "libcuda.so.570.1") / "libcuda.so.570.1"
    _touch(tmp_path / "driver", "libcuda.so.1")
    s = _setup(tmp_path, env={"CUDA_HOME": str(toolkit)}, loaded=[loaded])
    assert s.missing == [] and s.env["CUDA_HOME"] == str(toolkit)
    assert not (tmp_path / "out" / "cuda_home").exists()  # nothing made
    assert (tmp_path / "out" / "cuda_lib" / "libcuda.so").resolve() == loaded
    assert any("has every header" in line for line in s.log)


def test_setup_replaces_a_cuda_home_without_headers(tmp_path):
    """nvcc on PATH may be a wrapper script in /usr/local/bin: torch then takes /usr/local as CUDA_HOME,
    which has no CUDA headers; a complete /usr/local/cuda supplies them."""
    nvcc = _touch(tmp_path / "usr" / "local" / "bin", "nvcc") / "nvcc"
    _touch(tmp_path / "usr-local-cuda" / "include", *HEADERS)
    _touch(tmp_path / "driver", "libcuda.so")  # only an unversioned one (a stub is enough to link)
    s = _setup(tmp_path, which=lambda name: str(nvcc) if name == "nvcc" else None)
    assert s.missing == []
    assert any(f"CUDA_HOME: {tmp_path / 'usr' / 'local'} (found by nvcc on PATH" in line and "lacks cuda.h" in line
               for line in s.log)
    assert (tmp_path / "out" / "cuda_home" / "include" / "cuda_fp8.h").resolve() == \
        tmp_path / "usr-local-cuda" / "include" / "cuda_fp8.h"
    assert (tmp_path / "out" / "cuda_lib" / "libcuda.so").resolve() == tmp_path / "driver" / "libcuda.so"


def test_setup_says_what_is_missing_and_where_it_looked(tmp_path):
    site = tmp_path / "site"
    _touch(site / "triton" / "backends" / "nvidia" / "include", *[h for h in HEADERS if h != "cuda_fp8.h"])
    s = _setup(tmp_path, torch_dir=_fake_torch(tmp_path, cuda=False))
    assert len(s.missing) == 3, s.missing
    fp8, libcuda, torch_cuda = s.missing
    assert fp8.startswith("cuda_fp8.h (included by AOTInductor's CUDA code) is in none of: ")
    assert str(site / "nvidia" / "cuda_runtime" / "include") in fp8
    assert str(site / "triton" / "backends" / "nvidia" / "include") in fp8
    assert libcuda.startswith("libcuda.so.1 (the driver's CUDA library, linked by -lcuda) is in none of: ")
    assert str(tmp_path / "driver") in libcuda and "nor loaded by this process" in libcuda
    assert "libtorch_cuda.so" in torch_cuda and "not a CUDA build" in torch_cuda
    assert "LIBRARY_PATH" not in s.env
    assert all(f"MISSING: {m}" in s.log for m in s.missing)


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
def test_setup_compiles_and_links_as_aotinductor_does(tmp_path):
    """The last check: a file including the headers, compiled and linked with -lcuda; its first error
    (a missing header, no libcuda.so) is reported."""
    _touch(tmp_path / "site" / "nvidia" / "cuda_runtime" / "include", *HEADERS)
    (tmp_path / "fake_cuda.cpp").write_text('extern "C" int cuInit(unsigned) { return 0; }\n')
    (tmp_path / "driver").mkdir()
    torch_dir = _fake_torch(tmp_path)
    for lib in (tmp_path / "driver" / "libcuda.so.1", torch_dir / "lib" / "libtorch_cuda.so"):  # real libraries
        subprocess.run(["c++", "-shared", "-fPIC", f"-Wl,-soname,{lib.name}", str(tmp_path / "fake_cuda.cpp"), "-o",
                        str(lib)], check=True)
    s = _setup(tmp_path, check_compile=True, torch_dir=torch_dir)
    assert s.missing == [] and any(line.startswith("compile check: the headers compile and -lcuda links")
                                   for line in s.log), s.log
    home = Path(s.env["CUDA_HOME"])
    s2 = gpu_setup.Setup()
    for link in (home / "lib64" / "libcuda.so", tmp_path / "out" / "cuda_lib" / "libcuda.so"):
        link.unlink()
    gpu_setup.compile_check(s2, home, HEADERS, tmp_path / "out" / "cuda_lib", None, {})
    assert len(s2.missing) == 1 and "cannot find -lcuda" in s2.missing[0], s2.missing
