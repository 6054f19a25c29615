"""Adaptive verification (specc/adaptive.py): the choice of step graph, the ngram drafter's
confidences against a brute-force count, and adaptive engines end to end (ngram: host drafts and
step graphs; DSpark: a family of fused steps chosen from its confidence head): greedy identity, the
manifest's family, `specc inspect`. The sampling tests are in test_sampling.py."""
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import specc
from specc.adaptive import (FRESH, MIN_TIMED, REFRESH, REST_MAX, WINDOW, StepClock, bucket, choose, expected_tokens,
                            next_rest_run, prefix, rates_from_counts, step_name)
from specc.drafters.ngram import ngram_confidences, ngram_continuations, ngram_tree_drafts
from specc.errors import SpeccError
from specc.tree import chain, parse_tree
from tiny import tiny_model

LATENCY = [1.0, 1.3, 1.6, 1.9]  # plain, 2, 3, 4 nodes
RATES = [[0.1, 0.3, 0.5, 0.7, 0.9, 0.95]]  # one class, by confidence bucket


def test_choice_follows_confidence():
    tree = chain(3)
    assert choose(tree, LATENCY, RATES, (0, [0.0, 0.0, 0.0])) == 1  # no evidence: plain decoding
    assert choose(tree, LATENCY, RATES, (0, [0.5, 0.5, 0.5])) == 2
    assert choose(tree, LATENCY, RATES, (0, [0.9, 0.9, 0.9])) == 4  # sure: the whole chain
    assert choose(tree, LATENCY, RATES, (0, [0.9, 0.0, 0.0])) == 2  # sure of the first draft only
    # Flat latencies (a GPU's c(T) ~ 1): any evidence at all pays for the whole tree.
    assert choose(tree, [1.0] * 4, RATES, (0, [0.0, 0.0, 0.0])) == 4
    # The class picks the row: the same numbers from a weaker kind of match verify less.
    two = [[0.05] * 6, RATES[0]]
    assert choose(tree, LATENCY, two, (0, [0.9, 0.9, 0.9])) == 1 and choose(tree, LATENCY, two, (1, [0.9] * 3)) == 4


def test_choice_with_a_class_per_node():
    """DSpark's classes are the nodes' sibling ranks: the same confidence on a second-ranked child
    reads that rank's (lower) rates."""
    tree = parse_tree("topk:1,2")  # root; children ranked 0 and 1
    table = [RATES[0], [0.05] * 6]
    assert choose(tree, LATENCY[:3], table, ([0, 1], [0.9, 0.9])) == 2  # the rank-1 child does not pay
    assert choose(tree, LATENCY[:3], [RATES[0]] * 2, ([0, 1], [0.9, 0.9])) == 3
    assert choose(tree, LATENCY[:3], table, ([0, 1], [0.0, 0.9])) == 1


def test_choice_may_rest_a_fused_drafter():
    """A fused family's members all pay for the drafter; k = 0 is the plain graph without it, chosen
    when no member's expected tokens per millisecond beat one token per rest_ms (a tie rests)."""
    tree = parse_tree("topk:1,2")
    table = [RATES[0]] * 2
    assert choose(tree, LATENCY[:3], table, ([0, 1], [0.0, 0.0]), rest_ms=0.95) == 0
    assert choose(tree, LATENCY[:3], table, ([0, 1], [0.9, 0.9]), rest_ms=0.95) == 3
    assert choose(tree, LATENCY[:3], table, ([0, 1], [0.0, 0.0]), rest_ms=1.0) == 0  # tie with fused1
    assert choose(tree, LATENCY[:3], table, ([0, 1], [0.0, 0.0]), rest_ms=1.2) == 1
    # The backoff between probes of a resting drafter: 1, 2, 4 ... REST_MAX plain steps.
    runs = [next_rest_run(0)]
    while len(runs) < 8:
        runs.append(next_rest_run(runs[-1]))
    assert runs == [1, 2, 4, 8, 16, 32, 32, 32] and REST_MAX == 32


