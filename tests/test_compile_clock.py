"""The compile clock (specc/compile_clock.py): phases add up, graphs get their own, nothing leaks out."""
import time

from specc import compile_clock


def test_phases_add_up_and_graphs_get_their_share():
    with compile_clock.clocked() as clock:
        with compile_clock.phase("load"):
            time.sleep(0.02)
        with compile_clock.building("plain"), compile_clock.remainder("lower"):
            with compile_clock.phase("lift"):
                time.sleep(0.03)
            time.sleep(0.01)
            compile_clock.mark_cached(True)
        with compile_clock.building("step"), compile_clock.remainder("lower"):
            compile_clock.mark_cached(False)
            with compile_clock.inductor_phases():  # no Inductor compile ran: its timers add nothing
                time.sleep(0.01)
        compile_clock.add("outside", 0.5)  # no graph being built: the compile's only
    split = clock.as_json()
    assert set(split["graphs"]) == {"plain", "step"} and split["cache_hits"] == 1
    plain = split["graphs"]["plain"]
    assert plain["cached"] is True and plain["lift"] >= 0.03
    assert 0.005 <= plain["lower"] < 0.03  # the remainder: the lift is not counted twice
    assert split["graphs"]["step"]["inductor_other"] >= 0.01
    assert split["phases"]["outside"] == 0.5 and "outside" not in plain
    assert sum(split["phases"].values()) - 0.5 <= split["total_s"] + 0.01
    # after the block no clock is active: adding is a no-op, not an error
    compile_clock.add("late", 1.0)
    assert "late" not in clock.phases


def test_nested_clocks_are_separate():
    with compile_clock.clocked() as outer:
        with compile_clock.phase("tree"):
            with compile_clock.clocked() as inner:  # calibration's own compile
                compile_clock.add("capture", 2.0)
        compile_clock.add("capture", 1.0)
    assert inner.phases == {"capture": 2.0}
    assert outer.phases["capture"] == 1.0 and outer.phases["tree"] < 1.0
