"""Drafter kind `dflash`: a block-diffusion drafter over the target's hidden states of a few
layers (model.py: model and published format; train.py: its trainer). A tree of depth D runs on
the shortest block length the drafter was trained on that has D + 1 rows (drafting cost grows with
the block; the rows' outputs depend on its length) unless `--block-size` says; a measured tree runs
at the length its comb was measured at."""
from __future__ import annotations

from ...draft_tokens import draft_slots
from ...errors import SpeccError
from ...target_module import TargetModule
from ...tree import Tree
from .. import hidden_state
from .model import DFlashStep, check_fits, load_dflash, run_block, save_dflash

NAME = "dflash"
DEFAULT_TREE = "chain:3"  # block 4: the fastest measured with the shipped SmolLM2 drafter (BENCHMARKS.md)
DRAFTS = FILLS_TREES = MEASURED_TREES = SAMPLED_CHILDREN = True
ADAPTIVE = False  # its drafts carry no confidences the host loop reads yet
NGRAM_BRANCH = True  # it fills a static tree from graphs: --ngram-branch adds lookup's branch
OPTIONS = frozenset({"drafter_path", "block_size"})


def check(cfg) -> None:
    drafter_path(cfg)


def drafter_path(cfg):
    return hidden_state.drafter_path(cfg, NAME, "a DFlash drafter directory (config.json + safetensors)"
                                     ", e.g. one written by `specc train`")


def load(cfg, target_hf, tokenizer=None):
    path = drafter_path(cfg)
    drafter = load_dflash(path, cfg.torch_dtype)
    trained = drafter.config.block_size
    if cfg.block_size is not None and not 2 <= cfg.block_size <= trained:
        raise SpeccError(f"--block-size {cfg.block_size} is out of range: this DFlash drafter was trained on blocks "
                         f"of {trained} and runs on blocks of 2 to {trained}.")
    check_fits(drafter.config, target_hf.config)
    return drafter


def calibration_depth(cfg, drafter) -> int:
    return (cfg.block_size or drafter.config.block_size) - 1


def calibration_options(cfg, drafter) -> dict:
    # Rows attend both ways inside a block, so their drafts depend on its length: a measured tree
    # runs at the block length its comb was measured at, not the shortest one it fits in.
    return {"block_size": cfg.block_size or drafter.config.block_size}


def entry(cfg, drafter, tree: Tree) -> dict:
    c = drafter.config
    block = cfg.block_size if cfg.block_size is not None else run_block(c.block_size, tree.max_depth + 1)
    if tree.max_depth + 1 > block:
        raise SpeccError(f"--tree {cfg.tree_spec} is {tree.max_depth} drafts deep, but the DFlash drafter's block of "
                         f"{block} gives {block - 1}.")
    return {"kind": NAME, "block_size": block, "trained_block_size": c.block_size, "num_layers": c.num_layers,
            "target_layer_ids": c.target_layer_ids, "mask_token_id": c.mask_token_id,
            **hidden_state.sampled_entry(cfg.children, block - 1, draft_slots(tree)[2])}


def save(drafter, folder, target_hf) -> None:
    save_dflash(drafter, folder)


def load_saved(folder, entry: dict, target_hf, dtype):
    return load_dflash(folder, dtype)


def taps(entry: dict, num_layers: int) -> tuple[int, ...]:
    return tuple(entry["target_layer_ids"])


def module(drafter, target: TargetModule, entry: dict, tree: Tree, cache_len: int) -> DFlashStep:
    return DFlashStep(drafter, target.embed_tokens, target.w_head, cache_len, entry["block_size"], tree,
                      sampled=entry["children"] == "sampled")


def plans(tree: Tree, chunk: int, cache_len: int, backend: str, sampled, modes) -> list:
    return hidden_state.plans(tree, chunk, cache_len, backend, sampled, modes)


def runtime(graphs: dict, tree: Tree, entry: dict, chunk: int, device, weights=None):
    return hidden_state.runtime(graphs, tree, entry, chunk, device)
