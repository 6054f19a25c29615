"""Drafter kinds, registered by their CLI name. Each kind is one module of this package that
implements the protocol below; adding a kind is one new module and one line in KINDS. A model
drafter is one package (mtp/, dflash/, dspark/) that is its kind: model.py (the model and its
checkpoint format), kind.py (the protocol, re-exported by its __init__) and train.py (its trainer);
training.py holds what their trainers share, hidden_state.py what their graphs and runtime share.

Constants:
    NAME                the CLI name
    DEFAULT_TREE        the --tree used when none is given
    DRAFTS              whether it proposes draft tokens at all (`none` does not)
    FILLS_TREES         whether it fills trees (else chains only)
    MEASURED_TREES      whether --tree sequoia:BUDGET / auto can measure its ranked candidates
    SAMPLED_CHILDREN    whether --children sampled applies
    ADAPTIVE            whether --adaptive applies (specc/adaptive.py): the kind then also has
                        confidence_classes(entry, tree) -> int, and its runtime side confidences()
    NGRAM_BRANCH        whether --ngram-branch applies (specc/hybrid.py): it fills a static tree with
                        deterministic drafts from its graphs, which the host may overwrite
    OPTIONS             the CompileConfig fields of drafter options it takes (drafter_path, ...)
    TRAINER             the class that trains it (`specc train --drafter NAME`; None for kinds that are not
                        trained); see "A trainer" below

Functions (cfg: CompileConfig; target_hf: the Hugging Face target; weights: whatever `load` returns):
    check(cfg)                                     refusals that need no model (before any slow work)
    load(cfg, target_hf, tokenizer) -> weights     the drafter for a compile (refuses one that does not fit;
                                                   tokenizer: the target's, or None)
    calibration_depth(cfg, weights) -> int         the deepest comb a measured tree may use
    calibration_options(cfg, weights) -> dict      CompileConfig fields that a measured tree's engines
                                                   keep as the comb had them (a block drafter's block)
    entry(cfg, weights, tree) -> dict              its manifest entry ("kind" and what load_saved needs)
    save(weights, folder, target_hf)               its files in the engine (folder: ENGINE/draft)
    load_saved(folder, entry, target_hf, dtype) -> weights
    taps(entry, num_layers) -> tuple[int, ...]     the target hidden states it reads (TargetModule taps)
    module(weights, target, entry, tree, cache_len) -> nn.Module | None   what the compiler captures
    plans(tree, chunk, cache_len, backend, sampled, modes) -> list[GraphPlan]  its graphs (specc.plans)
    runtime(graphs, tree, entry, chunk, device, weights) -> RuntimeDrafter | None  its side of the host
                                                   loop (weights: what load_saved returned)

A RuntimeDrafter has the attributes `needs_rows` (it reads the target's taps: `add_rows(rows,
start)`) and `q` (the last proposal's q, with sampled children), and the methods start(prompt_ids, mode, temperature, top_p, table) (table:
the generation's uniforms, signature.uniform_columns; None when greedy), propose(committed) ->
(drafts, found) (drafts: a list of ints, or a tensor on the engine's device that never visits the
host) and accepted(committed, n_accepted); with ADAPTIVE, also confidences() -> (class, or a list
of a class per drafted node; [a number in [0, 1] per drafted node]) for the last proposal (the
adaptive engine calibrates them into acceptance rates per class).

A trainer (specc/train.py's loop; cfg: specc.train.TrainConfig; rec: one training record, a dict of
tensors, specc.features) is built as TRAINER(target, cfg, mask_token_id, recs) (recs: a few training
records, e.g. for input scales) and has the class attributes BLOCK_SIZE (the default --block-size),
MIN_BLOCK (the least one), READS_TAPS and READS_HIDDEN (the target features its records need: taps,
the post-norm hidden), PACKS (whether a record may pack several sequences, --pack-tokens), and the
methods loss(rec, gen) -> scalar tensor or None (nothing to score; gen: the step's CPU generator),
accepted(rec, block=None) -> bool [anchors, drafts] (held-out greedy matches, blocks of `block`
rows), shorter_blocks() -> [block lengths] (also evaluated: tau_block{b}), parameters(),
named_parameters(), save(folder) (the published format) and load(folder).
"""
from __future__ import annotations

from ..errors import SpeccError
from . import dflash, draft_model, dspark, mtp, ngram, none

KINDS = {kind.NAME: kind for kind in (none, ngram, draft_model, mtp, dflash, dspark)}


def get_kind(name: str):
    """The drafter kind registered as `name`, or one sentence saying what to use instead."""
    if name in KINDS:
        return KINDS[name]
    usable = ", ".join(KINDS)
    raise SpeccError(f"--drafter {name!r} is unknown; use one of {usable}.")


def kinds_with(attribute: str, member: str | None = None) -> str:
    """The kinds whose `attribute` is true (or, with `member`, contains it), as "a, b or c": for messages."""
    names = [n for n, k in KINDS.items() if (member in getattr(k, attribute) if member else getattr(k, attribute))]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
