"""Drafter kind `dflash`: a block-diffusion drafter over the target's hidden states of a few
layers. The package is the kind: the protocol's names (specc/drafters/__init__.py) come from
kind.py; model.py holds the model and its published format, train.py the trainer that
`specc train --drafter dflash` runs (TRAINER)."""
from __future__ import annotations

from .kind import (ADAPTIVE, DEFAULT_TREE, DRAFTS, FILLS_TREES, MEASURED_TREES, NAME, NGRAM_BRANCH, OPTIONS,
                   SAMPLED_CHILDREN, calibration_depth, calibration_options, check, drafter_path, entry, load,
                   load_saved, module, plans, runtime, save, taps)
from .train import DFlashTrainer

TRAINER = DFlashTrainer
