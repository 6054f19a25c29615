"""The device check's setup: what AOTInductor's CUDA build and specc's Triton kernels need on the GPU
machine, found or made, or what is missing said precisely (examples/gpu_check.sh runs it first).

    python examples/gpu_setup.py OUT_DIR     # -> OUT_DIR/setup.env (sourced by the later sections), setup.json

Exit status: 0 everything found; 1 something is missing (the log says which file was looked for where;
the sections that do not compile for CUDA still run); 3 Triton refused (the check stops).

1. Triton must be the version torch's wheel pins (its metadata's `Requires-Dist: triton==X`): torch 2.11's
   mutation analysis of user Triton kernels works with triton 3.6 and, with 3.7, fails inside and falls
   back to "every input is written", so Inductor clones every input of specc's kernels (the KV caches
   among them) on every call, without a word. A torch that pins no Triton (a CPU build) passes.
2. CUDA_HOME. AOTInductor's CUDA build asks `torch.utils.cpp_extension.include_paths("cuda")` for
   CUDA_HOME/include (CUDA_HOME: $CUDA_HOME or $CUDA_PATH, else nvcc's folder on PATH, else
   /usr/local/cuda; with none of them it raises), and its generated C++ includes cuda.h,
   cuda_runtime.h, cuda_runtime_api.h and the bf16/fp16/fp8 headers (torch/include/torch/csrc/inductor/
   aoti_runtime/device_utils.h and utils_cuda.h, read here for the list). It links with
   `library_paths("cuda")`: torch/lib and CUDA_HOME/lib64 (lib where only that exists); it needs no
   libcudart (torch_cuda brings it) and no nvcc (Triton compiles the kernels with its own ptxas).
   When the CUDA_HOME torch would take lacks a header, a CUDA_HOME is made under OUT_DIR/cuda_home:
   include/ gathers, by symlink, each entry from the first folder that has it: the pip wheels'
   site-packages/nvidia/*/include (torch's own CUDA; nvidia-cuda-runtime-cu12 first, cu13 wheels:
   nvidia/cu13/include), then that CUDA_HOME's include and /usr/local/cuda/include where they hold CUDA
   headers, then Triton's triton/backends/nvidia/include; bin/ links Triton's ptxas and tools.
3. An unversioned libcuda.so for `-lcuda`: the driver usually installs only libcuda.so.1. The one this
   process loaded (after CUDA starts), else libcuda.so.1 or libcuda.so in the driver's usual folders,
   is linked as OUT_DIR/cuda_lib/libcuda.so (also CUDA_HOME/lib64/libcuda.so for a made CUDA_HOME),
   and OUT_DIR/cuda_lib goes first on LIBRARY_PATH.
4. Where a C++ compiler is here, a file including those headers is compiled and linked with -lcuda
   (and -ltorch_cuda), which is what AOTInductor will do: its first error is reported.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# What the generated code includes where torch's headers cannot be read (torch 2.11-2.13 include these).
AOTI_CUDA_HEADERS = ("cuda.h", "cuda_runtime.h", "cuda_runtime_api.h", "cuda_bf16.h", "cuda_fp16.h", "cuda_fp8.h")
REFUSED = 3


@dataclass
class Setup:
    """What the setup found: the variables to export, its log, and a sentence per missing thing."""
    env: dict[str, str] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def say(self, line: str) -> None:
        self.log.append(line)
        print(line, flush=True)

    def lack(self, sentence: str) -> None:
        self.missing.append(sentence)
        self.say(f"MISSING: {sentence}")


# ---- 1. Triton's pin

def triton_pin(torch_requires: list[str] | None) -> str | None:
    """The Triton version torch's wheel pins (`triton==X` or `pytorch-triton==X` among its Requires-Dist),
    or None (a CPU build pins none). A marker that does not hold on this machine drops the pin."""
    for req in torch_requires or []:
        spec, _, marker = req.partition(";")
        m = re.fullmatch(r"\s*(?:pytorch-)?triton\s*(?:\[[^\]]*\])?\s*==\s*([^\s,]+)\s*", spec)
        if not m:
            continue
        if marker.strip():
            try:
                from packaging.markers import Marker

                if not Marker(marker.strip()).evaluate():
                    continue
            except ImportError:  # no packaging: keep the pin (the machines this runs on are Linux x86_64)
                pass
        return m.group(1)
    return None


def check_triton(torch_version: str, torch_requires: list[str] | None, triton_version: str | None) -> tuple[bool, str]:
    """Whether the installed Triton is the one torch pins, and the sentence that says so."""
    pin = triton_pin(torch_requires)
    if pin is None:
        return True, (f"triton: torch {torch_version}'s metadata pins no Triton version (a CPU build), so there is "
                      f"nothing to match; installed: {triton_version or 'none'}.")
    if triton_version is not None and _same_version(triton_version, pin):
        return True, f"triton: {triton_version}, the version torch {torch_version} pins."
    have = f"triton {triton_version} is installed" if triton_version else "no triton is installed"
    return False, (f"refused: torch {torch_version} pins triton=={pin} but {have}; mutation analysis of user Triton "
                   f"kernels in torch 2.11 works with triton 3.6 and silently falls back with 3.7 (it clones every "
                   f"input of specc's kernels, the KV caches too, on every call), so put triton=={pin} back (never "
                   f"upgrade Triton on the GPU machine) and run the check again.")


def _same_version(a: str, b: str) -> bool:
    try:
        from packaging.version import Version

        return Version(a) == Version(b)
    except Exception:
        return a.strip() == b.strip()


def installed_versions() -> tuple[str, list[str] | None, str | None]:
    """torch's version and Requires-Dist, and Triton's version, from the installed wheels' metadata."""
    from importlib import metadata

    dist = metadata.distribution("torch")
    try:
        triton = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton = None
    return dist.version, dist.requires, triton


