import json
import math
import random
from functools import lru_cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specc.errors import SpeccError
from specc.tree import (
    MAX_TREE_NODES,
    Tree,
    chain,
    draw_tree,
    expected_tokens,
    measure_acceptance,
    parse_tree,
    pick_tree,
    sequoia,
    topk,
    tree_from_paths,
)

MEDUSA_LIKE = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0]]


def brute_ancestors(tree: Tree) -> torch.Tensor:
    mask = torch.zeros(tree.size, tree.size, dtype=torch.bool)
    for i in range(tree.size):
        j = i
        while j != -1:
            mask[i, j] = True
            j = tree.parents[j]
    return mask


def check_invariants(tree: Tree) -> None:
    assert tree.paths[0] == () and tree.parents[0] == -1 and tree.depths[0] == 0
    assert list(tree.paths) == sorted(tree.paths, key=lambda p: (len(p), p))
    assert len(set(tree.paths)) == tree.size
    for i in range(1, tree.size):
        p = tree.parents[i]
        assert p < i
        assert tree.paths[p] == tree.paths[i][:-1]
        assert tree.depths[i] == len(tree.paths[i]) == tree.depths[p] + 1
        assert tree.ranks[i] == tree.paths[i][-1]
        assert i in tree.children[p]
    for i, kids in enumerate(tree.children):
        assert all(tree.parents[k] == i for k in kids)
        assert [tree.ranks[k] for k in kids] == sorted(tree.ranks[k] for k in kids)
        assert tree.first_child[i] == (kids[0] if kids else -1)
        for a, b in zip(kids, kids[1:] + (-1,)):
            assert tree.next_sibling[a] == b
    assert tree.next_sibling[0] == -1
    assert tree.max_depth == max(tree.depths)
    assert tree.max_width == max(len(c) for c in tree.children)
    assert tree.is_chain == all(len(c) <= 1 for c in tree.children)

    mask = tree.ancestor_mask()
    assert mask.dtype == torch.bool and mask.shape == (tree.size, tree.size)
    assert torch.equal(mask, brute_ancestors(tree))
    assert mask.diagonal().all()
    depths = torch.tensor(tree.depths)
    assert (depths[None, :] <= depths[:, None])[mask].all()

    table = tree.child_table()
    assert table.dtype == torch.int64 and table.shape == (tree.size, max(1, tree.max_width))
    for i, kids in enumerate(tree.children):
        row = table[i].tolist()
        assert row == list(kids) + [-1] * (table.shape[1] - len(kids))


