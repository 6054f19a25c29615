"""The package's shape (docs/how-it-works.md, "The pipeline"), checked on the source itself:
kernels/ does not shadow Hugging Face's `kernels`, no import cycles, no private names imported
across modules, no long functions, no drafter branching outside the drafter kinds."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"specc": ROOT / "specc", "specc.passes": ROOT / "passes", "specc.kernels": ROOT / "kernels"}


def modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name."""
    out = {}
    for prefix, folder in PACKAGE_DIRS.items():
        for f in sorted(folder.rglob("*.py")):
            parts = list(f.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([prefix, *parts])
            if name.startswith("specc.") and name.split(".")[1] in ("passes", "kernels") and prefix == "specc":
                continue
            out[name] = f
    return out


def resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """(imported module, names) for every import in the module, those inside functions included: a
    cycle hidden behind a function-level import is still a cycle."""
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import):
            out += [(a.name, []) for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            mod = resolve(name, path.name == "__init__.py", n.level, n.module)
            out.append((mod, [a.name for a in n.names]))
    return out


def test_repository_root_does_not_shadow_hf_kernels():
    """From the repository root (where a top-level `kernels` folder is found on sys.path) transformers
    still imports and runs a model, `import kernels` is Hugging Face's package wherever that is
    installed (transformers >= 5.25 depends on it and imports it), and specc.kernels registers its ops."""
    code = ("import importlib.machinery, os, transformers, torch; "
            "from transformers.utils.import_utils import is_kernels_available; "
            "from transformers import LlamaConfig, LlamaForCausalLM; "
            "c = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, "
            "num_attention_heads=2, num_key_value_heads=1); "
            "assert LlamaForCausalLM(c)(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 64); "
            "import specc.kernels, specc.acceptance; "
            "assert torch.ops.specc.tree_accept_greedy is not None; "
            "import kernels; "
            "ours = os.path.realpath(kernels.__file__) == os.path.realpath('kernels/__init__.py'); "
            "assert not (ours and is_kernels_available()); "
            "spec = importlib.machinery.PathFinder.find_spec('kernels'); "
            "print('shadowed' if spec is not None and os.path.realpath(spec.origin) == "
            "os.path.realpath('kernels/__init__.py') else 'clean')")
    for flags in ([], ["-P"]):  # -P: the root is not put on sys.path (how the tests run)
        proc = subprocess.run([sys.executable, *flags, "-c", code], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip() == ("clean" if flags else "shadowed")


def test_tests_run_without_the_root_on_sys_path():
    assert str(ROOT) not in [str(Path(p).resolve()) for p in sys.path if p]


def test_no_import_cycles():
    mods = modules()
    def targets(name, path):  # `from pkg import mod` imports pkg.mod
        for m, names in imports(name, path):
            yield from ([f"{m}.{n}" for n in names if f"{m}.{n}" in mods] or [m])

    graph = {name: sorted({m for m in targets(name, path) if m in mods and m != name}) for name, path in mods.items()}

    def parents(m):  # importing a.b.c imports a and a.b first
        parts = m.split(".")
        return [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in mods]

    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(m, trail):
        if state.get(m) == 1:
            cycle.extend(trail[trail.index(m):])
            return True
        if state.get(m) == 2:
            return False
        state[m] = 1
        for d in graph[m]:
            if d not in parents(m) and visit(d, trail + [d]):
                return True
        state[m] = 2
        return False

    for m in mods:
        if visit(m, [m]):
            break
    assert not cycle, " -> ".join(cycle)


def test_no_private_names_imported_across_modules():
    bad = []
    for name, path in modules().items():
        for mod, names in imports(name, path):
            if mod.split(".")[0] in ("specc", "passes", "kernels"):
                bad += [f"{name}: from {mod} import {n}" for n in names if n.startswith("_") and n != "__version__"]
    assert bad == []


def _long_functions(limit: int = 80) -> list[str]:
    out = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                jit = any("jit" in ast.unparse(d) for d in node.decorator_list)  # Triton kernels are exempt
                if not jit and node.end_lineno - node.lineno + 1 > limit:
                    out.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    return out


def test_no_function_over_80_lines():
    assert _long_functions() == []


def test_compile_and_load_fit_on_one_screen():
    tree = ast.parse((ROOT / "specc" / "compiler.py").read_text())
    sizes = {n.name: n.end_lineno - n.lineno + 1 for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert sizes["compile"] <= 80 and sizes["load"] <= 80, sizes


@pytest.mark.parametrize("kind", ["none", "ngram", "draft-model", "mtp", "dflash", "dspark"])
def test_no_drafter_branching_outside_the_kinds(kind):
    """A drafter's name is compared only inside its kind module (and the registry)."""
    pattern = re.compile(r"""(==|!=|\bin\b)\s*\(?[^)\n]*["']""" + re.escape(kind) + r"""["']""")
    hits = []
    for name, path in modules().items():
        if name.startswith("specc.drafters") or name in ("specc.cli", "specc.shipped"):
            continue  # the kinds themselves; the CLI's and the shipped drafters' own choices
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line) and not line.lstrip().startswith("#"):
                hits.append(f"{name}:{i}: {line.strip()}")
    assert hits == []


# What specc/train.py's loop, evaluation and TrainConfig ask of a trainer (specc/drafters/__init__.py).
TRAINER_METHODS = ("loss", "accepted", "shorter_blocks", "parameters", "named_parameters", "save", "load")
TRAINER_CONSTANTS = ("BLOCK_SIZE", "MIN_BLOCK", "READS_TAPS", "READS_HIDDEN", "PACKS")
# Every kind, and whether `specc train` trains it (a new kind is listed here).
TRAINED = {"none": False, "ngram": False, "draft-model": False, "mtp": True, "dflash": True, "dspark": True}


def test_every_kind_implements_the_protocol():
    from specc.drafters import KINDS
    from specc.train import DRAFTERS, trainer_of

    constants = ("NAME", "DEFAULT_TREE", "DRAFTS", "FILLS_TREES", "MEASURED_TREES", "SAMPLED_CHILDREN", "OPTIONS",
                 "TRAINER")
    functions = ("check", "load", "entry", "save", "load_saved", "taps", "module", "plans", "runtime")
    assert set(KINDS) == set(TRAINED)
    for name, kind in KINDS.items():
        assert kind.NAME == name
        assert all(hasattr(kind, c) for c in constants), name
        assert all(callable(getattr(kind, f, None)) for f in functions), name
        if kind.MEASURED_TREES:
            assert callable(getattr(kind, "calibration_depth", None)), name
        trainer = kind.TRAINER  # the one registry of trainers: `specc train` finds them here
        assert (trainer is not None) == TRAINED[name] == (name in DRAFTERS) and trainer_of(name) is trainer, name
        if trainer is not None:
            assert isinstance(trainer, type), name
            assert all(callable(getattr(trainer, m, None)) for m in TRAINER_METHODS), name
            assert all(hasattr(trainer, c) for c in TRAINER_CONSTANTS), name
            assert 1 <= trainer.MIN_BLOCK <= trainer.BLOCK_SIZE, name


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    files = [ROOT / f for f in out.stdout.splitlines()]
    return [f for f in files if f.is_file() and f.suffix in (".py", ".md", ".sh", ".toml", ".cpp", ".txt", "")
            and f.stat().st_size < 2 << 20]


def test_nothing_refers_outside_the_repository():
    """The documentation lives in the repository: no file points at design notes kept beside it."""
    outside = re.compile(r"DESIGN\.md|REFERENCE\.md|\.\./shared\b")
    offenders = [str(f.relative_to(ROOT)) for f in tracked_text_files()
                 if f.name != "test_layout.py" and outside.search(f.read_text(errors="replace"))]
    assert not offenders, offenders


def test_readme_is_short_and_every_documentation_link_resolves():
    """README.md: the two commands, what specc is, a quick start, where to read more (about 150 lines at
    most); every relative link of README, docs/ and BENCHMARKS.md names a file that exists."""
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 150
    top = "\n".join(readme.read_text().splitlines()[:8])
    assert "make demo" in top and "make test" in top  # the two commands first
    for doc in [readme, ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links to missing {target}"


BACKEND_MODULES = ("specc.backends", "specc.onnx_backend", "specc.tensorrt", "specc.trt_lint", "specc.bench")


@pytest.mark.parametrize("name", ["eager", "inductor", "onnx", "tensorrt"])
def test_no_backend_branching_outside_the_backends(name):
    """A backend's name is compared only in the backends' own modules: elsewhere its capabilities are
    looked up (backends.Backend)."""
    pattern = re.compile(r"""(==|!=|\bin\b)\s*\(?[^)\n]*["']""" + re.escape(name) + r"""["']""")
    hits = [f"{mod}:{i}: {line.strip()}" for mod, path in modules().items() if mod not in BACKEND_MODULES
            for i, line in enumerate(path.read_text().splitlines(), 1)
            if pattern.search(line) and not line.lstrip().startswith("#")]
    assert hits == []


def test_every_backend_implements_the_protocol():
    from specc.backends import KINDS, Backend
    from specc.quant import WEIGHT_FORMATS

    for name, backend in KINDS.items():
        assert isinstance(backend, Backend) and backend.name == name
        assert callable(backend.lower) and callable(backend.open) and callable(backend.passes)
        assert backend.products in ("all", "verify", "none") and set(backend.devices) <= {"cpu", "cuda"}
        assert set(backend.weights) <= set(WEIGHT_FORMATS)
        assert all(w in backend.weight_refusal for w in WEIGHT_FORMATS if w not in backend.weights)


@pytest.mark.parametrize("name", ["int8", "int4", "gguf", "none"])
def test_no_quant_branching_outside_the_quant_kinds(name):
    """A quantization is a config object with a handler (specc/quant.py): elsewhere its name is never
    compared; code asks the config (its `weights`, its `block_formats`) instead."""
    pattern = re.compile(r"""quant\w*\s*(==|!=|\bin\b)\s*\(?[^)\n]*["']""" + re.escape(name) + r"""["']""")
    hits = [f"{mod}:{i}: {line.strip()}" for mod, path in modules().items() if mod != "specc.quant"
            for i, line in enumerate(path.read_text().splitlines(), 1)
            if pattern.search(line) and not line.lstrip().startswith("#")]
    assert hits == []


def test_a_wheel_would_hold_every_package_and_data_file():
    """pyproject lists packages by hand (two of them come from top-level folders): every folder with an
    __init__.py, and the kernels' C++ sources, must be in it, or a non-editable install breaks."""
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join([prefix, *f.parent.relative_to(folder).parts])
             for prefix, folder in PACKAGE_DIRS.items() for f in folder.rglob("__init__.py")}
    assert set(tool["packages"]) == found
    assert {k: str(v) for k, v in tool["package-dir"].items()} == {"specc.passes": "passes", "specc.kernels": "kernels"}
    data = tool["package-data"]
    for f in (ROOT / "kernels").iterdir():
        if f.suffix not in (".py", ".pyc") and f.is_file():
            assert any(f.match(pattern) for pattern in data.get("specc.kernels", [])), f.name
