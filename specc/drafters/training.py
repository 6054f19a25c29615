"""What the model drafters' trainers share (each kind's train.py; specc/train.py runs them): the
losses toward the target's labels and hidden states, decoder layers started as copies of the
target's, and where a record's scored part begins. Kept apart from specc/train.py, which looks the
trainers up in the kinds' registry, so that a trainer importing these forms no import cycle."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def target_loss(logits, rec: dict, rows: torch.Tensor, soft: float) -> torch.Tensor:
    """Per-row loss [R] of drafter logits [R, V] whose labels are the record's positions `rows`:
    cross-entropy to the target's argmax, mixed with weight `soft` with the cross-entropy to the
    target's top-k distribution (renormalised; KL up to a constant) where the record has it."""
    logp = logits.float().log_softmax(-1)
    ce = -logp.gather(-1, rec["labels"][rows].long().unsqueeze(-1)).squeeze(-1)
    if not soft or "topk_ids" not in rec:
        return ce
    p = rec["topk_logp"][rows].float().softmax(-1)
    kl = -(p * logp.gather(-1, rec["topk_ids"][rows].long())).sum(-1)
    return (1 - soft) * ce + soft * kl


def hidden_loss(h, rec: dict, rows: torch.Tensor) -> torch.Tensor:
    """Per-row smooth-L1 [R] between drafter head inputs h [R, H] and the target's at the label
    positions `rows` (its post-norm hidden: what its LM head read to choose the label), EAGLE-style."""
    return F.smooth_l1_loss(h.float(), rec["hidden"][rows].float(), reduction="none").mean(-1)


def copy_target_layers(layers, target) -> None:
    """Drafter decoder layers start as copies of the target's last len(layers) layers: the weights that
    share a name and shape (DFlash's q_norm / k_norm, which Llama lacks, stay ones)."""
    for dst, src in zip(layers, target.model.layers[-len(layers):]):
        own = dst.state_dict()
        dst.load_state_dict({k: v for k, v in src.state_dict().items() if k in own and own[k].shape == v.shape},
                            strict=False)


def first_scored(rec: dict) -> int:
    """The record's first scored position (its length when it scores none)."""
    nz = rec["loss"].nonzero()
    return int(nz[0]) if len(nz) else len(rec["ids"])