def test_expected_tokens_of_a_tree_prefix():
    tree = parse_tree("topk:2,2")  # root; two children; their two children each
    rates = [1.0] + [0.5] * (tree.size - 1)
    assert expected_tokens(tree, rates, 1) == 1.0
    assert expected_tokens(tree, rates, 3) == pytest.approx(1 + 0.5 + 0.5)
    assert expected_tokens(tree, rates, tree.size) == pytest.approx(1 + 2 * 0.5 + 4 * 0.25)
    for k in range(1, tree.size + 1):  # every prefix is a tree, its nodes in the same order
        sub = prefix(tree, k)
        assert sub.paths == tree.paths[:k] and sub.parents == tree.parents[:k]
    assert [step_name(k, 4) for k in range(1, 5)] == ["plain", "step2", "step3", "step"]


def test_step_clock_estimates_from_the_times_it_measured():
    """A member's own median once timed MIN_TIMED times; the others their compiled latency scaled
    by the median ratio of timed to compiled; the last WINDOW times; times older than FRESH steps
    no longer count (a slow spell does not stick to the member that ran through it); a member
    untimed for REFRESH steps comes up to be timed again; a fused family's rest is a member of its
    own."""
    entry = {"graphs": ["plain", "step2", "step3", "step"], "latency_ms": [10.0, 12.0, 14.0, 16.0]}
    clock = StepClock(entry)
    assert clock.latency_ms == entry["latency_ms"] and clock.rest_ms is None and clock.stale() is None
    for _ in range(MIN_TIMED - 1):
        clock.record("plain", 5.0)
    assert clock.latency_ms == entry["latency_ms"]  # too few times yet
    clock.record("plain", 5.0)
    assert clock.latency_ms == [5.0, 6.0, 7.0, 8.0]  # plain runs at half its compiled time: so do the others
    for _ in range(MIN_TIMED):
        clock.record("step3", 21.0)
    assert clock.latency_ms == [5.0, 12.0, 21.0, 16.0]  # ratios 0.5 and 1.5: the untimed keep their own
    clock.record("prefill", 99.0)  # not a member: counts a step, times nothing
    assert clock.latency_ms == [5.0, 12.0, 21.0, 16.0]
    for _ in range(WINDOW):
        clock.record("plain", 3.0)
    assert clock.latency_ms[0] == 3.0  # the older times left the window
    assert clock.latency_ms[2] == 21.0
    for _ in range(FRESH):
        clock.record("plain", 3.0)
    assert clock.latency_ms == pytest.approx([3.0, 3.6, 4.2, 4.8])  # step3's times went stale
    assert clock.stale() is None
    while clock.steps - clock.last["step2"] < REFRESH:
        clock.record("plain", 3.0)
    assert clock.stale() == 2  # step2 was never timed
    clock.record("step2", 6.0)
    assert clock.stale() == 4  # then the whole tree, never timed either
    fused = StepClock({"graphs": ["fused1", "fused"], "latency_ms": [2.0, 3.0], "rest_ms": 1.0})
    assert fused.latency_ms == [2.0, 3.0] and fused.rest_ms == 1.0
    for _ in range(MIN_TIMED):
        fused.record("plain", 4.0)  # the drafter resting: its plain steps
    assert fused.rest_ms == 4.0 and fused.latency_ms == [8.0, 12.0]


def test_rates_and_buckets():
    assert rates_from_counts([[0, 8]], [[0, 8]]) == [[0.5, 0.9]]
    assert bucket(0.0) == 0 and bucket(1.0) == len(RATES[0]) - 1
    assert all(bucket(a) <= bucket(b) for a, b in zip(np.linspace(0, 1, 50), np.linspace(0, 1, 50)[1:]))


def brute_confidences(tokens: list[int], tree, drafts, max_ngram, min_ngram, cap):
    n = len(tokens)
    for size in range(min(max_ngram, n - 1), min_ngram - 1, -1):
        ends = [i + size for i in range(n - size) if tokens[i: i + size] == tokens[n - size:]][::-1][:cap]
        if ends:
            break
    else:
        return 0, [0.0] * (tree.size - 1)
    paths = {0: ()}
    out = []
    for i in range(1, tree.size):
        paths[i] = paths[tree.parents[i]] + (drafts[i - 1],)
        agree = lambda p: sum(tuple(tokens[e: e + len(p)]) == p for e in ends)  # noqa: E731
        out.append(agree(paths[i]) / (agree(paths[tree.parents[i]]) + 1))
    return size - 1, out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=40), st.sampled_from(["chain:3", "topk:2,2", "topk:3,1"]))