def test_medusa_like_paths():
    tree = tree_from_paths(MEDUSA_LIKE)
    assert tree.paths == ((), (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert tree.parents == (-1, 0, 0, 0, 1, 1, 2, 4)
    assert tree.depths == (0, 1, 1, 1, 2, 2, 2, 3)
    assert tree.children[0] == (1, 2, 3) and tree.children[1] == (4, 5)
    assert tree.first_child == (1, 4, 6, -1, 7, -1, -1, -1)
    assert tree.next_sibling == (-1, 2, 3, -1, 5, -1, -1, -1)
    assert tree.max_width == 3 and tree.max_depth == 3 and not tree.is_chain
    check_invariants(tree)


def test_root_optional_and_dedup():
    a = tree_from_paths(MEDUSA_LIKE)
    b = tree_from_paths([[]] + MEDUSA_LIKE + [(0, 1), [0]])
    assert a == b and hash(a) == hash(b)


def test_missing_prefix_is_named():
    with pytest.raises(SpeccError, match=r"\[0, 2\]"):
        tree_from_paths([[0], [0, 2, 1]])


@pytest.mark.parametrize("bad", [[[0], [-1]], [[0], ["a"]], "0,1", [[0], [True]], [[0.0]]])
def test_bad_paths_rejected(bad):
    with pytest.raises(SpeccError):
        tree_from_paths(bad)


def test_node_limit():
    tree_from_paths([[0] * d for d in range(1, MAX_TREE_NODES)])
    with pytest.raises(SpeccError, match="limit"):
        tree_from_paths([[0] * d for d in range(1, MAX_TREE_NODES + 1)])


@pytest.mark.parametrize("k", [0, 1, 5, MAX_TREE_NODES - 1])
def test_chain(k):
    tree = chain(k)
    assert tree.is_chain and tree.size == k + 1 and tree.max_depth == k
    assert tree.child_table().shape == (k + 1, 1)
    check_invariants(tree)


def test_plain_decoding_tree():
    tree = chain(0)
    assert tree.size == 1 and tree.max_width == 0
    assert tree.child_table().tolist() == [[-1]]
    assert tree.ancestor_mask().tolist() == [[True]]


@pytest.mark.parametrize("depth,width", [(1, 1), (1, 4), (2, 3), (3, 2), (4, 3)])
def test_topk_sizes(depth, width):
    tree = topk(depth, width)
    assert tree.size == sum(width**d for d in range(depth + 1))
    assert tree.max_depth == depth and tree.max_width == width
    assert tree.is_chain == (width == 1)
    assert all(len(c) in (0, width) for c in tree.children)
    check_invariants(tree)


def test_topk_one_wide_equals_chain():
    assert topk(4, 1) == chain(4)


def test_manifest_and_networkx():
    tree = tree_from_paths(MEDUSA_LIKE)
    manifest = tree.to_manifest()
    assert json.loads(json.dumps(manifest)) == manifest
    assert manifest["paths"][0] == [] and manifest["parents"] == list(tree.parents)
    assert tree_from_paths(manifest["paths"]) == tree
    g = tree.to_networkx()
    assert sorted(g.nodes) == list(range(tree.size))
    assert sorted(g.edges) == sorted((p, i) for i, p in enumerate(tree.parents) if p >= 0)
    assert g.nodes[7] == {"depth": 3, "rank": 0}


def test_parse_simple_forms():
    assert parse_tree("chain:3") == chain(3)
    assert parse_tree("chain:0") == chain(0)
    assert parse_tree("topk:2,3") == topk(2, 3)


@pytest.mark.parametrize("as_object", [False, True])
def test_parse_json_round_trip(tmp_path, as_object):
    tree = tree_from_paths(MEDUSA_LIKE)
    f = tmp_path / "tree.json"
    f.write_text(json.dumps(tree.to_manifest() if as_object else MEDUSA_LIKE))
    assert parse_tree(str(f)) == tree


MALFORMED = [
    "",
    "chain",
    "chain:",
    "chain:x",
    "chain:-1",
    "chain:1.5",
    f"chain:{MAX_TREE_NODES}",
    "chain:" + "9" * 5000,
    "topk:3",
    "topk:2,x",
    "topk:0,2",
    "topk:2,0",
    "topk:2,-3",
    "topk:1,2,3",
    "topk:5,5",
    "topk:999999999,2",
    "sequoia:",
    "sequoia:0",
    "sequoia:abc",
    f"sequoia:{MAX_TREE_NODES + 1}",
    "sequoia:" + "9" * 30,
    "auto:3",
    "bogus:3",
    "bogus",
    "no/such/tree.json",
    "line1\nline2",
]


@pytest.mark.parametrize("spec", MALFORMED)
def test_parse_rejects_malformed(spec):
    with pytest.raises(SpeccError) as info:
        parse_tree(spec)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("--tree ") and msg.endswith(".")
    assert repr(spec)[:40].rstrip("'") in msg


BAD_JSON = {
    "not_json": "[[0], [1",
    "wrong_type": '"chain:3"',
    "object_without_paths": '{"choices": [[0]]}',
    "not_list_of_lists": "[0, 1]",
    "negative": "[[0], [-2]]",
    "missing_prefix": "[[0], [1, 0]]",
    "too_many": json.dumps([[i] for i in range(MAX_TREE_NODES)]),
    "binary": None,
}


@pytest.mark.parametrize("case", sorted(BAD_JSON))
def test_parse_rejects_bad_json_files(tmp_path, case):
    f = tmp_path / f"{case}.json"
    if BAD_JSON[case] is None:
        f.write_bytes(b"\xff\xfe\x00[")
    else:
        f.write_text(BAD_JSON[case])
    with pytest.raises(SpeccError) as info:
        parse_tree(str(f))
    msg = str(info.value)
    assert "\n" not in msg and str(f)[-30:] in msg
    if case == "missing_prefix":
        assert "[1, 0]" in msg and "[1]" in msg


def test_parse_rejects_directory(tmp_path):
    with pytest.raises(SpeccError, match="not a file"):
        parse_tree(str(tmp_path))


@st.composite
def prefix_closed_paths(draw):
    # Grow a tree one node at a time under a random existing node, so the set is prefix-closed by construction.
    paths = [()]
    for parent, rank in draw(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 5)), max_size=40)):
        paths.append(paths[parent % len(paths)] + (rank,))
    listed = [list(p) for p in paths if p or draw(st.booleans())]
    return draw(st.permutations(listed)), set(paths)


