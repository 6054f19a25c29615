import json

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
    parse_tree,
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


@pytest.mark.parametrize("spec", ["sequoia:64", "auto"])
def test_measured_forms_not_available_yet(spec):
    with pytest.raises(SpeccError, match="measured per-rank acceptance") as info:
        parse_tree(spec)
    assert "\n" not in str(info.value)


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