def test_ngram_confidences_match_a_brute_force_count(tokens, spec):
    from specc.drafters.ngram import MAX_OCCURRENCES

    tree = parse_tree(spec)
    arr = np.array(tokens, dtype=np.int64)
    drafts = ngram_tree_drafts(ngram_continuations(arr, tree.max_depth, 4, 1), tree, tokens[-1])
    cls, got = ngram_confidences(arr, tree, drafts, 4, 1)
    want_cls, want = brute_confidences(tokens, tree, drafts, 4, 1, MAX_OCCURRENCES)
    assert cls == want_cls and got == pytest.approx(want)
    assert all(0.0 <= c < 1.0 for c in got) and 0 <= cls < 4


@pytest.fixture(scope="module")
def adaptive_engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("adaptive")
    tiny_model("llama", vocab=64, layers=2, seed=0, scale=4.0).save_pretrained(root / "target")
    path = specc.compile(root / "target", drafter="ngram", tree="chain:3", backend="eager", adaptive=True,
                         output_dir=root / "engine", max_len=128, prefill_chunk=4, progress=False, modes="greedy")
    return path


def test_adaptive_engine_is_greedy_identical_and_records_its_choices(adaptive_engine):
    manifest = json.loads((adaptive_engine / "specc.json").read_text())
    fam = manifest["adaptive"]
    assert fam["sizes"] == [1, 2, 3, 4] and fam["graphs"] == ["plain", "step2", "step3", "step"]
    assert len(fam["latency_ms"]) == 4 and all(t > 0 for t in fam["latency_ms"])
    assert sum(map(sum, fam["seen"])) > 0 and len(fam["rates"]) == len(fam["seen"]) == 4  # by matched length
    assert manifest["drafter"]["min_ngram"] == 1  # adaptive: any match drafts, the rates decide
    assert {"step2_greedy", "step3_greedy", "step_greedy", "plain_greedy"} <= set(manifest["graphs"])
    engine = specc.load(adaptive_engine)
    engine.adaptive = {**engine.adaptive, "latency_ms": LATENCY, "rates": RATES * 4}
    prompt = [3, 5, 2, 7, 9, 3, 5, 2, 7, 9, 3, 5, 2, 11, 4]
    plain = engine.generate(prompt, max_new_tokens=48, stop_at_eos=False, speculate=False)
    fast = engine.generate(prompt, max_new_tokens=48, stop_at_eos=False)
    assert fast.token_ids == plain.token_ids
    assert sum(fast.stats.verified_sizes.values()) == fast.stats.steps
    assert fast.stats.as_dict()["verified_sizes"]  # reported by `specc run --json`


def test_greedy_choices_follow_the_measured_step_times(adaptive_engine, monkeypatch):
    """A compiled table that says every member costs the same (a GPU's c(T) ~ 1) verifies the whole
    tree on any evidence; where the whole tree's graph in fact takes 40 ms longer than the rest,
    the times measured as the engine runs move the choice to smaller members (the ones it has not
    timed are scaled from those it has, and probed once REFRESH steps pass untimed). The output
    stays the target's. Sampling keeps the compiled table (test_sampling.py)."""
    import time

    import specc.adaptive

    engine = specc.load(adaptive_engine)
    engine.adaptive = {**engine.adaptive, "latency_ms": [1.0, 1.0, 1.0, 1.0], "rates": [[0.5] * 6] * 4}
    step = engine.graphs["step_greedy"]
    monkeypatch.setitem(engine.graphs, "step_greedy", lambda *a: time.sleep(0.04) or step(*a))
    monkeypatch.setattr(specc.adaptive, "REFRESH", 8)
    prompt = [3, 5, 2, 7, 9, 3, 5, 2, 7, 9, 3, 5, 2, 11, 4]
    plain = engine.generate(prompt, max_new_tokens=60, stop_at_eos=False, speculate=False)
    runs = {}
    for timed in (False, True):
        engine.time_steps = timed
        runs[timed] = engine.generate(prompt, max_new_tokens=60, stop_at_eos=False)
        assert runs[timed].token_ids == plain.token_ids
    fixed, measured = runs[False].stats.graphs, runs[True].stats.graphs
    assert fixed.get("step", 0) > 10, fixed  # flat latencies: the whole tree wherever a match drafts
    assert measured.get("step", 0) <= fixed["step"] // 2, (fixed, measured)
    clock = engine.step_clock()
    assert clock.latency_ms[3] > 40 > max(clock.latency_ms[:3]), clock.latency_ms
    engine.time_steps = False
    assert engine.step_clock() is None