@settings(max_examples=60, deadline=None)
@given(prefix_closed_paths())
def test_random_trees_hold_invariants(case):
    listed, expected = case
    tree = tree_from_paths(listed)
    assert set(tree.paths) == expected
    check_invariants(tree)


@settings(max_examples=30, deadline=None)
@given(prefix_closed_paths(), st.data())
def test_removing_a_prefix_is_rejected(case, data):
    listed, expected = case
    inner = sorted(p for p in expected if p and any(q[: len(p)] == p and q != p for q in expected))
    if not inner:
        return
    gone = data.draw(st.sampled_from(inner))
    with pytest.raises(SpeccError):
        tree_from_paths([p for p in listed if tuple(p) != gone])


@pytest.mark.parametrize("tree,labels", [(tree_from_paths(MEDUSA_LIKE), None), (chain(0), ["root"]), (topk(3, 4), None)])
def test_draw_tree_writes_png(tmp_path, tree, labels):
    out = tmp_path / "tree.png"
    draw_tree(tree, out, labels=labels)
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 1000


# --- measured forms: acceptance tables, expected tokens, Sequoia, pick_tree ---------------

TABLE = [[0.6, 0.2, 0.1], [0.5, 0.3], [0.4, 0.1, 0.05]]


def reach(path, table):
    """Plain-Python reach probability of a node (0 beyond the table)."""
    prob = 1.0
    for d, r in enumerate(path):
        prob *= table[d][r] if d < len(table) and r < len(table[d]) else 0.0
    return prob


def one_line_error(call) -> str:
    with pytest.raises(SpeccError) as info:
        call()
    msg = str(info.value)
    assert "\n" not in msg and msg.endswith(".")
    return msg


@lru_cache(maxsize=None)
def all_trees(row_lengths: tuple[int, ...], max_depth: int, max_size: int) -> tuple[frozenset, ...]:
    """Every prefix-closed set of paths with ranks < their row's length, depth <= max_depth, <= max_size nodes."""
    layer = {frozenset({()})}
    found = set(layer)
    for _ in range(max_size - 1):
        grown = set()
        for t in layer:
            for p in t:
                if len(p) < max_depth:
                    grown.update(t | {p + (r,)} for r in range(row_lengths[len(p)]) if p + (r,) not in t)
        found |= grown
        layer = grown
    return tuple(found)


@st.composite
def acceptance_tables(draw, max_rows=3, max_width=3):
    rows = []
    for _ in range(draw(st.integers(1, max_rows))):
        # Zeros exercise useless nodes; no tiny positives, so reach products never underflow to 0.
        row = draw(st.lists(st.one_of(st.just(0.0), st.floats(1e-3, 1.0)), min_size=1, max_size=max_width))
        total = sum(row)
        rows.append([v / total for v in row] if total > 1 else row)
    return rows


