"""Corpus statistics for the ngram drafter: what followed each context of 1 to 3 tokens in a text
corpus, tokenized with the target's tokenizer (retrieval drafting, as in REST, arXiv 2311.08252).

Prompt lookup drafts only what the text already repeated: on chat it finds a long enough match on
about half of the steps. The corpus table drafts where it finds none: for the longest context (3
tokens down to 1) of the committed text that occurs in the corpus, the tokens that followed it
most often, ranked by count. A chain extends its own drafts one token at a time; a tree ranks
each node's children under the node's own context (drafters/ngram.py: corpus_tree_drafts). The drafts are deterministic, so verification
is the usual one-hot rule: any table is lossless, a better one only accepts more.

The table lives in the engine as `draft/corpus.safetensors`: per context length n, `keys{n}` [M]
(the context's tokens as one base-V integer, sorted), `next{n}` [M, W] (the W most frequent next
tokens, -1 where fewer followed) and `count{n}` [M, W+1] (their counts, then the context's total).
Only contexts whose most frequent next token followed at least MIN_COUNT times are kept.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

MAX_CONTEXT = 3  # context lengths 1 .. MAX_CONTEXT
WIDTH = 4  # ranked next tokens kept per context
MIN_COUNT = 3  # rarer contexts predict poorly and double the table (measured: tau unchanged)
# ShareGPT's assistant turns from every conversation `specc train` may read (those before
# data.CALIBRATION_START, never MT-Bench or HumanEval). Replayed on SmolLM2's greedy text
# (examples/ngram_tau.py --corpus; BENCHMARKS.md "ngram drafts from a corpus table"), chain:8:
# MT-Bench tau 1.36 with lookup alone, 1.65 with 8000 conversations (10M tokens, 37 MB of table),
# 1.69 with 15000 (18.7M tokens, 64 MB); HumanEval 2.33, 2.61, 2.64. Contexts of 4-5 tokens, the
# human turns, contexts whose top next token followed only twice and 8 ranked tokens each moved tau
# by 0.6% at most.
CONVERSATIONS = 15000
TABLE_VERSION = 1  # of how a table is built from its corpus: part of the cached table's key
FILE = "corpus.safetensors"


def context_keys(seqs: list[np.ndarray], n: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Every position of every sequence that has n tokens before it: (its context's key, its token)."""
    keys, nexts = [], []
    for s in seqs:
        if len(s) <= n:
            continue
        key = np.zeros(len(s) - n, dtype=np.int64)
        for j in range(n):  # the context s[i : i+n] as base-vocab digits, oldest first
            key = key * vocab + s[j: len(s) - n + j]
        keys.append(key)
        nexts.append(s[n:])
    if not keys:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(keys), np.concatenate(nexts).astype(np.int64)


def build_table(seqs: list[list[int]], vocab: int, max_context: int = MAX_CONTEXT, width: int = WIDTH,
                min_count: int = MIN_COUNT) -> dict[str, np.ndarray]:
    """The table's arrays from token sequences (module docstring)."""
    if vocab ** max_context >= 2 ** 62:
        raise ValueError(f"a vocabulary of {vocab} does not fit {max_context}-token keys in 64 bits")
    arrays = [np.asarray(s, dtype=np.int64) for s in seqs]
    out = {}
    for n in range(1, max_context + 1):
        keys, nexts = context_keys(arrays, n, vocab)
        if not len(keys):  # no sequence is longer than n tokens
            out[f"keys{n}"] = np.zeros(0, np.int64)
            out[f"next{n}"] = np.zeros((0, width), np.int32)
            out[f"count{n}"] = np.zeros((0, width + 1), np.int32)
            continue
        order = np.lexsort((nexts, keys))
        keys, nexts = keys[order], nexts[order]
        # One row per distinct (context, next token) pair, with its count.
        starts = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]) | (nexts[1:] != nexts[:-1])])
        pair_key, pair_next = keys[starts], nexts[starts]
        pair_count = np.diff(np.r_[starts, len(keys)])
        # Within each context, by count (highest first; ties: the smaller token id).
        order = np.lexsort((pair_next, -pair_count, pair_key))
        pair_key, pair_next, pair_count = pair_key[order], pair_next[order], pair_count[order]
        first = np.flatnonzero(np.r_[True, pair_key[1:] != pair_key[:-1]])
        rank = np.arange(len(pair_key)) - np.repeat(first, np.diff(np.r_[first, len(pair_key)]))
        total = np.add.reduceat(pair_count, first) if len(first) else np.zeros(0, np.int64)
        keep = pair_count[first] >= min_count
        row_of = np.cumsum(keep) - 1  # each kept context's row in the table
        ctx = np.repeat(np.arange(len(first)), np.diff(np.r_[first, len(pair_key)]))
        sel = (rank < width) & keep[ctx]
        rows = keep.sum()
        nxt = np.full((rows, width), -1, dtype=np.int32)
        cnt = np.zeros((rows, width + 1), dtype=np.int32)
        nxt[row_of[ctx[sel]], rank[sel]] = pair_next[sel]
        cnt[row_of[ctx[sel]], rank[sel]] = pair_count[sel]
        cnt[:, width] = total[keep]
        out[f"keys{n}"], out[f"next{n}"], out[f"count{n}"] = pair_key[first][keep], nxt, cnt
    return out