def test_inspect_shows_the_family(adaptive_engine, specc_cli):
    out = specc_cli("inspect", adaptive_engine)
    assert out.returncode == 0, out.stderr
    assert "adaptive" in out.stdout and "step2" in out.stdout and "acceptance rate" in out.stdout


def test_time_family_script_times_each_member(adaptive_engine):
    """examples/time_family.py (c(T) before and after a compiler change) on the engine's family; a
    non-adaptive engine is refused in one sentence."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import cli_env

    script = Path(__file__).resolve().parents[1] / "examples" / "time_family.py"

    def run(*args):
        return subprocess.run([sys.executable, "-P", str(script), *map(str, args)], env=cli_env(),
                              capture_output=True, text=True, timeout=300)
    out = run(adaptive_engine, adaptive_engine, "--rounds", "1", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert len(rows) == 2 and all(r["nodes"] == [1, 2, 3, 4] and len(r["ms"]) == 4 for r in rows)
    assert all(r["c"][0] == 1.0 and min(r["ms"]) > 0 for r in rows)
    bad = run(adaptive_engine, "--rounds", "0")
    assert bad.returncode == 2 and "--rounds" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("options, words", [({"drafter": "draft-model"}, "--adaptive needs a drafter"),
                                            ({"drafter": "ngram", "backend": "tensorrt", "device": "cuda"},
                                             "--adaptive times its step graphs"),
                                            ({"drafter": "dspark", "drafter_path": "x", "ngram_branch": 2},
                                             "not both")])
def test_adaptive_refusals(tmp_path, options, words):
    from specc.config import CompileConfig

    with pytest.raises(SpeccError, match=words):
        CompileConfig(output_dir=tmp_path / "e", adaptive=True, **options)


@pytest.fixture(scope="module")
def dspark_adaptive(tmp_path_factory):
    from test_dspark import random_dspark

    root = tmp_path_factory.mktemp("dspark-adaptive")
    model = tiny_model("llama", vocab=64, layers=3, seed=2)
    model.save_pretrained(root / "m")
    dpath, _ = random_dspark(model, root / "ds", block=3)
    (root / "tree.json").write_text("[[0], [1], [0, 0]]")  # two ranks, two deep: four members
    path = specc.compile(root / "m", drafter="dspark", drafter_path=dpath, tree=str(root / "tree.json"), adaptive=True,
                         backend="eager", output_dir=root / "e", max_len=96, prefill_chunk=8, progress=False,
                         modes="greedy")
    return model, path


def test_dspark_adaptive_engine_chooses_fused_steps_from_its_confidences(dspark_adaptive, specc_cli):
    """A DSpark engine's family is fused steps (each verifies a prefix and drafts the whole next
    tree), calibrated by sibling rank on its own steps. With rates that rise with the confidence,
    the choice varies from step to step with the confidence head's numbers, and the output is the
    target's, fused and unfused, with the same choices both ways (sampling: test_sampling.py)."""
    from test_engine import PROMPT, hf_greedy

    model, path = dspark_adaptive
    manifest = json.loads((path / "specc.json").read_text())
    fam = manifest["adaptive"]
    assert fam["fused"] and fam["graphs"] == ["fused1", "fused2", "fused3", "fused"]
    assert fam["rest_ms"] > 0  # the plain graph, timed for the drafter's rests
    assert len(fam["seen"]) == 2 and sum(map(sum, fam["seen"])) > 0  # two sibling ranks, nodes observed
    assert {f"fused{k}_greedy" for k in range(1, 4)} <= set(manifest["graphs"])
    engine = specc.load(path)
    # Fixed latencies, and no resting member (its measured rest_ms is in real milliseconds): the
    # fused members alone (rests: the next test); the choices read this table, not step times.
    engine.time_steps = False
    engine.adaptive = {**engine.adaptive, "latency_ms": LATENCY, "rest_ms": None, "rates": RATES * 2}
    prompt = PROMPT * 3
    runs = {}
    for use_fused in (True, False):
        engine.use_fused = use_fused
        runs[use_fused] = engine.generate(prompt, max_new_tokens=40, stop_at_eos=False)
    assert runs[True].token_ids == runs[False].token_ids == hf_greedy(model, prompt, 40)
    sizes = runs[True].stats.verified_sizes
    assert sizes == runs[False].stats.verified_sizes  # the same choices both ways
    assert len(sizes) >= 2, sizes  # the choice follows the confidences
    # Rates that never pay verify the root alone (the drafter still reads every committed row);
    # rates that always pay, the whole tree.
    engine.use_fused = True
    for rate, size in ((0.0, 1), (0.99, 4)):
        engine.adaptive = {**engine.adaptive, "rates": [[rate] * 6] * 2}
        r = engine.generate(prompt, max_new_tokens=24, stop_at_eos=False)
        assert set(r.stats.verified_sizes) == {size} and r.token_ids == hf_greedy(model, prompt, 24)
    out = specc_cli("inspect", path)
    assert out.returncode == 0, out.stderr
    assert "fused2" in out.stdout and "acceptance rate" in out.stdout and "the drafter rests" in out.stdout


