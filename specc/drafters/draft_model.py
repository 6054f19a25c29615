"""Drafter kind `draft-model`: a smaller causal LM with the target's tokenizer (`--drafter-path`),
or the target's own first N layers (`--drafter-layers N`), decoding greedily with its own KV cache.
Its graphs are the target's prefill and plain graphs, captured over the draft model."""
from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import SpeccError
from ..models import load_model
from ..plans import GraphPlan, decode_plans, prefill_plans
from ..prefill import prefill
from ..target_module import TargetModule
from ..tree import Tree, chain

NAME = "draft-model"
DEFAULT_TREE = "chain:4"
DRAFTS = True
FILLS_TREES = MEASURED_TREES = SAMPLED_CHILDREN = ADAPTIVE = NGRAM_BRANCH = False
OPTIONS = frozenset({"drafter_path", "drafter_layers"})
TRAINER = None  # an existing model (or the target's first layers), not trained by specc


def check(cfg) -> None:
    pass


def load(cfg, target_hf, tokenizer=None):
    """The draft model's HF module (the target itself when truncating it) and its layer count."""
    if cfg.drafter_path is None:
        return target_hf, cfg.drafter_layers or max(1, target_hf.config.num_hidden_layers // 4), None
    d = load_model(cfg.drafter_path, cfg.torch_dtype, with_tokenizer=False)
    tv, dv = target_hf.lm_head.out_features, d.model.lm_head.out_features
    if tv != dv:
        raise SpeccError(f"the drafter's vocabulary ({dv} tokens) differs from the target's ({tv} tokens); "
                         f"a draft model must share the target's tokenizer.")
    return d.model, cfg.drafter_layers or d.model.config.num_hidden_layers, d.name


def entry(cfg, weights, tree) -> dict:
    model, layers, name = weights
    if name is None:
        return {"kind": NAME, "source": "target", "layers": layers}
    return {"kind": NAME, "source": "model", "layers": layers, "name": name}


def save(weights, folder, target_hf) -> None:
    model, _, name = weights
    if name is not None:  # a truncated target needs no files of its own
        model.save_pretrained(folder)


def load_saved(folder, entry: dict, target_hf, dtype):
    if entry["source"] == "target":
        return target_hf, entry["layers"], None
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval().requires_grad_(False)
    return model, entry["layers"], entry["name"]


def taps(entry: dict, num_layers: int) -> tuple[int, ...]:
    return ()


def module(weights, target: TargetModule, entry: dict, tree: Tree, cache_len: int) -> TargetModule:
    model, layers, name = weights
    # The target's first layers share its weights and keep caches of their own.
    return TargetModule(model, cache_len, n_layers=layers, share=target if name is None else None)


def plans(tree: Tree, chunk: int, cache_len: int, backend: str, sampled, modes) -> list[GraphPlan]:
    # The draft model drafts greedily whatever the generation's mode: one greedy graph serves every mode.
    greedy = (prefill_plans("draft_prefill", "draft", chunk, cache_len, backend, ("greedy",))
              + decode_plans("draft_step", "draft", chain(0), cache_len, backend, ("greedy",)))
    return [replace(p, name=p.base.name, mode=None) for p in greedy]


def runtime(graphs: dict, tree: Tree, entry: dict, chunk: int, device, weights=None):
    return DraftModelDrafter(tree, graphs["draft_prefill"], graphs["draft_step"], chunk, device)


class DraftModelDrafter:
    """Greedy drafts from the draft model's own graphs, one token per call."""

    needs_rows, q = False, None  # reads no target taps; deterministic drafts

    def __init__(self, tree: Tree, prefill_graph, step_graph, chunk: int, device="cpu"):
        if not tree.is_chain:
            raise SpeccError("the draft-model drafter proposes a chain in this version; use --tree chain:K.")
        self.k, self.prefill_graph, self.step_graph, self.chunk = tree.size - 1, prefill_graph, step_graph, chunk
        self.device = device

    def start(self, prompt_ids: list[int], mode: str, temperature, top_p, table=None) -> None:
        prefill(prompt_ids, {self.chunk: self.prefill_graph}, self.step_graph, "greedy", device=self.device)
        self.cached = len(prompt_ids)  # tokens whose K/V the drafter holds

    def _next(self, token: int, pos: int) -> int:
        root = self.step_graph(torch.tensor([token], device=self.device), torch.tensor(pos, device=self.device))[2]
        return int(root[0])  # a host-side drafter: one read per draft token

    def propose(self, committed: list[int]) -> tuple[list[int], bool]:
        nxt = None
        for pos in range(self.cached, len(committed)):  # catch up on tokens committed since last time
            nxt = self._next(committed[pos], pos)
        drafts = [nxt]
        for i in range(self.k - 1):
            drafts.append(self._next(drafts[-1], len(committed) + i))
        self.pending = len(committed)
        return drafts, True

    def accepted(self, committed: list[int], n_accepted: int) -> None:
        # Draft j (1-based) was fed for j < k, so the drafter already holds the accepted ones below k.
        self.cached = self.pending + min(n_accepted, self.k - 1)
