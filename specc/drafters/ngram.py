"""Drafter kind `ngram`: prompt lookup. The drafts are what followed earlier occurrences of the
text's last few tokens (in the prompt or the text generated so far); several matches fill a tree.
Where lookup finds no match of CORPUS_MIN_LOOKUP tokens, a corpus table (specc/corpus.py) drafts
what followed the text's last 1-3 tokens most often in a corpus (ShareGPT by default).
No graphs of its own: the runtime side proposes, the target's step graph verifies."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from .. import corpus as corpus_table
from ..errors import SpeccError
from ..tree import Tree

NAME = "ngram"
DEFAULT_TREE = "chain:4"
DRAFTS = FILLS_TREES = MEASURED_TREES = True
ADAPTIVE = True  # its proposals come with confidences (match statistics): --adaptive applies
SAMPLED_CHILDREN = False
NGRAM_BRANCH = False  # it is prompt lookup already
OPTIONS = frozenset({"ngram_corpus"})
TRAINER = None  # prompt lookup: nothing to train
# min_ngram 3 measured best of 1..3 on MT-Bench and HumanEval (BENCHMARKS.md).
MAX_NGRAM, MIN_NGRAM = 4, 3
# With a corpus table, a lookup match of 2 tokens beats the table and the table beats a shorter one
# (replayed on the target's greedy text: BENCHMARKS.md "ngram drafts from a corpus table").
CORPUS_MIN_LOOKUP = 2
CALIBRATION_DEPTH = 8
MAX_OCCURRENCES = 64  # the most recent occurrences drafts and confidences count (bounds the host's work per step)


def check(cfg) -> None:
    source = cfg.ngram_corpus
    if source is None or str(source) in ("none", "sharegpt"):
        return
    if not str(source).endswith(".jsonl") or not Path(source).is_file():
        raise SpeccError(f"--ngram-corpus {str(source)!r} is neither sharegpt, none nor a .jsonl file that exists.")


def corpus_source(cfg, tokenizer) -> str:
    """--ngram-corpus, or by default sharegpt for a chat model (ShareGPT's assistant turns are chat
    text; a model with a chat template was tuned to write it), else none."""
    chat = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
    source = "sharegpt" if cfg.ngram_corpus is None and chat else str(cfg.ngram_corpus or "none")
    if source == "sharegpt" and tokenizer is None:
        raise SpeccError("--ngram-corpus sharegpt tokenizes ShareGPT with the model's tokenizer, and this model has "
                         "none; give a .jsonl file of {\"ids\": [...]} lines, or none.")
    return source


def jsonl_sequences(path, tokenizer) -> list[list[int]]:
    """A corpus file's token sequences: one JSON object per line, {"ids": [...]} or {"text": ...}."""
    seqs = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            if not isinstance(item, dict):
                raise TypeError
            if "ids" in item:
                seqs.append([int(t) for t in item["ids"]])
            elif tokenizer is not None:
                seqs.append(tokenizer(str(item["text"]), add_special_tokens=False)["input_ids"])
            else:
                raise SpeccError(f"line {n} of {str(path)!r} holds text, and this model has no tokenizer; give "
                                 f"{{\"ids\": [...]}} lines.")
        except (ValueError, KeyError, TypeError, AttributeError):
            raise SpeccError(f"line {n} of {str(path)!r} is not a JSON object with \"ids\" (token ids) or "
                             f"\"text\".") from None
    return seqs


def load(cfg, target_hf, tokenizer=None):
    """The corpus table (its arrays), or None without a corpus."""
    source = corpus_source(cfg, tokenizer)
    if source == "none":
        return None
    vocab = target_hf.config.vocab_size
    if source == "sharegpt":
        return corpus_table.build_sharegpt_table(tokenizer, vocab, cfg.progress)
    seqs = jsonl_sequences(source, tokenizer)
    if any(not 0 <= t < vocab for s in seqs for t in s):
        raise SpeccError(f"--ngram-corpus {source!r} holds token ids outside the model's vocabulary of {vocab}.")
    return corpus_table.build_table(seqs, vocab)


def calibration_depth(cfg, weights) -> int:
    return CALIBRATION_DEPTH


def calibration_options(cfg, weights) -> dict:
    return {}