def test_dspark_adaptive_engine_rests_its_drafter(dspark_adaptive, monkeypatch):
    """Where no fused member pays for the drafter, the engine runs the plain graph and the drafter
    rests, its rows waiting on the host; it re-probes after 1, 2, 4, 8, 16 plain steps (one call of
    the drafter's own graph each), and resumes speculating where a probe says so. The output stays
    the target's, fused and unfused with the same choices."""
    from test_engine import PROMPT, hf_greedy

    model, path = dspark_adaptive
    engine = specc.load(path)
    proposals = []
    propose = engine.drafter.propose
    monkeypatch.setattr(engine.drafter, "propose", lambda committed: proposals.append(len(committed)) or propose(committed))
    prompt = PROMPT * 3
    engine.time_steps = False  # the choices read the table set here
    engine.adaptive = {**engine.adaptive, "latency_ms": LATENCY, "rest_ms": 0.95, "rates": [[0.0] * 6] * 2}
    r = engine.generate(prompt, max_new_tokens=24, stop_at_eos=False)
    assert r.token_ids == hf_greedy(model, prompt, 24)
    assert r.stats.graphs == {"plain": 23} and r.stats.verified_sizes == {1: 23}
    L = len(engine.encode(prompt))
    assert [n - L for n in proposals] == [1, 2, 4, 8, 16]  # probes after runs of 1, 2, 4, 8 plain steps
    # Drafts below 0.2 never accepted, the rest nearly always: rests and speculation mix (a random
    # drafter's confidences here lie in 0.02-0.7), and both paths choose alike.
    engine.adaptive = {**engine.adaptive, "rates": [[0.0, 0.9, 0.95, 0.95, 0.95, 0.95]] * 2}
    runs = {}
    for use_fused in (True, False):
        engine.use_fused = use_fused
        runs[use_fused] = engine.generate(prompt, max_new_tokens=40, stop_at_eos=False)
    assert runs[True].token_ids == runs[False].token_ids == hf_greedy(model, prompt, 40)
    fused, unfused = runs[True].stats, runs[False].stats
    assert fused.verified_sizes == unfused.verified_sizes and fused.graphs["plain"] == unfused.graphs["plain"]
    assert fused.graphs["plain"] > 0 and any(k > 1 for k in fused.verified_sizes), fused.graphs
    assert runs[True].stats.as_dict()["graphs"] == dict(sorted(fused.graphs.items()))  # in `specc run --json`
