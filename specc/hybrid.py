"""Hybrid trees (`--ngram-branch K`): a model drafter's tree and prompt lookup's continuation, one tree.

The tree is the model drafter's with one more branch: a chain of K nodes under the root, at the
next free rank. The drafter's graphs draft every node as usual (so the branch holds the model's
next-ranked candidates), and before each verify the host writes prompt lookup's continuation of
the committed text (specc/drafters/ngram.py, matches of at least MIN_NGRAM tokens) over it:

- when the continuation's first token is one the model already drafted at depth 1, the rest of it
  goes down that node's rank-0 line (ngram ranks first there: the model's own line under that
  token gives way), so the two do not hold the same token twice at one depth, where the second
  could never be accepted;
- otherwise it fills the branch.

Code and repetitive text get lookup's long matches, the rest the model's drafts, in one verify.
Any token is lossless to verify; the drafts stay deterministic, so top-k children's one-hot rule
verifies them exactly in every mode. Children sampled from the drafter's q could not be
overwritten (the rule needs them drawn from q): the config refuses that pairing.
"""
from __future__ import annotations

from .drafters.ngram import MAX_NGRAM, MIN_NGRAM, MatchIndex, ngram_continuations
from .tree import Tree, tree_from_paths


def next_rank(tree: Tree) -> int:
    """The rank after the root's last child's (a tree file may skip ranks)."""
    return max((tree.ranks[j] for j in tree.children[0]), default=-1) + 1


def with_ngram_branch(tree: Tree, depth: int) -> Tree:
    """`tree` with a chain of `depth` nodes under the root at the next free rank."""
    rank = next_rank(tree)
    return tree_from_paths([list(p) for p in tree.paths[1:]] + [[rank] + [0] * d for d in range(depth)])


def branch_entry(tree: Tree, depth: int) -> dict:
    """The manifest's record of the branch in a tree made by with_ngram_branch."""
    return {"rank": next_rank(tree) - 1, "depth": depth, "max_ngram": MAX_NGRAM, "min_ngram": MIN_NGRAM}


def rank0_line(tree: Tree, node: int, length: int) -> list[int]:
    """Up to `length` nodes below `node`, each its parent's first child."""
    out = []
    while len(out) < length and tree.first_child[node] >= 0:
        node = tree.first_child[node]
        out.append(node)
    return out


class NgramBranch:
    """The host's side of a hybrid tree: write prompt lookup's continuation into the drafted tree."""

    def __init__(self, tree: Tree, entry: dict):
        self.tree, self.depth = tree, entry["depth"]
        self.max_ngram, self.min_ngram = entry["max_ngram"], entry["min_ngram"]
        roots = tree.children[0]
        top = next(j for j in roots if tree.ranks[j] == entry["rank"])
        self.branch = [top] + rank0_line(tree, top, self.depth - 1)
        self.model_roots = [j for j in roots if j != self.branch[0]]  # the model's depth-1 nodes, by rank
        self.index = MatchIndex(self.max_ngram)  # follows the text from call to call (a new one: re-indexed)

    def merge(self, tokens: list[int], committed: list[int]) -> tuple[list[int], list[int]]:
        """tokens: the tree's [root, drafts...] as drafted; committed: the text, ending with the root.
        Returns the tokens with the continuation written in, and the nodes it wrote."""
        found = ngram_continuations(None, self.depth, self.max_ngram, self.min_ngram, limit=1,
                                    index=self.index.sync(committed))
        if not found:
            return tokens, []
        cont, out = found[0], list(tokens)
        same = next((j for j in self.model_roots if out[j] == cont[0]), None)
        nodes = self.branch[: len(cont)] if same is None else rank0_line(self.tree, same, len(cont) - 1)
        written = cont if same is None else cont[1:]
        for node, token in zip(nodes, written):
            out[node] = token
        return out, nodes