def entry(cfg, weights, tree) -> dict:
    # Adaptive engines draft from any match: a weak one costs a plain step, since the runtime
    # then verifies little or nothing (its rates are measured per matched length).
    out = {"kind": NAME, "max_ngram": MAX_NGRAM, "min_ngram": 1 if cfg.adaptive else MIN_NGRAM}
    if weights is not None:
        source = "sharegpt" if cfg.ngram_corpus is None else str(cfg.ngram_corpus)
        out["corpus"] = {"source": source, "min_lookup": CORPUS_MIN_LOOKUP,
                         "contexts": [len(weights[f"keys{n}"]) for n in range(1, corpus_table.MAX_CONTEXT + 1)],
                         **({"conversations": corpus_table.CONVERSATIONS} if source == "sharegpt" else {})}
    return out


def confidence_classes(entry: dict, tree) -> int:
    """Classes of its confidences (--adaptive): the matched suffix's length, 1 .. max_ngram; with a
    corpus table, then the length of the corpus context each node was drafted under, 1 .. 3."""
    return entry["max_ngram"] + (corpus_table.MAX_CONTEXT if "corpus" in entry else 0)


def save(weights, folder, target_hf) -> None:
    if weights is not None:
        corpus_table.save_table(weights, Path(folder))


def load_saved(folder, entry, target_hf, dtype):
    return corpus_table.load_table(folder, target_hf.config.vocab_size) if "corpus" in entry else None


def taps(entry: dict, num_layers: int) -> tuple[int, ...]:
    return ()


def module(weights, target, entry, tree, cache_len):
    return None


def plans(tree, chunk, cache_len, backend, sampled, modes) -> list:
    return []


def runtime(graphs, tree, entry: dict, chunk: int, device, weights=None):
    return NgramDrafter(tree, entry["max_ngram"], entry["min_ngram"], weights,
                        entry.get("corpus", {}).get("min_lookup", CORPUS_MIN_LOOKUP))


def ngram_propose(tokens: np.ndarray, k: int, max_ngram: int = 4, min_ngram: int = 1) -> list[int]:
    """Prompt lookup: the k tokens that followed the earlier occurrences of the longest suffix
    (max_ngram down to min_ngram tokens) of `tokens`, the most frequent path (by_frequency). Fewer
    than k when the match runs into the end; empty when nothing matches."""
    found = ngram_continuations(tokens, k, max_ngram, min_ngram, limit=1)
    return found[0] if found else []


def ngram_continuations(tokens, k: int, max_ngram: int = 4, min_ngram: int = 1, limit: int = 16,
                        index: "MatchIndex | None" = None) -> list[list[int]]:
    """Up to `limit` distinct continuations (each at most k tokens) that followed earlier occurrences
    of a suffix of `tokens` (the MAX_OCCURRENCES most recent per suffix length): longer suffixes
    first, by_frequency within a length. The first one is what `ngram_propose` returns. With an
    `index` of the same text (MatchIndex), the occurrences come from it instead of a scan."""
    text, found = _text(tokens, index), []
    for size in range(min(max_ngram, len(text) - 1), min_ngram - 1, -1):
        ends = _earlier_ends(tokens, size, index)
        for cont in by_frequency([text[e: e + k] for e in ends]):
            if cont and cont not in found:
                found.append(cont)
                if len(found) == limit:
                    return found
    return found


def by_frequency(conts: list[list[int]]) -> list[list[int]]:
    """Continuations (most recent first) ordered by what followed most often: by the count of their
    first token among all of them, then of their first two tokens, and so on; ties keep the most
    recent first. The first is the path a per-depth majority vote takes. Against the most recent
    continuation, replayed on the target's greedy text (examples/ngram_tau.py, 10 prompts x 128
    tokens, matches of any length): tau 1.94 -> 2.06 (chain:4) and 2.13 -> 2.31 (chain:8) on
    HumanEval, 1.31 -> 1.33 on MT-Bench."""
    counts = Counter(tuple(c[:d]) for c in conts for d in range(1, len(c) + 1))
    k = max(map(len, conts), default=0)
    # A continuation cut short by the end of the text counts 0 past its end: the longer path wins a tie.
    return sorted(conts, key=lambda c: [-counts[tuple(c[:d])] if d <= len(c) else 0 for d in range(1, k + 1)])


def _match_ends(tokens: np.ndarray, size: int) -> np.ndarray:
    """Where the continuations of the earlier occurrences of the last `size` tokens start, the most
    recent first."""
    n = len(tokens)
    # windows[i] = tokens[i : i+size]; an earlier match must start at i < n - size.
    windows = np.lib.stride_tricks.sliding_window_view(tokens[: n - 1], size)
    return np.flatnonzero((windows == tokens[n - size:]).all(axis=1))[::-1] + size