@settings(max_examples=60, deadline=None)
@given(acceptance_tables(), st.integers(1, 7), st.one_of(st.none(), st.integers(0, 4)))
def test_sequoia_matches_brute_force(table, budget, max_depth):
    tree = sequoia(table, budget, max_depth=max_depth)
    check_invariants(tree)
    depth_cap = len(table) if max_depth is None else min(max_depth, len(table))
    candidates = all_trees(tuple(len(row) for row in table), depth_cap, budget)
    brute = max(1.0 + sum(reach(p, table) for p in t if p) for t in candidates)
    value = expected_tokens(tree, table)
    assert math.isclose(value, brute, rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(value, 1.0 + sum(reach(p, table) for p in tree.paths[1:]), rel_tol=1e-12)
    # Exactly min(budget, useful) nodes, all of them useful and within max_depth.
    biggest_useful = max(1 + sum(1 for p in t if p and reach(p, table) > 0) for t in candidates)
    assert tree.size == min(budget, biggest_useful)
    assert all(reach(p, table) > 0 for p in tree.paths[1:])
    assert tree.max_depth <= depth_cap
    assert sequoia(table, budget, max_depth=max_depth) == tree  # deterministic


@settings(max_examples=40, deadline=None)
@given(acceptance_tables(max_rows=4), st.integers(0, 8))
def test_chain_expected_tokens_is_prefix_products(table, k):
    want, prod = 1.0, 1.0
    for d in range(k):
        prod *= table[d][0] if d < len(table) else 0.0
        want += prod
    assert math.isclose(expected_tokens(chain(k), table), want, rel_tol=1e-12)


@settings(max_examples=25, deadline=None)
@given(acceptance_tables(max_rows=4, max_width=4))
def test_sequoia_never_worse_than_chain_or_topk(table):
    shapes = [chain(k) for k in range(8)] + [topk(d, w) for d in range(1, 5) for w in range(1, 4)]
    for tree in shapes:
        best = sequoia(table, tree.size)
        assert best.size <= tree.size
        assert expected_tokens(best, table) >= expected_tokens(tree, table) - 1e-12


def test_sequoia_known_trees():
    assert sequoia([[0.8, 0.1], [0.8, 0.1]], 3).paths == ((), (0,), (0, 0))
    assert sequoia([[0.4, 0.4], [0.1]], 3).paths == ((), (0,), (1,))
    assert sequoia(TABLE, 1) == chain(0)
    # Unsorted rows: the better rank wins whatever its index.
    assert sequoia([[0.1, 0.7]], 2).paths == ((), (1,))
    # Ties go to lower ranks: (0, 0) and (1,) are both worth 0.25 here.
    assert sequoia([[0.5, 0.25], [0.5]], 3).paths == ((), (0,), (0, 0))
    assert sequoia([[0.3, 0.3]], 2).paths == ((), (0,))


def test_sequoia_smaller_than_budget_when_nodes_are_useless():
    assert sequoia([[0.0, 0.0]], 5) == chain(0)
    tree = sequoia([[0.5, 0.0, 0.3], [0.0, 0.9]], 50)
    assert tree.paths == ((), (0,), (2,), (0, 1), (2, 1))
    assert sequoia(TABLE, 50, max_depth=1).paths == ((), (0,), (1,), (2,))
    assert sequoia(TABLE, 50, max_depth=0) == chain(0)


def test_sequoia_full_budget_is_fast_and_valid():
    rng = random.Random(0)
    table = [[rng.random() / 12 for _ in range(12)] for _ in range(40)]
    tree = sequoia(table, MAX_TREE_NODES)
    assert tree.size == MAX_TREE_NODES
    check_invariants(tree)
    deep = sequoia([[0.99]] * 300, MAX_TREE_NODES)
    assert deep == chain(MAX_TREE_NODES - 1)


BAD_TABLES = [[], [[]], [[1.2]], [[-0.1]], [[0.7, 0.7]], [["a"]], [[float("nan")]], "abc", [[True]], [0.5], {"a": 1}]


@pytest.mark.parametrize("table", BAD_TABLES)
def test_bad_acceptance_tables_refused(table):
    assert "acceptance" in one_line_error(lambda: sequoia(table, 4))
    one_line_error(lambda: expected_tokens(chain(2), table))
    one_line_error(lambda: parse_tree("sequoia:4", acceptance=table))


@pytest.mark.parametrize(
    "budget,max_depth", [(0, None), (MAX_TREE_NODES + 1, None), (True, None), (2.0, None), (4, -1)]
)
def test_sequoia_bad_arguments(budget, max_depth):
    one_line_error(lambda: sequoia(TABLE, budget, max_depth=max_depth))


def test_row_sums_allow_rounding():
    sequoia([[0.5, 0.5 + 1e-7]], 3)
    one_line_error(lambda: sequoia([[0.5, 0.5 + 1e-5]], 3))


def test_parse_sequoia_with_acceptance():
    assert parse_tree("sequoia:6", acceptance=TABLE) == sequoia(TABLE, 6)
    assert parse_tree(" sequoia:1 ", acceptance=TABLE) == chain(0)
    assert parse_tree("chain:3", acceptance=TABLE) == chain(3)  # other forms ignore the table
    assert "limit" in one_line_error(lambda: parse_tree(f"sequoia:{MAX_TREE_NODES + 1}", acceptance=TABLE))


@pytest.mark.parametrize("acceptance", [None, TABLE])
def test_parse_refuses_measured_forms_in_one_line(acceptance):
    msg = one_line_error(lambda: parse_tree("auto", acceptance=acceptance))
    assert msg.startswith("--tree 'auto'") and "compiler" in msg and "acceptance" in msg
    if acceptance is None:
        msg = one_line_error(lambda: parse_tree("sequoia:64"))
        assert msg.startswith("--tree 'sequoia:64'") and "acceptance" in msg


def test_pick_tree_picks_the_fastest_and_reports_all():
    specs = ["chain:1", "chain:3", "topk:2,2", "sequoia:7"]
    cands = [(s, parse_tree(s, acceptance=TABLE)) for s in specs]
    step = {2: 0.010, 4: 0.011, 7: 0.0125}
    index, rows = pick_tree(cands, TABLE, step)
    assert [r["tree"] for r in rows] == specs
    for (spec, tree), row in zip(cands, rows):
        assert set(row) == {"tree", "nodes", "depth", "expected_tokens", "step_ms", "expected_tokens_per_s"}
        assert row["nodes"] == tree.size and row["depth"] == tree.max_depth
        assert math.isclose(row["expected_tokens"], expected_tokens(tree, TABLE))
        assert math.isclose(row["step_ms"], 1000 * step[tree.size])
        assert math.isclose(row["expected_tokens_per_s"], row["expected_tokens"] / step[tree.size])
    speeds = [r["expected_tokens_per_s"] for r in rows]
    assert index == speeds.index(max(speeds))
    assert json.loads(json.dumps(rows)) == rows
    # A slow big tree loses to a cheap chain.
    index, _ = pick_tree(cands, TABLE, {2: 0.010, 4: 0.05, 7: 0.2})
    assert index == 0


def test_pick_tree_ties_go_to_the_smaller_tree():
    table = [[0.5]]  # chain:2's second node is beyond the table, so it adds nothing
    index, rows = pick_tree([("chain:2", chain(2)), ("chain:1", chain(1))], table, {2: 0.01, 3: 0.01})
    assert index == 1 and rows[0]["expected_tokens"] == rows[1]["expected_tokens"] == 1.5


PICK_REFUSALS = [
    ([], {2: 0.01}),  # no candidates
    ([("chain:1", chain(1))], {3: 0.01}),  # no step time for its size
    ([("chain:1", chain(1))], {2: 0.0}),  # a step time that is not positive
    ([("chain:1", "x")], {2: 0.01}),  # not a Tree
]


@pytest.mark.parametrize("cands,step", PICK_REFUSALS)
def test_pick_tree_refusals(cands, step):
    one_line_error(lambda: pick_tree(cands, TABLE, step))


def test_measure_acceptance_counts():
    t = topk(2, 2)
    records = [(), (0,), (0, 1), (1, 0), (0, 0)]
    assert measure_acceptance(records, t) == [[3 / 5, 1 / 5], [2 / 4, 1 / 4]]
    assert measure_acceptance([], t) == [[0.0] * 2, [0.0] * 2]
    assert measure_acceptance(iter([[2]]), topk(1, 3)) == [[0.0, 0.0, 1.0]]


def test_measure_acceptance_on_a_comb_counts_only_offered_ranks():
    # The comb: only rank-0 nodes have children, so a step that accepted (1,) stopped at a leaf and
    # must not count towards depth 2.
    comb = tree_from_paths([[0], [1], [0, 0], [0, 1]])
    records = [(1,), (0, 0), (0,), ()]
    assert measure_acceptance(records, comb) == [[2 / 4, 1 / 4], [1 / 2, 0.0]]


def _simulate(truth, n, seed):
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        path = []
        for row in truth:
            u, acc = rng.random(), 0.0
            for r, a in enumerate(row):
                acc += a
                if u < acc:
                    path.append(r)
                    break
            else:
                break
            if path[-1] != 0:  # on a comb, only rank 0 has children
                break
        records.append(tuple(path))
    return records


def test_measure_acceptance_recovers_a_simulated_table():
    truth = [[0.6, 0.25], [0.5, 0.3], [0.7, 0.1]]
    comb = tree_from_paths([(0,) * d + (r,) for d in range(3) for r in range(2)])
    got = measure_acceptance(_simulate(truth, 20000, 1), comb)
    for row_got, row_true in zip(got, truth):
        for g, t in zip(row_got, row_true):
            assert abs(g - t) < 0.02
    assert sequoia(got, 3) == sequoia(truth, 3)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), max_size=3).map(tuple), max_size=30))
def test_measure_acceptance_is_a_valid_table(records):
    table = measure_acceptance(records, topk(3, 3))
    for d, row in enumerate(table):
        reached = sum(1 for p in records if len(p) >= d)
        assert sum(row) == pytest.approx(sum(1 for p in records if len(p) > d) / reached if reached else 0.0)
        assert all(0.0 <= v <= 1.0 for v in row)
    expected_tokens(chain(3), table)  # passes the table check


@pytest.mark.parametrize("records,tree", [([(3,)], topk(2, 3)), ([(0, 0, 0)], topk(2, 3)), ([(-1,)], topk(2, 3)),
                                          (["0"], topk(2, 3)), ([()], "topk:2,3")])
def test_measure_acceptance_refusals(records, tree):
    one_line_error(lambda: measure_acceptance(records, tree))
