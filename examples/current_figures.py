"""Regenerate the "Current figures" table of BENCHMARKS.md from the runs under its "History".

Every run section under History keeps its figures in a `<!-- specc-run ... -->` block (written by
the bench scripts and `specc bench --write`). The table holds, for each configuration and prompt
set, the figure of the newest run that measured it, with that run's date and command; each older
run that a newer one measured again gets a "Superseded" line under its heading. Rewrites the file
in place; running it twice changes nothing the second time.

--withdraw "TITLE, DATE" --why "SENTENCE." marks a run found wrong after it was written: its figures
leave the table (older runs of the same configurations count again) and its section says why.

Usage: python examples/current_figures.py [FILE.md] [--check] [--withdraw "TITLE, DATE" --why "SENTENCE."]
"""
import argparse
import sys
from pathlib import Path

from specc import benchfile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", nargs="?", default=str(Path(__file__).resolve().parent.parent / "BENCHMARKS.md"))
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if the table is out of date")
    ap.add_argument("--withdraw", metavar="'TITLE, DATE'", action="append", default=[],
                    help="a run under History to withdraw (repeatable); needs --why")
    ap.add_argument("--why", help="one sentence: why the runs given with --withdraw are wrong")
    a = ap.parse_args()
    path = Path(a.path)
    if not path.is_file():
        raise SystemExit(f"{path} does not exist.")
    if a.withdraw and not (a.why or "").strip():
        raise SystemExit("--withdraw needs --why: one sentence saying what is wrong with the run.")
    text = path.read_text()
    new = benchfile.with_current_figures(text)
    for run_id in a.withdraw:
        try:
            new = benchfile.withdraw(new, run_id, a.why)
        except KeyError:
            raise SystemExit(f"{path} has no run {run_id!r} under History (give its heading: 'Title, YYYY-MM-DD').")
    if a.check:
        print(f"{path}: Current figures {'up to date' if new == text else 'out of date'}")
        return 0 if new == text else 1
    if new != text:
        path.write_text(new)
    rows = benchfile.current_figures(new)
    print(f"{path}: {len(rows)} current figures from {len(benchfile.runs(new))} runs"
          + ("" if new != text else " (already up to date)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