class MatchIndex:
    """Where every n-gram of 1..max_ngram tokens of a growing text ended, kept up to date as the text
    grows: a lookup is a dict read instead of `_match_ends`'s scan of the whole text, which costs
    the host ~0.1 ms per suffix length per step at a few hundred tokens (a step's budget on a GPU
    is ~1-2 ms for a small model). The scan stays as the reference; tests compare the two."""

    def __init__(self, max_ngram: int):
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.ends: list[dict] = [{} for _ in range(max_ngram + 1)]  # [size][n-gram] -> end positions, oldest first

    def sync(self, text) -> "MatchIndex":
        """Index `text`: the tokens it adds to the indexed text, or all of it when it is another text."""
        m = len(self.tokens)
        if len(text) < m or list(text[:m]) != self.tokens:
            self.tokens, self.ends, m = [], [{} for _ in range(self.max_ngram + 1)], 0
        toks = self.tokens
        for t in text[m:]:
            toks.append(int(t))
            end = len(toks)
            for size in range(1, min(self.max_ngram, end) + 1):
                self.ends[size].setdefault(tuple(toks[end - size:]), []).append(end)
        return self

    def earlier_ends(self, size: int, limit: int = MAX_OCCURRENCES) -> list[int]:
        """`_match_ends(text, size)[:limit]`: where the continuations of the earlier occurrences of
        the text's last `size` tokens start, the most recent first."""
        n = len(self.tokens)
        if size >= n:
            return []
        if size > self.max_ngram:
            return _match_ends(np.asarray(self.tokens, dtype=np.int64), size)[:limit].tolist()
        ends = self.ends[size].get(tuple(self.tokens[n - size:]), [])
        return ends[-2::-1][:limit]  # the last one is the suffix itself


def _text(tokens, index: MatchIndex | None) -> list[int]:
    return index.tokens if index is not None else np.asarray(tokens).tolist()


def _earlier_ends(tokens, size: int, index: MatchIndex | None) -> list[int]:
    if index is not None:
        return index.earlier_ends(size)
    return _match_ends(np.asarray(tokens, dtype=np.int64), size)[:MAX_OCCURRENCES].tolist()


def ngram_confidences(tokens, tree: Tree, drafts: list[int], max_ngram: int = 4,
                      min_ngram: int = 1, index: MatchIndex | None = None) -> tuple[int, list[float]]:
    """The match statistics behind each drafted node: the class, the length of the longest suffix
    that occurs before, less 1 (0 when nothing matches); and per node, in [0, 1], over that suffix's
    earlier occurrences (up to MAX_OCCURRENCES, the most recent) the share of those whose
    continuation agrees with the node's parent path that also agree with the node,
    `agree(node) / (agree(parent) + 1)` (the +1: one occurrence is weak evidence). `index` as in
    ngram_continuations."""
    text, conts = _text(tokens, index), None
    for size in range(min(max_ngram, len(text) - 1), min_ngram - 1, -1):
        ends = _earlier_ends(tokens, size, index)
        if ends:
            conts = [tuple(text[e: e + tree.max_depth]) for e in ends]
            break
    if conts is None:
        return 0, [0.0] * (tree.size - 1)
    path_tokens = [()] + [None] * (tree.size - 1)
    agree = [len(conts)] + [0] * (tree.size - 1)
    out = []
    for i in range(1, tree.size):
        parent = tree.parents[i]
        path_tokens[i] = path_tokens[parent] + (drafts[i - 1],)
        d = tree.depths[i]
        agree[i] = sum(1 for c in conts if c[:d] == path_tokens[i])  # a shorter c never equals the path
        out.append(agree[i] / (agree[parent] + 1))
    return size - 1, out


def ngram_tree_drafts(continuations: list[list[int]], tree: Tree, root: int) -> list[int]:
    """Tokens for the tree's nodes 1..T-1. A node of rank r takes the r-th distinct next token among
    the continuations that agree with its ancestors' tokens (in the continuations' order); a node
    no continuation reaches repeats its parent's token (any token is lossless; this one is what a
    chain drafter that ran out of matches proposed before)."""
    tokens = [root] + [0] * (tree.size - 1)
    agree: list[list[list[int]]] = [continuations] + [[] for _ in range(tree.size - 1)]
    for i in range(1, tree.size):  # parents come before children
        parent, d = tree.parents[i], tree.depths[i]
        nexts: list[int] = []
        for c in agree[parent]:
            if len(c) >= d and c[d - 1] not in nexts:
                nexts.append(c[d - 1])
        rank = tree.ranks[i]
        if rank < len(nexts):
            tokens[i] = nexts[rank]
            agree[i] = [c for c in agree[parent] if len(c) >= d and c[d - 1] == tokens[i]]
        else:
            tokens[i] = tokens[parent]
    return tokens[1:]


