"""Drafter kind `dspark`: DFlash's backbone with every block row drafting, a Markov head that ranks
each node's children under its own token and a confidence head (model.py; train.py: its trainer).
A tree of depth D runs on the shortest block length the drafter was trained on that has D rows,
unless `--block-size` says; a measured tree runs at the length its comb was measured at. Top-k
trees only."""
from __future__ import annotations

from ...errors import SpeccError
from ...target_module import TargetModule
from ...tree import Tree
from .. import hidden_state
from ..dflash.model import check_fits, run_block
from .model import DSparkStep, load_dspark, save_dspark

NAME = "dspark"
# Measured on the shipped SmolLM2 drafter (BENCHMARKS.md, 2026-12-02): sequoia:8 reached tau 1.61 / 1.50
# (HumanEval / MT-Bench) and more tokens/s than chain:4 (1.40 / 1.30). It measures acceptance at compile
# time first (minutes on a CPU); pass --tree chain:K to skip that.
DEFAULT_TREE = "sequoia:8"
DRAFTS = FILLS_TREES = MEASURED_TREES = True
SAMPLED_CHILDREN = False  # a node's children depend on its token: no per-depth q to draw them from
ADAPTIVE = True  # its confidence head rates each draft: --adaptive applies (classes: sibling ranks)
NGRAM_BRANCH = True  # it fills a static tree from graphs: --ngram-branch adds lookup's branch
OPTIONS = frozenset({"drafter_path", "block_size"})


def check(cfg) -> None:
    drafter_path(cfg)


def drafter_path(cfg):
    return hidden_state.drafter_path(cfg, NAME, "a DSpark drafter directory (config.json + safetensors)"
                                     ", e.g. one written by `specc train --drafter dspark`")


def load(cfg, target_hf, tokenizer=None):
    drafter = load_dspark(drafter_path(cfg), cfg.torch_dtype)
    trained = drafter.config.block_size
    if cfg.block_size is not None and not 1 <= cfg.block_size <= trained:
        raise SpeccError(f"--block-size {cfg.block_size} is out of range: this DSpark drafter was trained on blocks "
                         f"of {trained} and runs on blocks of 1 to {trained}.")
    check_fits(drafter.config, target_hf.config, "DSpark", least_block=1)
    return drafter


def confidence_classes(entry: dict, tree: Tree) -> int:
    """Classes of its confidences (--adaptive): a node's sibling rank."""
    return max(tree.ranks) + 1


def calibration_depth(cfg, drafter) -> int:
    return cfg.block_size or drafter.config.block_size


def calibration_options(cfg, drafter) -> dict:
    # Rows attend both ways inside a block, so their drafts depend on its length: a measured tree
    # runs at the block length its comb was measured at, not the shortest one it fits in.
    return {"block_size": cfg.block_size or drafter.config.block_size}


def entry(cfg, drafter, tree: Tree) -> dict:
    c = drafter.config
    block = cfg.block_size if cfg.block_size is not None else run_block(c.block_size, tree.max_depth)
    if tree.max_depth > block:
        raise SpeccError(f"--tree {cfg.tree_spec} is {tree.max_depth} drafts deep, but the DSpark drafter's block of "
                         f"{block} gives {block}.")
    return {"kind": NAME, "block_size": block, "trained_block_size": c.block_size, "num_layers": c.num_layers,
            "target_layer_ids": c.target_layer_ids, "mask_token_id": c.mask_token_id,
            "markov_rank": drafter.markov_rank, "children": "topk", "confidence": True}


def save(drafter, folder, target_hf) -> None:
    save_dspark(drafter, folder)


def load_saved(folder, entry: dict, target_hf, dtype):
    return load_dspark(folder, dtype)


def taps(entry: dict, num_layers: int) -> tuple[int, ...]:
    return tuple(entry["target_layer_ids"])


def module(drafter, target: TargetModule, entry: dict, tree: Tree, cache_len: int) -> DSparkStep:
    return DSparkStep(drafter, target.embed_tokens, target.w_head, cache_len, entry["block_size"], tree)


def plans(tree: Tree, chunk: int, cache_len: int, backend: str, sampled, modes) -> list:
    return hidden_state.plans(tree, chunk, cache_len, backend, None, modes)


def runtime(graphs: dict, tree: Tree, entry: dict, chunk: int, device, weights=None):
    return hidden_state.runtime(graphs, tree, entry, chunk, device)
