"""The benchmark harness every script in examples/ uses: how a figure is measured, in one place.

docs/development.md's measurement protocol, as code: the methods compared (the *arms*) run side by
side in one process on the same prompts; warm-up calls come first and count in no figure; the run
repeats for a number of rounds, the arms' order rotating every round (A B, B A, ... for two; A B C,
B C A, C A B for three) so that the machine's drift falls on every arm alike; figures are medians,
never the best run; a run names its machine (the CPU's instruction set with it) and the command that
made it, and goes under History in BENCHMARKS.md only when asked (specc.benchfile keeps that file).

    ap = argparse.ArgumentParser(); harness.bench_args(ap, limit=10, max_new_tokens=128, rounds=3)
    res = harness.paired({"plain": run_plain, "spec": run_spec}, rounds=a.rounds,
                         items=[(x, a.max_new_tokens) for x in ids], warm=(ids[0], 8))
    tps = harness.medians(res, key=lambda r: r.stats.tokens_per_s)
    return harness.record(a, "Title", setup, harness.table(["method", "tokens/s"], rows), figures)

Results keep their shape: `res[arm][round][item]` is what the arm returned for that item in that
round, so a script can take medians per round, per prompt or over everything, and pair the arms'
values of one prompt and round. Nothing here imports torch.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

from . import benchfile

Results = dict  # arm -> [round][item] -> what the arm returned

_FIRST = object()  # paired()'s default warm-up item: the first item


# -- the command line ------------------------------------------------------------------------------

def at_least_one(text: str) -> int:
    """An argparse type: an integer of at least 1 (a count of rounds, calls, prompts or tokens), so
    every script refuses 0 alike, in argparse's one line, exit status 2."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def bench_args(parser: argparse.ArgumentParser, *, limit: int | None = None, max_new_tokens: int | None = None,
               rounds: int | None = None, calls: int | None = None, calls_help: str = "timed calls per arm per round",
               write: bool = True, json: bool = True) -> argparse.ArgumentParser:
    """Add the options the bench scripts share, each only where its default is given (a script that
    takes no prompts has no --limit): --limit, --max-new-tokens, --rounds, --calls, --write (or its
    older name --out) and --json. One spelling and one help text for all of them."""
    if limit is not None:
        parser.add_argument("--limit", type=at_least_one, default=limit,
                            help=f"the first N prompts of each set (default {limit})")
    if max_new_tokens is not None:
        parser.add_argument("--max-new-tokens", type=at_least_one, default=max_new_tokens,
                            help=f"new tokens per prompt; EOS does not stop any method (default {max_new_tokens})")
    if rounds is not None:
        parser.add_argument("--rounds", type=at_least_one, default=rounds,
                            help=f"rounds over everything timed, the order of the compared methods rotated each "
                                 f"round (default {rounds})")
    if calls is not None:
        parser.add_argument("--calls", type=at_least_one, default=calls, help=f"{calls_help} (default {calls})")
    if write:
        parser.add_argument("--write", "--out", dest="write", default=None, metavar="FILE.md",
                            help="insert this run, dated, under '## History' in FILE.md (e.g. BENCHMARKS.md) and "
                                 "regenerate its Current figures (default: write nothing; --out is the older name)")
    if json:
        parser.add_argument("--json", action="store_true",
                            help="print the results as JSON instead of markdown (a run: its figures, machine and "
                                 "command, one object)")
    return parser


# -- running the arms ------------------------------------------------------------------------------

def order(names: Sequence, k: int) -> list:
    """`names` rotated k places: round 0 runs A B C, round 1 B C A, round 2 C A B; for two arms that
    is A B, B A, A B ... Each arm runs first as often as the others, so drift does not favour one."""
    names = list(names)
    k %= len(names)
    return names[k:] + names[:k]


def warm_up(arms: Mapping[Hashable, Callable], *args, times: int = 1) -> None:
    """Call every arm `times` times with `args`, results dropped: the first calls pay for lazy
    compilation, allocation and cold caches, which no figure should include."""
    for _ in range(times):
        for fn in arms.values():
            fn(*args)


