"""Where a compile's time goes: seconds per phase, per graph, and which graphs the compile cache held.

`specc compile` runs under one CompileClock (`clocked`); the compiler and the backends add to the
active clock (`add`, `phase`) without passing it around. Inductor's own split of a graph's lowering
(GraphLowering.run: the FX graph to Inductor's IR; the scheduler's fusion; code generation; the C++
build of the generated wrapper and kernels) is read from the timers torch keeps for its compiles
(torch._dynamo.utils.compilation_time_metrics), as differences around each lowering; a torch
without them reports the lowering as one figure. The manifest keeps the result
(`compile_split`), `specc compile --json` prints it and examples/bench_compile.py tabulates it.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

# torch's timer names -> ours (AotCodeCompiler.compile: every g++ run of the AOTInductor package)
INDUCTOR_TIMERS = {"GraphLowering.run": "lowering", "Scheduler.__init__": "scheduling",
                   "Scheduler.codegen": "codegen", "AotCodeCompiler.compile": "cpp_build"}


@dataclass
class CompileClock:
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds, the whole compile
    graphs: dict[str, dict] = field(default_factory=dict)  # graph -> {phase: seconds, "cached": bool}
    started: float = field(default_factory=time.perf_counter)
    current: str | None = None  # the graph being built (`building`): phases are its phases too

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        if self.current is not None:
            g = self.graphs.setdefault(self.current, {})
            g[phase] = g.get(phase, 0.0) + seconds

    def as_json(self) -> dict:
        """{"total_s", "phases": {phase: s}, "graphs": {name: {phase: s, "cached"}}, "cache_hits"}"""
        def rounded(d: dict) -> dict:
            return {k: round(v, 2) if isinstance(v, float) else v for k, v in d.items()}
        return {"total_s": round(time.perf_counter() - self.started, 2), "phases": rounded(self.phases),
                "graphs": {k: rounded(v) for k, v in self.graphs.items()},
                "cache_hits": sum(1 for g in self.graphs.values() if g.get("cached"))}


_active: list[CompileClock] = []


@contextlib.contextmanager
def clocked():
    """Make a fresh clock the active one for the block (nested compiles, as calibration's, get their own)."""
    clock = CompileClock()
    _active.append(clock)
    try:
        yield clock
    finally:
        _active.pop()


def add(phase: str, seconds: float) -> None:
    if _active:
        _active[-1].add(phase, seconds)


def mark_cached(cached: bool) -> None:
    """Whether the graph being built took its package from the compile cache (no lowering ran)."""
    if _active and _active[-1].current is not None:
        _active[-1].graphs.setdefault(_active[-1].current, {})["cached"] = cached


@contextlib.contextmanager
def building(graph: str):
    """The phases inside the block are `graph`'s (as well as the compile's)."""
    clock = _active[-1] if _active else None
    outer = clock.current if clock else None
    if clock:
        clock.current = graph
    try:
        yield
    finally:
        if clock:
            clock.current = outer


@contextlib.contextmanager
def phase(name: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        add(name, time.perf_counter() - t0)


def _inductor_timers() -> dict[str, float]:
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # a torch without the timers: the lowering stays one figure
        return {}
    return {k: sum(compilation_time_metrics.get(k, ())) for k in INDUCTOR_TIMERS}


@contextlib.contextmanager
def remainder(name: str):
    """Time the block as `name`, less the phases added inside it (so that the phases add up)."""
    clock = _active[-1] if _active else None
    inner, t0 = (sum(clock.phases.values()) if clock else 0.0), time.perf_counter()
    try:
        yield
    finally:
        if clock:
            add(name, max(0.0, time.perf_counter() - t0 - (sum(clock.phases.values()) - inner)))


@contextlib.contextmanager
def inductor_phases(rest: str = "inductor_other"):
    """Time an AOTInductor compile: Inductor's own phases by their timers, the remainder as `rest`
    (tracing for Inductor, packaging)."""
    before = _inductor_timers()
    with remainder(rest):
        try:
            yield
        finally:
            after = _inductor_timers()
            for k in after:
                add(INDUCTOR_TIMERS[k], after[k] - before[k])
