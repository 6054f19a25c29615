"""BENCHMARKS.md bookkeeping: runs go under History newest first, Current figures is rebuilt from them,
and the machine line says what makes runs of different days comparable."""
import pytest

from specc import benchfile


def _run(date, tps, config="ngram chain:4", threads=2):
    fig = benchfile.figure(config, "humaneval", model="M", tau=1.5, tokens_per_s=tps, vs_plain=tps / 10,
                           new_tokens=64, prompts=3)
    return {"title": "Run", "date": date, "command": f"python bench.py --{date}", "figures": [fig],
            "machine": {"platform": "x86_64", "cores": 2, "device": "CPU", "torch": "2.13.0", "threads": threads,
                        "cpu": "Xeon (model 207), AMX + AVX-512", "matvec_gb_s": 21.5}}


def test_runs_newest_first_and_current_figures_from_the_newest(tmp_path):
    path = tmp_path / "B.md"
    benchfile.write_run(path, _run("2026-12-01", 12.0), "setup", "body one")
    benchfile.write_run(path, _run("2026-12-02", 15.0), "setup", "body two")
    text = path.read_text()
    assert [r["date"] for r in benchfile.runs(text)] == ["2026-12-02", "2026-12-01"]
    current = benchfile.current_figures(text)
    assert [(f["tokens_per_s"], f["date"]) for f in current] == [(15.0, "2026-12-02")]
    assert "Superseded" in text.split("### Run, 2026-12-01")[1]
    assert benchfile.with_current_figures(text) == text  # idempotent


def test_machine_line_names_the_cpu_and_the_bandwidth_of_the_day():
    m = _run("2026-12-02", 1.0)["machine"]
    assert benchfile.machine_text(m) == ("x86_64, 2 cores, torch 2.13.0 (CPU), 2 threads, Xeon (model 207), "
                                         "AMX + AVX-512, matvec 21.5 GB/s")
    # Neither the CPU nor the bandwidth is part of the key: older runs recorded neither.
    assert benchfile.machine_key(m) == "x86_64, 2 cores, CPU"
    assert benchfile.matvec_gb_s(mb=16, reps=3) > 0
    assert benchfile.cpu_model()


def test_a_withdrawn_run_leaves_the_table_and_says_why(tmp_path):
    path = tmp_path / "B.md"
    benchfile.write_run(path, _run("2026-12-01", 12.0), "setup", "body one")
    benchfile.write_run(path, _run("2026-12-02", 25.0), "setup", "body two")
    text = benchfile.withdraw(path.read_text(), "Run, 2026-12-02", "Its plain baseline ran a slower product.")
    # The older run counts again, no longer superseded; the withdrawn one keeps its figures and says why.
    assert [(f["tokens_per_s"], f["date"]) for f in benchfile.current_figures(text)] == [(12.0, "2026-12-01")]
    newer, older = text.split("### Run, 2026-12-02")[1].split("### Run, 2026-12-01")
    assert "> **Withdrawn**: Its plain baseline ran a slower product." in newer and "Superseded" not in older
    assert [r["date"] for r in benchfile.runs(text, withdrawn=True)] == ["2026-12-02", "2026-12-01"]
    assert "2.50x" not in text.split("### Run")[0] and "1.20x" in text.split("### Run")[0]
    assert benchfile.with_current_figures(text) == text  # idempotent
    path.write_text(text)  # a new run of the same day and title gets a new number, not the withdrawn one's
    benchfile.write_run(path, _run("2026-12-02", 14.0), "setup", "body three")
    assert "### Run 2, 2026-12-02" in path.read_text()
    with pytest.raises(KeyError):
        benchfile.withdraw(text, "Run, 2026-11-30", "no such run")