# ---- 2. CUDA_HOME

def aoti_cuda_headers(torch_include: Path | None) -> tuple[str, ...]:
    """The CUDA headers AOTInductor's generated CUDA code includes, read from torch's own headers."""
    found: list[str] = []
    if torch_include is not None:
        for name in ("device_utils.h", "utils_cuda.h"):
            f = torch_include / "torch" / "csrc" / "inductor" / "aoti_runtime" / name
            if f.is_file():
                for h in re.findall(r"#include\s*<(cuda\w*\.h)>", f.read_text(errors="replace")):
                    if h not in found:
                        found.append(h)
    return tuple(found) or AOTI_CUDA_HEADERS


def torch_cuda_home(env: dict, which=shutil.which,
                    usr_local_cuda: Path = Path("/usr/local/cuda")) -> tuple[Path | None, str]:
    """The CUDA_HOME torch.utils.cpp_extension would take, and how it found it."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var):
            return Path(env[var]), f"${var}"
    nvcc = which("nvcc")
    if nvcc:
        return Path(nvcc).parent.parent, f"nvcc on PATH ({nvcc})"  # as torch does: the link not followed
    if usr_local_cuda.exists():
        return usr_local_cuda, str(usr_local_cuda)
    return None, "none: no $CUDA_HOME or $CUDA_PATH, no nvcc on PATH, no /usr/local/cuda"


def include_candidates(toolkit: Path | None, usr_local_cuda: Path, site_dirs: list[Path]) -> list[Path]:
    """Folders of CUDA headers, in the order they are taken from: the pip wheels torch was installed with
    first (their CUDA is torch's), then a toolkit's include where it has CUDA headers (nvcc on PATH can be
    a wrapper whose CUDA_HOME is /usr/local), then Triton's copy."""
    out: list[Path] = []
    for site in site_dirs:
        nv = site / "nvidia"
        firsts = [nv / "cuda_runtime" / "include", nv / "cu13" / "include", nv / "cu12" / "include"]
        others = sorted(p for p in nv.glob("*/include") if p not in firsts) if nv.is_dir() else []
        out += firsts + others
    for folder in ([toolkit / "include"] if toolkit is not None else []) + [usr_local_cuda / "include"]:
        if any((folder / h).is_file() for h in ("cuda.h", "cuda_runtime_api.h")):
            out.append(folder)
    out += [site / "triton" / "backends" / "nvidia" / "include" for site in site_dirs]
    return list(dict.fromkeys(out))


def make_cuda_home(s: Setup, out: Path, headers: tuple[str, ...], toolkit: Path | None, how: str,
                   usr_local_cuda: Path, site_dirs: list[Path]) -> Path | None:
    """The CUDA_HOME for AOTInductor: torch's own when it has every header, else one made in out/cuda_home."""
    if toolkit is not None and all((toolkit / "include" / h).is_file() for h in headers):
        s.say(f"CUDA_HOME: {toolkit} (found by {how}) has every header AOTInductor's CUDA code includes "
              f"({', '.join(headers)}).")
        return toolkit
    if toolkit is None:
        s.say(f"CUDA_HOME: torch finds {how}; making one.")
    else:
        lacking = [h for h in headers if not (toolkit / "include" / h).is_file()]
        s.say(f"CUDA_HOME: {toolkit} (found by {how}) lacks {', '.join(lacking)} in {toolkit / 'include'}; making one.")
    home = out / "cuda_home"
    shutil.rmtree(home, ignore_errors=True)
    (home / "include").mkdir(parents=True)
    (home / "lib64").mkdir()
    (home / "bin").mkdir()
    looked = include_candidates(toolkit, usr_local_cuda, site_dirs)
    candidates = [c for c in looked if c.is_dir()]
    sources: dict[str, Path] = {}
    for folder in candidates:
        for entry in sorted(folder.iterdir()):
            target = home / "include" / entry.name
            if not target.exists() and not target.is_symlink():
                target.symlink_to(entry.resolve())
                sources[entry.name] = folder
    for h in headers:
        if h in sources:
            s.say(f"  {h}: from {sources[h]}")
        else:
            s.lack(f"{h} (included by AOTInductor's CUDA code) is in none of: {', '.join(map(str, looked))}")
    for site in site_dirs:  # Triton's ptxas and tools, where CUDA tools are looked for under CUDA_HOME
        tools = site / "triton" / "backends" / "nvidia" / "bin"
        if tools.is_dir():
            for tool in sorted(tools.iterdir()):
                if not (home / "bin" / tool.name).exists():
                    (home / "bin" / tool.name).symlink_to(tool.resolve())
    s.say(f"CUDA_HOME: made {home} (include/ from {len(candidates)} folder(s); lib64/ for libcuda.so)")
    return home


def cuda_version(include: Path, header: str, macro: str) -> str | None:
    f = include / header
    if not f.is_file():
        return None
    m = re.search(rf"#define\s+{macro}\s+(\d+)", f.read_text(errors="replace"))
    return f"{int(m.group(1)) // 1000}.{int(m.group(1)) % 1000 // 10}" if m else None


# ---- 3. libcuda.so

def libcuda_dirs(env: dict, toolkit: Path | None, usr_local_cuda: Path = Path("/usr/local/cuda")) -> list[Path]:
    """Where the driver's libcuda usually is, in the order looked at."""
    machine = platform.machine()
    dirs = [Path(p) for var in ("LIBRARY_PATH", "LD_LIBRARY_PATH") for p in env.get(var, "").split(":") if p]
    dirs += [Path(f"/usr/lib/{machine}-linux-gnu"), Path(f"/lib/{machine}-linux-gnu"), Path("/usr/lib64"),
             Path("/usr/lib"), Path("/usr/local/nvidia/lib64"), Path("/usr/local/nvidia/lib"),
             usr_local_cuda / "compat", usr_local_cuda / "lib64" / "stubs"]
    if toolkit is not None:
        dirs += [toolkit / "lib64" / "stubs", toolkit / "lib" / "stubs", toolkit / "compat"]
    seen, out = set(), []
    for d in dirs:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


def loaded_libcuda() -> list[Path]:
    """The libcuda this process mapped (start CUDA first): the driver's own library, wherever it is."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return sorted({Path(line.split()[-1]) for line in maps.splitlines() if re.search(r"/libcuda\.so(\.\d+)*$", line)})


def find_libcuda(s: Setup, dirs: list[Path], loaded: list[Path]) -> Path | None:
    """The library `-lcuda` should find: the loaded driver library, else libcuda.so.1, else libcuda.so."""
    for p in loaded:
        if p.is_file():
            s.say(f"libcuda: {p} (loaded by this process)")
            return p
    for name in ("libcuda.so.1", "libcuda.so"):
        for d in dirs:
            if (d / name).exists():
                s.say(f"libcuda: {d / name}{' (a link stub: enough to link)' if 'stubs' in d.parts else ''}")
                return (d / name)
    s.lack(f"libcuda.so.1 (the driver's CUDA library, linked by -lcuda) is in none of: "
           f"{', '.join(str(d) for d in dirs)}" + (", nor loaded by this process" if not loaded else ""))
    return None


def link_libcuda(out: Path, lib: Path, home: Path | None, made: bool) -> Path:
    """out/cuda_lib/libcuda.so -> lib (and home/lib64/libcuda.so for a made CUDA_HOME)."""
    folder = out / "cuda_lib"
    folder.mkdir(parents=True, exist_ok=True)
    targets = [folder / "libcuda.so"] + ([home / "lib64" / "libcuda.so"] if made and home is not None else [])
    for t in targets:
        if t.is_symlink() or t.exists():
            t.unlink()
        t.symlink_to(lib.resolve())
    return folder


# ---- 4. a compile and a link as AOTInductor does them

def compile_check(s: Setup, home: Path, headers: tuple[str, ...], lib_dir: Path | None, torch_lib: Path | None,
                  env: dict) -> None:
    cxx = env.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        s.say("compile check: skipped (no C++ compiler: no $CXX, c++ or g++); AOTInductor needs one too.")
        return
    with tempfile.TemporaryDirectory(prefix="specc-setup-") as tmp:
        src = Path(tmp) / "t.cpp"
        src.write_text("".join(f"#include <{h}>\n" for h in headers) + "int specc_probe() { return 0; }\n")
        libs = ([f"-L{lib_dir}"] if lib_dir else []) + ["-lcuda"]
        if torch_lib is not None and (torch_lib / "libtorch_cuda.so").exists():
            libs += [f"-L{torch_lib}", "-ltorch_cuda"]
        cmd = [cxx, "-shared", "-fPIC", f"-I{home / 'include'}", str(src), "-o", str(Path(tmp) / "t.so"),
               f"-L{home / 'lib64'}", *libs]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, timeout=120)
        if proc.returncode == 0:
            s.say(f"compile check: the headers compile and -lcuda links ({shlex.join(cmd)})")
        else:
            lines = [line for line in proc.stderr.splitlines() if not line.startswith("collect2")]
            first = next((line for line in lines if re.search(r"error|cannot find|undefined", line, re.I)),
                         lines[0] if lines else f"exit {proc.returncode}")
            s.lack(f"compiling and linking as AOTInductor does failed: {first.strip()} ({shlex.join(cmd)})")


# ---- all of it

def setup(out: Path, *, env: dict | None = None, site_dirs: list[Path] | None = None, torch_dir: Path | None = None,
          which=shutil.which, usr_local_cuda: Path = Path("/usr/local/cuda"), lib_dirs: list[Path] | None = None,
          loaded: list[Path] | None = None, check_compile: bool = True, torch_cuda: str | None = None) -> Setup:
    """Find or make CUDA_HOME and libcuda.so for AOTInductor's CUDA build (everything injectable, for tests)."""
    env = dict(os.environ if env is None else env)
    s = Setup()
    out.mkdir(parents=True, exist_ok=True)
    torch_include = torch_dir / "include" if torch_dir is not None else None
    torch_lib = torch_dir / "lib" if torch_dir is not None else None
    headers = aoti_cuda_headers(torch_include)
    toolkit, how = torch_cuda_home(env, which, usr_local_cuda)
    home = make_cuda_home(s, out, headers, toolkit, how, usr_local_cuda, list(site_dirs or []))
    made = home is not None and home != toolkit
    if home is not None:
        s.env["CUDA_HOME"] = str(home)
        versions = {h: cuda_version(home / "include", h, macro)
                    for h, macro in (("cuda.h", "CUDA_VERSION"), ("cuda_runtime_api.h", "CUDART_VERSION"))}
        if any(versions.values()):
            s.say("CUDA headers: " + ", ".join(f"{h} {v}" for h, v in versions.items() if v)
                  + (f"; torch was built with CUDA {torch_cuda}" if torch_cuda else ""))
            runtime = versions["cuda_runtime_api.h"]
            if torch_cuda and runtime and runtime.split(".")[0] != torch_cuda.split(".")[0]:
                s.say(f"warning: the CUDA runtime headers are CUDA {runtime} but torch's CUDA is {torch_cuda}: "
                      f"a compiled graph may name runtime functions torch's libcudart lacks.")
    if lib_dirs is None:
        lib_dirs = libcuda_dirs(env, toolkit, usr_local_cuda)
    lib = find_libcuda(s, lib_dirs, loaded or [])
    lib_dir = None
    if lib is not None:
        lib_dir = link_libcuda(out, lib, home, made)
        s.env["LIBRARY_PATH"] = ":".join([str(lib_dir)] + [p for p in env.get("LIBRARY_PATH", "").split(":") if p])
        s.say(f"libcuda.so: {lib_dir / 'libcuda.so'} -> {lib.resolve()}; LIBRARY_PATH starts with {lib_dir}")
    if torch_lib is not None:
        if (torch_lib / "libtorch_cuda.so").exists():
            s.say(f"torch_cuda: {torch_lib / 'libtorch_cuda.so'}")
        else:
            s.lack(f"libtorch_cuda.so (linked by -ltorch_cuda) is not in {torch_lib}: this torch is not a CUDA build")
    if check_compile and home is not None and not s.missing:
        compile_check(s, home, headers, lib_dir, torch_lib, s.env)
    return s


def env_file(env: dict[str, str]) -> str:
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the check's output folder: setup.env, setup.json, cuda_home/, cuda_lib/")
    args = ap.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    torch_version, requires, triton_version = installed_versions()
    ok, sentence = check_triton(torch_version, requires, triton_version)
    print(sentence, flush=True)
    report = {"triton": {"ok": ok, "installed": triton_version, "pin": triton_pin(requires), "says": sentence}}
    if not ok:
        (out / "setup.json").write_text(json.dumps(report, indent=1))
        return REFUSED
    import site

    import torch

    if torch.cuda.is_available():  # starts CUDA, so the driver's libcuda is mapped and can be named
        torch.cuda.init()
    torch_dir = Path(torch.__file__).resolve().parent
    site_dirs = [Path(p) for p in [*site.getsitepackages(), site.getusersitepackages()]]
    site_dirs = list(dict.fromkeys([torch_dir.parent, *site_dirs]))
    s = setup(out, site_dirs=site_dirs, torch_dir=torch_dir, loaded=loaded_libcuda(), torch_cuda=torch.version.cuda)
    (out / "setup.env").write_text(env_file(s.env))
    report.update(env=s.env, missing=s.missing, log=s.log)
    (out / "setup.json").write_text(json.dumps(report, indent=1))
    if s.missing:
        print(f"setup: {len(s.missing)} thing(s) missing for AOTInductor's CUDA build (above); the inductor "
              f"sections will fail to compile.", flush=True)
        return 1
    print(f"setup: exported {', '.join(s.env)} for the later sections ({out / 'setup.env'}).", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