def corpus_tree_drafts(table, context: list[int], tree: Tree) -> tuple[list[int], list[int], list[float]]:
    """Tokens for the tree's nodes 1..T-1 from a corpus table: a node of rank r takes the r-th most
    frequent token after its parent's context (the text's last tokens, then the drafts down to the
    parent). Per node also the context length it was drafted under (0: none known) and its
    confidence (CorpusTable.ranked); a node the table cannot fill repeats its parent's token with
    confidence 0."""
    width = table.max_context
    ctx = [tuple(context[-width:])] + [()] * (tree.size - 1)
    tokens = [context[-1]] + [0] * (tree.size - 1)
    used, conf = [0] * tree.size, [0.0] * tree.size
    ranked = {}
    for i in range(1, tree.size):  # parents come before children
        p = tree.parents[i]
        if p not in ranked:
            ranked[p] = table.ranked(ctx[p])
        n, nxt, c = ranked[p]
        r = tree.ranks[i]
        if r < len(nxt):
            tokens[i], used[i], conf[i] = nxt[r], n, c[r]
        else:
            tokens[i] = tokens[p]
        ctx[i] = (ctx[p] + (tokens[i],))[-width:]
    return tokens[1:], used[1:], conf[1:]


class NgramDrafter:
    needs_rows, q = False, None  # drafts from the text alone, deterministic

    def __init__(self, tree: Tree, max_ngram: int = 4, min_ngram: int = 3, corpus=None,
                 min_lookup: int = CORPUS_MIN_LOOKUP):
        # A match shorter than min_ngram predicts poorly; without a match the step falls back to
        # the plain one-token graph, which is cheaper than verifying a likely-rejected tree.
        self.tree, self.max_ngram, self.min_ngram = tree, max_ngram, min_ngram
        # With a corpus table: lookup's matches of min_lookup tokens first, then the table, then
        # (adaptive engines) lookup's shorter matches.
        self.corpus, self.min_lookup = corpus, min_lookup
        # Distinct continuations worth collecting: enough to fill every rank at depth 1.
        self.limit = max(1, len(tree.children[0])) * 4

    def start(self, prompt_ids: list[int], mode: str, temperature, top_p, table=None) -> None:
        self.index = MatchIndex(self.max_ngram).sync(prompt_ids)

    def _lookup(self, min_ngram: int, max_ngram: int | None = None) -> list[list[int]]:
        return ngram_continuations(None, self.tree.max_depth, max_ngram or self.max_ngram, min_ngram,
                                   limit=1 if self.tree.is_chain else self.limit, index=self.index)

    def propose(self, committed: list[int]) -> tuple[list[int], bool]:
        """Drafts for the tree's non-root nodes, and whether anything matched (else the step can be plain)."""
        self.index.sync(committed)
        self.from_corpus = None
        if self.corpus is None:
            conts = self._lookup(self.min_ngram)
        else:
            conts = self._lookup(self.min_lookup)
            if not conts:
                drafts, used, conf = corpus_tree_drafts(self.corpus, committed, self.tree)
                if used[0]:  # the first node's context is known: the table drafts
                    self.drafts, self.from_corpus = drafts, (used, conf)
                    return drafts, True
                if self.min_ngram < self.min_lookup:  # the matches too short for the first lookup
                    conts = self._lookup(self.min_ngram, self.min_lookup - 1)
        self.drafts = ngram_tree_drafts(conts, self.tree, committed[-1])
        return self.drafts, len(conts) > 0

    def confidences(self) -> tuple:
        """The last proposal's confidence class and per-node confidences (ngram_confidences), for
        --adaptive; drafts from the corpus table have a class per node, after lookup's classes."""
        if self.from_corpus is not None:
            used, conf = self.from_corpus
            return [self.max_ngram + max(n, 1) - 1 for n in used], conf
        return ngram_confidences(None, self.tree, self.drafts, self.max_ngram, self.min_ngram, self.index)

    def accepted(self, committed: list[int], n_accepted: int) -> None:
        self.index.sync(committed)
