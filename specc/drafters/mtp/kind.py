"""Drafter kind `mtp`: MTP heads (DeepSeek-V3 or Qwen3-Next layout, one module reused at every
depth) conditioned on the target's hidden after the final norm (model.py: model and formats;
train.py: its trainer)."""
from __future__ import annotations

from ...draft_tokens import draft_slots
from ...errors import SpeccError
from ...target_module import TargetModule
from ...tree import Tree
from .. import hidden_state
from .model import MTPStep, check_engine_heads, load_mtp, save_deepseek_v3

NAME = "mtp"
DEFAULT_TREE = "chain:1"  # the fastest measured with the shipped SmolLM2 heads (BENCHMARKS.md, 2026-11-30)
DRAFTS = FILLS_TREES = MEASURED_TREES = SAMPLED_CHILDREN = True
ADAPTIVE = False  # its drafts carry no confidences the host loop reads yet
NGRAM_BRANCH = True  # it fills a static tree from graphs: --ngram-branch adds lookup's branch
OPTIONS = frozenset({"drafter_path"})
CALIBRATION_DEPTH = 4


def check(cfg) -> None:
    drafter_path(cfg)


def drafter_path(cfg):
    return hidden_state.drafter_path(cfg, NAME, "an MTP checkpoint in the DeepSeek-V3 or Qwen3-Next layout"
                                     ", e.g. one written by `specc train --drafter mtp`")


def load(cfg, target_hf, tokenizer=None):
    path = drafter_path(cfg)
    heads = load_mtp(path, target_hf)  # refuses a checkpoint of another hidden size
    check_engine_heads(heads)
    return heads


def calibration_depth(cfg, heads) -> int:
    return CALIBRATION_DEPTH


def calibration_options(cfg, weights) -> dict:
    return {}


def entry(cfg, heads, tree: Tree) -> dict:
    c = heads.config
    return {"kind": NAME, "depth": tree.max_depth, "trained_depth": c.depth, "num_modules": c.num_modules,
            "order": c.order, "feedback": c.feedback, "has_final_norm": c.has_final_norm,
            **hidden_state.sampled_entry(cfg.children, tree.max_depth, draft_slots(tree)[2])}


def save(heads, folder, target_hf) -> None:
    # The engine holds the target's head and embedding: no copies.
    save_deepseek_v3(heads, folder, target_hf, shared_copies=False)


def load_saved(folder, entry: dict, target_hf, dtype):
    return load_mtp(folder, target_hf)


def taps(entry: dict, num_layers: int) -> tuple[int, ...]:
    return (num_layers,)  # the hidden after the final norm


def module(heads, target: TargetModule, entry: dict, tree: Tree, cache_len: int) -> MTPStep:
    return MTPStep(heads, target.embed_tokens, target.norm, target.w_head, target.rotary_emb, cache_len,
                   tree.max_depth, tree, sampled=entry["children"] == "sampled")


def plans(tree: Tree, chunk: int, cache_len: int, backend: str, sampled, modes) -> list:
    return hidden_state.plans(tree, chunk, cache_len, backend, sampled, modes)


def runtime(graphs: dict, tree: Tree, entry: dict, chunk: int, device, weights=None):
    return hidden_state.runtime(graphs, tree, entry, chunk, device)
