"""The benchmark harness (specc.harness) on fake arms with controlled timings: warm-up excluded, the
order rotating every round, medians, the BENCHMARKS.md writer, the CPU's instruction set named; and
the rule that keeps it the one harness: no script in examples/ takes its own medians or runs its own
rounds."""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from specc import benchfile, harness

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


class FakeClock:
    """time.perf_counter for the harness: it moves only when an arm does its 'work'."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def work(self, seconds: float):
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(harness.time, "perf_counter", fake)
    return fake


def logging_arms(names, log):
    return {n: (lambda *args, n=n: log.append((n, *args)) or (n, *args)) for n in names}


def test_order_rotates_every_arm_to_the_front():
    assert [harness.order("AB", k) for k in range(3)] == [["A", "B"], ["B", "A"], ["A", "B"]]
    assert [harness.order("ABC", k) for k in range(4)] == [list("ABC"), list("BCA"), list("CAB"), list("ABC")]


def test_paired_warms_up_then_alternates_the_order_round_by_round():
    log = []
    res = harness.paired(logging_arms("AB", log), rounds=3, items=["x", "y"], warm="w", warmup=2)
    assert log[:4] == [("A", "w"), ("B", "w"), ("A", "w"), ("B", "w")]  # the warm-up: on the warm item
    assert log[4:] == [("A", "x"), ("B", "x"), ("A", "y"), ("B", "y"),  # round 0: A B
                       ("B", "x"), ("A", "x"), ("B", "y"), ("A", "y"),  # round 1: B A
                       ("A", "x"), ("B", "x"), ("A", "y"), ("B", "y")]  # round 2: A B
    # warm-up excluded: [round][item] of what each arm returned
    assert res == {n: [[(n, "x"), (n, "y")]] * 3 for n in "AB"}


def test_paired_defaults_stagger_and_warm_rounds():
    log = []
    harness.paired(logging_arms("AB", log), rounds=1, items=["x", "y"])  # warm-up: once, on the first item
    assert log == [("A", "x"), ("B", "x"), ("A", "x"), ("B", "x"), ("A", "y"), ("B", "y")]
    log.clear()
    res = harness.paired(logging_arms("AB", log), rounds=2, items=["x", "y"], warmup=0, warmup_rounds=1,
                         stagger=True)
    # order(round + item): consecutive items start with different arms; round 0 (a warm-up round) dropped
    assert [n for n, _ in log] == list("AB" "BA" "BA" "AB" "AB" "BA")
    assert len(res["A"]) == 2 and all(len(rnd) == 2 for rnd in res["A"])
    log.clear()
    res = harness.paired(logging_arms("ABC", log), rounds=3, warmup=0)  # no items: called with no argument
    assert ["".join(n for (n,) in log[i:i + 3]) for i in (0, 3, 6)] == ["ABC", "BCA", "CAB"]
    assert res["A"] == [[("A",)]] * 3
    with pytest.raises(ValueError):
        harness.paired(logging_arms("AB", log), rounds=0)
    with pytest.raises(ValueError):
        harness.paired(logging_arms("AB", log), rounds=1, items=[])


def test_alternating_order_cancels_a_drifting_machine(clock):
    """Two arms doing the same work on a machine that slows down call by call: rotated, their medians
    agree; always in one order, the second arm would look slower."""
    calls = [0]

    def same_work():
        calls[0] += 1
        clock.work(1.0 + 0.1 * calls[0])

    arms = {name: (lambda: harness.clock(same_work)[1]) for name in ("A", "B")}
    med = harness.medians(harness.paired(arms, rounds=8, warmup=1))
    assert med["A"] == pytest.approx(med["B"])
    fixed = {"A": [], "B": []}
    for _ in range(8):
        for name in ("A", "B"):
            fixed[name].append(arms[name]())
    assert harness.median(fixed["B"]) > harness.median(fixed["A"])


def test_timers_read_the_clock_around_the_calls(clock):
    durations = iter([5.0, 1.0, 2.0, 3.0, 4.0])
    times = harness.call_times(lambda: clock.work(next(durations)), calls=4, warmup=1)
    assert times == [1.0, 2.0, 3.0, 4.0]  # the warm-up call (5 s) is not among them
    assert harness.mean_time(lambda: clock.work(2.0), calls=5, warmup=3) == pytest.approx(2.0)
    value, seconds = harness.clock(lambda x: clock.work(0.5) or x * 2, 21)
    assert (value, seconds) == (42, 0.5)


def test_medians_over_rounds_items_and_pairs():
    per_round = [[1.0, 10.0, 3.0], [2.0, 20.0, 4.0], [9.0, 30.0, 5.0]]  # [round][item]
    assert harness.values(per_round) == [1.0, 10.0, 3.0, 2.0, 20.0, 4.0, 9.0, 30.0, 5.0]
    assert harness.medians({"A": per_round}) == {"A": 5.0}
    assert harness.round_medians(per_round) == [3.0, 4.0, 9.0]
    assert harness.median_of_rounds(per_round) == 4.0
    assert harness.median_of_items(per_round) == 4.0  # items' medians: 2, 20, 4
    assert harness.median_of_items(per_round, key=lambda v: -v) == -4.0
    assert harness.ratios([2.0, 9.0], [1.0, 3.0]) == [2.0, 3.0]
    with pytest.raises(ValueError):
        harness.ratios([1.0], [1.0, 2.0])  # unaligned: not a paired comparison
    stats = SimpleNamespace(wall_s=1.0, prefill_s=0.2, steps=40)
    assert harness.decode_ms_per_step(stats) == pytest.approx(20.0)


def test_table_is_markdown():
    assert harness.table(["method", "tokens/s"], [["plain", "10.0"], ["ngram", 12]]) == (
        "| method | tokens/s |\n|---|---|\n| plain | 10.0 |\n| ngram | 12 |")


def test_bench_args_share_one_spelling():
    ap = harness.bench_args(argparse.ArgumentParser(), limit=4, max_new_tokens=64, rounds=3, calls=20)
    a = ap.parse_args([])
    assert (a.limit, a.max_new_tokens, a.rounds, a.calls, a.write, a.json) == (4, 64, 3, 20, None, False)
    assert ap.parse_args(["--out", "B.md", "--json"]).write == "B.md"  # --out: the older name of --write
    for bad in (["--rounds", "0"], ["--limit", "-1"], ["--calls", "x"]):
        with pytest.raises(SystemExit) as e:
            ap.parse_args(bad)
        assert e.value.code == 2
    bare = harness.bench_args(argparse.ArgumentParser(), rounds=2, write=False, json=False).parse_args([])
    assert vars(bare) == {"rounds": 2}  # only what the script asked for


def fake_machine(device: str = "cpu", bandwidth: bool = True) -> dict:
    m = {"platform": "x86_64", "cores": 2, "device": "CPU", "torch": "2.13.0", "threads": 2,
         "cpu": "Xeon (model 207), AMX + AVX-512"}
    return m | ({"matvec_gb_s": 21.5} if bandwidth else {})


def test_record_prints_the_run_and_writes_it_only_when_asked(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(benchfile, "machine", fake_machine)
    path = tmp_path / "BENCHMARKS.md"
    body = harness.table(["method", "tokens/s"], [["plain", "10.0"]])
    fig = benchfile.figure("ngram chain:4", "humaneval", model="M", tau=1.5, tokens_per_s=12.0, vs_plain=1.2,
                           new_tokens=64, prompts=3)
    args = argparse.Namespace(json=False, write=None)
    assert harness.record(args, "Fake run", "setup words.", body, [fig], command="python examples/x.py --rounds 1") == 0
    printed = capsys.readouterr().out
    assert not path.exists()
    assert printed.startswith(f"### Fake run, {benchfile.today()}\n") and body in printed
    assert "Machine: x86_64, 2 cores, torch 2.13.0 (CPU), 2 threads, Xeon (model 207), AMX + AVX-512" in printed
    assert "```\npython examples/x.py --rounds 1\n```" in printed

    args = argparse.Namespace(json=True, write=str(path))
    harness.record(args, "Fake run", "setup words.", body, [fig], command="python examples/x.py", extra_rows=[1])
    run = json.loads(capsys.readouterr().out)
    assert run["title"] == "Fake run" and run["extra_rows"] == [1] and run["figures"] == [fig]
    text = path.read_text()
    history = text[text.index(benchfile.HISTORY):]
    assert f"### Fake run, {benchfile.today()}" in history and body in history and "setup words." in history
    assert "AMX + AVX-512" in history and "```\npython examples/x.py\n```" in history
    assert [r["title"] for r in benchfile.runs(text)] == ["Fake run"]
    assert benchfile.current_figures(text)[0]["tokens_per_s"] == 12.0  # the Current figures table rebuilt


CPUINFO = ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel\t\t: 143\nmodel name\t: Intel(R) Xeon(R) Platinum\n"
           "flags\t\t: fpu sse2 avx avx2 {more}\n")


def test_the_cpu_is_named_with_its_instruction_set(monkeypatch):
    assert benchfile.isa(CPUINFO.format(more="avx512f avx512bw amx_tile amx_bf16")) == "AMX + AVX-512"
    assert benchfile.isa(CPUINFO.format(more="avx512f")) == "AVX-512 + AVX2"  # the two widest, as runs record
    assert benchfile.isa(CPUINFO.format(more="")) == "AVX2"
    assert benchfile.isa("flags\t: fpu sse2\n") == ""
    assert benchfile.cpu_model(CPUINFO.format(more="")) == "Intel(R) Xeon(R) Platinum (model 143), AVX2"
    # this machine: the note a script prints beside figures names the same units the run records
    note = harness.machine_note()
    assert benchfile.cpu_model() in note and "matvec" not in note  # no bandwidth probe
    monkeypatch.setattr(benchfile, "machine", fake_machine)
    assert harness.machine_note().endswith("Xeon (model 207), AMX + AVX-512")


# -- the rule: every script measures through the harness -------------------------------------------

OWN_MEASURING = {
    "statistics (medians come from specc.harness)": re.compile(r"\bstatistics\b"),
    "a rounds loop of its own": re.compile(r"\bfor\b[^\n]*\brange\([^)\n]*\brounds\b"),
    "an order swapped by hand": re.compile(r"(\[::-1\]|%\s*2\s*==\s*0|%\s*len\()[^\n]*(order|rnd|round)"
                                           r"|(order|rnd|round)[^\n]*(\[::-1\]|%\s*2\s*==\s*0|%\s*len\()"),
    "its own --rounds option": re.compile(r"add_argument\(\s*[\"']--rounds"),
    "its own warm-up loop": re.compile(r"\bfor\b[^\n]*:\s*#\s*warm"),
}
# gpu_check.py parses its options before specc may be importable (its environment report says
# whether it is), so it keeps its own --rounds and imports the harness where it times.
OWN_OPTIONS_ALLOWED = {"gpu_check.py"}


def test_no_example_measures_outside_the_harness():
    scripts = sorted(EXAMPLES.glob("*.py"))
    assert len(scripts) > 20
    offenders = []
    for script in scripts:
        text = script.read_text()
        for what, pattern in OWN_MEASURING.items():
            if what == "its own --rounds option" and script.name in OWN_OPTIONS_ALLOWED:
                continue
            offenders += [f"{script.name}: {what}: {m.group(0)!r}" for m in pattern.finditer(text)]
    assert offenders == []
    timed = [s.name for s in scripts if s.name.startswith("bench_") or "--rounds" in s.read_text()]
    assert [name for name in timed if "harness" not in (EXAMPLES / name).read_text()] == []


def test_llama_cpp_compare_reads_both_llama_cpp_timing_lines(tmp_path):
    """examples/llama_cpp_compare.py's llama.cpp arms read llama-completion's "eval time" line and
    llama-lookup's "decoded ... tokens in ... seconds" line (as those binaries print them; a stand-in
    binary prints them here), pass the draft count to llama-lookup, and refuse a run that prints no
    timing in one sentence."""
    import importlib.util
    import stat

    spec = importlib.util.spec_from_file_location("llama_cpp_compare", EXAMPLES / "llama_cpp_compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fake = tmp_path / "llama-lookup"
    fake.write_text("#!/bin/sh\n"
                    "case \"$*\" in\n"
                    "  *--spec-draft-n-max\\ 8*) echo '0.01.9 I decoded   65 tokens in    1.300 seconds, speed: 50.0 t/s' >&2;;\n"
                    "  *-no-cnv*) echo 'common_perf_print:        eval time =     500.00 ms /    50 runs   (10 ms per "
                    "token)' >&2;;\n"
                    "  *) echo 'nothing timed' >&2;;\n"
                    "esac\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    assert mod.llama_decode(fake, tmp_path / "m.gguf", "hi", 64) == pytest.approx(100.0)
    assert mod.llama_decode(fake, tmp_path / "m.gguf", "hi", 64, drafts=8) == pytest.approx(50.0)
    with pytest.raises(mod.SpeccError, match="llama-lookup failed"):
        mod.llama_decode(fake, tmp_path / "m.gguf", "hi", 64, drafts=3)
