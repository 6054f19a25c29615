"""Drafter kind `mtp`: MTP heads (DeepSeek-V3 or Qwen3-Next layout) over the target's hidden after
the final norm. The package is the kind: the protocol's names (specc/drafters/__init__.py) come
from kind.py; model.py holds the heads and their checkpoint formats, train.py the trainer that
`specc train --drafter mtp` runs (TRAINER)."""
from __future__ import annotations

from .kind import (ADAPTIVE, CALIBRATION_DEPTH, DEFAULT_TREE, DRAFTS, FILLS_TREES, MEASURED_TREES, NAME,
                   NGRAM_BRANCH, OPTIONS, SAMPLED_CHILDREN, calibration_depth, calibration_options, check,
                   drafter_path, entry, load, load_saved, module, plans, runtime, save, taps)
from .train import MTPTrainer

TRAINER = MTPTrainer
