"""How long `specc compile` takes on SmolLM2, and where the time goes: whole compiles of one or more
engine configurations, each split by phase (the manifest's compile_split, specc/compile_clock.py):
loading, the products' timing, capture and passes, lifting, Inductor's lowering, scheduling, code
generation and C++ build, saving, measuring; per graph, and which graphs came from the compile cache.

--cold compiles each round with empty compile caches (a fresh specc AOTInductor cache and Inductor
cache in a temporary directory; the converted model and the one-time C++ product build are kept,
as the shared precompiled header is): what a user's first compile costs. Without it the caches
stay as they are (a warm recompile, once a round has filled them).

Usage: python examples/bench_compile.py [--engines ngram-chain4,demo,dspark,int8] [--cold]
           [--rounds 1] [--json] [--write BENCHMARKS.md]
"""
import argparse
import contextlib
import itertools
import os
import shutil
import tempfile
from pathlib import Path

import specc
from specc import harness
from specc.manifest import read
from specc.models import cache_dir, quiet_libraries

# The engines the issue of compile time names: options of specc.compile (all SmolLM2, inductor).
ENGINES = {
    "ngram-chain4": dict(drafter="ngram", tree="chain:4"),
    "demo": dict(drafter="ngram", tree="chain:8", adaptive=True),  # examples/demo.py's default engine
    "dspark": dict(drafter="dspark", tree="chain:4"),
    "int8": dict(drafter="ngram", tree="chain:4", quant="int8"),
}
# The phases in the order a compile runs them (specc/compile_clock.py); others follow.
ORDER = ["load", "tree", "products", "capture", "lift", "lowering", "scheduling", "codegen", "cpp_build",
         "inductor_other", "lower", "save", "tensorrt", "measure"]


@contextlib.contextmanager
def cold_caches():
    """Empty AOTInductor and Inductor caches for the block; the converted models and the C++ products kept."""
    keep = {"SPECC_CACHE": os.environ.get("SPECC_CACHE"), "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}
    real = cache_dir()
    with tempfile.TemporaryDirectory(prefix="specc-cold-") as tmp:
        for sub in ("models", "cpp"):
            if (real / sub).exists():
                os.symlink(real / sub, Path(tmp) / sub)
        os.environ["SPECC_CACHE"], os.environ["TORCHINDUCTOR_CACHE_DIR"] = tmp, str(Path(tmp) / "inductor")
        try:
            yield
        finally:
            for k, v in keep.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def compile_once(name: str, options: dict, cold: bool, max_len: int, modes: str, out: Path) -> dict:
    """One compile of engine `name`: its compile_split, with the number of graphs it holds."""
    with cold_caches() if cold else contextlib.nullcontext():
        path, seconds = harness.clock(specc.compile, None, backend="inductor", output_dir=out, max_len=max_len,
                                      modes=modes, progress=False, **options)
    m = read(path)
    shutil.rmtree(out)
    return {**m.compile_split, "seconds": round(seconds, 1), "engine_graphs": len(m.graphs)}


def phase_order(splits: list[dict]) -> list[str]:
    seen = {p for s in splits for p in s["phases"]}
    return [p for p in ORDER if p in seen] + sorted(seen - set(ORDER))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="ngram-chain4", help=f"comma-separated, of {', '.join(ENGINES)}")
    ap.add_argument("--cold", action="store_true", help="empty compile caches for every round")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--modes", default="greedy")
    harness.bench_args(ap, rounds=1)
    a = ap.parse_args()
    names = [n for n in a.engines.split(",") if n]
    unknown = [n for n in names if n not in ENGINES]
    if unknown:
        ap.error(f"unknown engine {unknown[0]!r}; choose from {', '.join(ENGINES)}")
    quiet_libraries()
    with tempfile.TemporaryDirectory() as tmp:
        rounds = {name: itertools.count(1) for name in names}

        def arm(name: str):
            def compile_round() -> dict:
                r = next(rounds[name])
                s = compile_once(name, ENGINES[name], a.cold, a.max_len, a.modes, Path(tmp) / f"{name}-{r}")
                print(f"{name} round {r}: {s['seconds']:.0f} s, {s['engine_graphs']} graphs ({len(s['graphs'])} "
                      f"lowered with the products' timing, {s['cache_hits']} from the cache)", flush=True)
                return s
            return compile_round

        results = harness.paired({name: arm(name) for name in names}, a.rounds, warmup=0)
    runs = {name: harness.values(results[name]) for name in names}
    splits = [s for rs in runs.values() for s in rs]
    phases = phase_order(splits)
    rows = []
    for name, rs in runs.items():
        med = {p: harness.median([s["phases"].get(p, 0.0) for s in rs]) for p in phases}
        total = harness.median([s["seconds"] for s in rs])
        # a graph's own seconds, of the graphs Inductor compiled (not those the cache held)
        lowered = [sum(v for k, v in g.items() if k != "cached") for s in rs for g in s["graphs"].values()
                   if not g.get("cached")]
        per_graph = f"{harness.median(lowered):.0f}" if lowered else "-"
        rows.append([name, rs[-1]["engine_graphs"], len(rs[-1]["graphs"]), rs[-1]["cache_hits"], f"{total:.0f}",
                     per_graph, *(f"{med[p]:.0f}" for p in phases)])
    cache = "empty compile caches (cold)" if a.cold else "compile caches as they were (warm after a first round)"
    setup = (f"SmolLM2-135M-Instruct, inductor backend, --max-len {a.max_len}, modes {a.modes}; {cache}; "
             f"{a.rounds} round(s), medians. Graphs: the engine's; built: with the products' timing graphs "
             "(a float32 CPU engine times its few-row products both ways on two graphs, specc/products.py). "
             "Phases in seconds (specc/compile_clock.py): Inductor's lowering, scheduling, codegen and cpp_build "
             "are torch's own timers; lower is the rest of a graph's lowering.")
    body = harness.table(["engine", "graphs", "built (with timing)", "from cache", "total s",
                          "median s per compiled graph", *phases],
                         rows)
    return harness.record(a, "Compile time by phase", setup, body, figures=[],
                          engines={n: {k: v for k, v in rs[-1].items() if k != "graphs"} for n, rs in runs.items()})


if __name__ == "__main__":
    raise SystemExit(main())
