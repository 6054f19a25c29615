"""Drafter kind `none`: plain decoding only (the engine holds prefill and plain graphs)."""
from __future__ import annotations

NAME = "none"
DEFAULT_TREE = "chain:0"
DRAFTS = FILLS_TREES = MEASURED_TREES = SAMPLED_CHILDREN = ADAPTIVE = NGRAM_BRANCH = False
OPTIONS: frozenset[str] = frozenset()
TRAINER = None  # nothing to train


def check(cfg) -> None:
    pass


def load(cfg, target_hf, tokenizer=None):
    return None


def entry(cfg, weights, tree) -> dict:
    return {"kind": NAME}


def save(weights, folder, target_hf) -> None:
    pass


def load_saved(folder, entry, target_hf, dtype):
    return None


def taps(entry: dict, num_layers: int) -> tuple[int, ...]:
    return ()


def module(weights, target, entry, tree, cache_len):
    return None


def plans(tree, chunk, cache_len, backend, sampled, modes) -> list:
    return []


def runtime(graphs, tree, entry, chunk, device, weights=None):
    return None
