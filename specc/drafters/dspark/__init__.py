"""Drafter kind `dspark`: DFlash's backbone with every block row drafting, a Markov head and a
confidence head. The package is the kind: the protocol's names (specc/drafters/__init__.py) come
from kind.py; model.py holds the model and its format, train.py the trainer that
`specc train --drafter dspark` runs (TRAINER)."""
from __future__ import annotations

from .kind import (ADAPTIVE, DEFAULT_TREE, DRAFTS, FILLS_TREES, MEASURED_TREES, NAME, NGRAM_BRANCH, OPTIONS,
                   SAMPLED_CHILDREN, calibration_depth, calibration_options, check, confidence_classes,
                   drafter_path, entry, load, load_saved, module, plans, runtime, save, taps)
from .train import DSparkTrainer

TRAINER = DSparkTrainer