def paired(arms: Mapping[Hashable, Callable], rounds: int, *, items: Iterable | None = None, warmup: int = 1,
           warm: Any = _FIRST, warmup_rounds: int = 0, stagger: bool = False) -> Results:
    """Run the arms side by side: `warmup` calls of each on the `warm` item (default: the first
    item), then `warmup_rounds` whole rounds that are dropped (where every item must be warm: prefill
    at each prompt's length), then `rounds` rounds in which every item runs through every arm back
    to back, in order(arms, round) (with `stagger`, order(arms, round + item index): consecutive items
    start with different arms too). Without `items`, each arm is called with no argument once a round.
    Returns {arm: [round][item] -> what the arm returned}, warm-up excluded."""
    if not arms or rounds < 1 or warmup < 0 or warmup_rounds < 0:
        raise ValueError("paired() needs arms, rounds >= 1, and no negative warm-up")
    calls = [()] if items is None else [(x,) for x in items]
    if not calls:
        raise ValueError("paired() needs at least one item")
    warm_up(arms, *(calls[0] if warm is _FIRST or items is None else (warm,)), times=warmup)
    out: Results = {name: [] for name in arms}
    for rnd in range(warmup_rounds + rounds):
        got: Results = {name: [] for name in arms}
        for i, args in enumerate(calls):
            for name in order(list(arms), rnd + i if stagger else rnd):
                got[name].append(arms[name](*args))
        if rnd >= warmup_rounds:
            for name in arms:
                out[name].append(got[name])
    return out


def clock(fn: Callable, *args, **kwargs) -> tuple[Any, float]:
    """(fn's result, the seconds the call took): for an arm whose time is not in what it returns."""
    t0 = time.perf_counter()
    value = fn(*args, **kwargs)
    return value, time.perf_counter() - t0


def call_times(fn: Callable[[], Any], calls: int, warmup: int = 0) -> list[float]:
    """Seconds of each of `calls` calls of fn(), after `warmup` untimed ones: for calls long enough
    (a graph, a compiled package) that the clock's own cost is lost in them."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def mean_time(fn: Callable[[], Any], calls: int, warmup: int = 0) -> float:
    """Seconds per call over one block of `calls` calls of fn(), after `warmup` untimed ones: for calls
    of microseconds, where reading the clock around each would weigh in the figure."""
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def decode_ms_per_step(stats) -> float:
    """A generation's decode milliseconds per step, prefill excluded (specc.runtime's Stats)."""
    return 1000 * (stats.wall_s - stats.prefill_s) / stats.steps


# -- medians ---------------------------------------------------------------------------------------

def median(values: Iterable[float]) -> float:
    """The median: what every figure quotes (never the best run, never the mean of noisy times)."""
    return statistics.median(list(values))


def _key(key):
    return (lambda v: v) if key is None else key


def values(per_round: Sequence[Sequence], key: Callable | None = None) -> list:
    """One arm's [round][item] values in one list, round by round (key(value) if given): aligned
    across arms, so zip() of two arms' lists pairs the runs of one prompt in one round."""
    return [_key(key)(v) for rnd in per_round for v in rnd]


def medians(results: Results, key: Callable | None = None) -> dict:
    """{arm: the median over every round and item of key(value)}."""
    return {name: median(values(per_round, key)) for name, per_round in results.items()}


def round_medians(per_round: Sequence[Sequence], key: Callable | None = None) -> list[float]:
    """Each round's median over its items: the figure a single round would have given."""
    return [median(_key(key)(v) for v in rnd) for rnd in per_round]


def median_of_rounds(per_round: Sequence[Sequence], key: Callable | None = None) -> float:
    """The median over rounds of each round's median over items."""
    return median(round_medians(per_round, key))


def median_of_items(per_round: Sequence[Sequence], key: Callable | None = None) -> float:
    """The median over items of each item's median over rounds (a prompt's own time, then the set's)."""
    return median(median(_key(key)(rnd[i]) for rnd in per_round) for i in range(len(per_round[0])))


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Pairwise ratios of two arms' aligned values (see values): a paired comparison's figure is
    their median, and the share above 1 says how often one arm won."""
    return [a / b for a, b in zip(numerators, denominators, strict=True)]


# -- printing and recording ------------------------------------------------------------------------

def table(columns: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A markdown table: the header, the separator, a line per row (cells as given, str() of any
    other value)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows])


def machine_note(device: str = "cpu") -> str:
    """This machine in one line, the CPU's instruction set included (no bandwidth probe), for a
    script that prints figures without a run's machine line."""
    return benchfile.machine_text(benchfile.machine(device, bandwidth=False))


def record(args, title: str, setup: str, body: str, figures: Iterable[dict] = (), *, command: str | None = None,
           device: str = "cpu", **extra) -> int:
    """The end of a bench script: the run (dated, this machine, the command that made it, its
    figures and any JSON-able `extra`) printed as its BENCHMARKS.md section (or as JSON with
    --json), and inserted under History in the --write file only when one is given. Returns 0."""
    run = benchfile.new_run(title, list(figures), command=command, device=device, **extra)
    return benchfile.finish(args, run, setup, body)