class CorpusTable:
    """Lookups into a table's arrays: the ranked next tokens after the longest known context."""

    def __init__(self, arrays: dict[str, np.ndarray], vocab: int):
        self.vocab = vocab
        self.max_context = max(int(k[4:]) for k in arrays if k.startswith("keys"))
        self.keys = [None] + [arrays[f"keys{n}"] for n in range(1, self.max_context + 1)]
        self.next = [None] + [arrays[f"next{n}"] for n in range(1, self.max_context + 1)]
        self.count = [None] + [arrays[f"count{n}"] for n in range(1, self.max_context + 1)]

    def ranked(self, context) -> tuple[int, list[int], list[float]]:
        """(the context length used, 0 when none is known; the next tokens, most frequent first;
        each one's confidence count / (total + 1), the share of the context's occurrences it
        followed, discounted for a context seen rarely)."""
        for n in range(min(self.max_context, len(context)), 0, -1):
            key = 0
            for t in context[len(context) - n:]:
                key = key * self.vocab + int(t)
            keys = self.keys[n]
            i = int(np.searchsorted(keys, key))
            if i < len(keys) and keys[i] == key:
                nxt, cnt = self.next[n][i], self.count[n][i]
                width = int((nxt >= 0).sum())
                total = float(cnt[-1]) + 1.0
                return n, nxt[:width].tolist(), [float(c) / total for c in cnt[:width]]
        return 0, [], []


def sharegpt_sequences(tokenizer, conversations: int = CONVERSATIONS) -> list[list[int]]:
    """The assistant turns of the first `conversations` ShareGPT conversations (within specc
    train's part of the file), tokenized; conversations whose first turn is an evaluation prompt
    are skipped."""
    from .data import CALIBRATION_START, humaneval_prompts, mt_bench_prompts, sharegpt_conversations

    evals = {" ".join(p.split()).lower() for p in mt_bench_prompts() + humaneval_prompts()}
    texts = []
    for conv in sharegpt_conversations(min(conversations, CALIBRATION_START)):
        turns = conv.get("conversations") or []
        first = (turns[0].get("value") or "") if turns else ""
        if " ".join(first.split()).lower() in evals:
            continue
        texts += [t["value"] for t in turns if t.get("from") == "gpt" and t.get("value")]
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


_BUILT: dict[str, dict[str, np.ndarray]] = {}  # this process's tables by cache key (--tree sequoia/auto
# compile several engines of one model, each with the table)


def sharegpt_table_path(tokenizer, vocab: int) -> Path:
    """Where the ShareGPT table of this tokenizer is kept between compiles (~1 min to build on 2
    cores): the cache directory, under a key of everything the table depends on."""
    from .data import CALIBRATION_START, sharegpt_path
    from .models import cache_dir

    data = sharegpt_path()
    backend = getattr(tokenizer, "backend_tokenizer", None)  # vocabulary, merges, normalizer: all of it
    what = {"version": TABLE_VERSION, "vocab": vocab,
            "tokenizer": backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items()),
            "conversations": min(CONVERSATIONS, CALIBRATION_START), "max_context": MAX_CONTEXT, "width": WIDTH,
            "min_count": MIN_COUNT, "data": [data.name, data.stat().st_size]}
    key = hashlib.sha256(json.dumps(what).encode()).hexdigest()[:20]
    return cache_dir() / "corpus" / f"sharegpt-{key}.safetensors"


def build_sharegpt_table(tokenizer, vocab: int, progress: bool = False) -> dict[str, np.ndarray]:
    """The table of ShareGPT's assistant turns under this tokenizer: from this process's memory, the
    cache directory, or built (and then kept in both)."""
    from safetensors.numpy import load_file

    path = sharegpt_table_path(tokenizer, vocab)
    if path.name in _BUILT:
        return _BUILT[path.name]
    t0 = time.perf_counter()
    arrays = None
    if path.is_file():
        try:
            arrays, how = load_file(str(path)), f"read from {path}"
        except Exception as e:  # torn by a crash, or not a table: build it again
            if progress:
                print(f"ngram corpus: {path} is unreadable ({type(e).__name__}); building the table again")
    if arrays is None:
        seqs = sharegpt_sequences(tokenizer)
        arrays = build_table(seqs, vocab)
        how = f"{sum(map(len, seqs))} tokens of ShareGPT's assistant turns"
        try:
            for tmp in path.parent.glob(".sharegpt-*.tmp"):  # left by a compile killed while writing
                if time.time() - tmp.stat().st_mtime > 3600:
                    tmp.unlink(missing_ok=True)
            save_table(arrays, path.parent, path.name)
        except Exception as e:  # a read-only or full cache (safetensors' own error is no OSError): built next time
            if progress:
                print(f"ngram corpus: could not keep the table in {path.parent} ({e})")
    _BUILT[path.name] = arrays
    if progress:
        rows = ", ".join(f"{len(arrays[f'keys{n}'])} of {n}" for n in range(1, MAX_CONTEXT + 1))
        print(f"ngram corpus: {how} -> contexts {rows} ({time.perf_counter() - t0:.0f} s)")
    return arrays


def save_table(arrays: dict[str, np.ndarray], folder: Path, name: str = FILE) -> None:
    """Write the table whole or not at all: to a temporary name of this process, then renamed (a
    reader never sees half a file, even with another process writing the same one)."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{name}.{os.getpid()}.tmp"
    try:
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp))
        os.replace(tmp, folder / name)
    finally:
        tmp.unlink(missing_ok=True)


def load_table(folder: Path, vocab: int) -> CorpusTable:
    from safetensors.numpy import load_file

    return CorpusTable(load_file(str(Path(folder) / FILE)), vocab)
