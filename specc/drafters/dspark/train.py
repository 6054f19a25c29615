"""The DSpark drafter's trainer (`specc train --drafter dspark`): DFlash's, with DSpark's heads and loss."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ..dflash.model import dflash_config_for, position_weights
from ..dflash.train import DFlashTrainer
from .model import DSparkDrafter, load_dspark, save_dspark


class DSparkTrainer(DFlashTrainer):
    """DFlash's trainer (fc on scaled inputs, anchors, run-time block sizes, the greedy-path mask)
    with every block row scored and DSpark's heads and loss (arXiv 2607.05147): per row k (weight
    exp(-k/gamma)), 0.1 x cross-entropy to the target's argmax + 0.9 x the total variation between the
    drafter's and the target's distributions + 1.0 x a cross-entropy of the confidence head toward
    1 - TV (TV held fixed there). The target's distribution is its top-k from the features plus one
    cell for the rest of the vocabulary (TV over that partition: a lower bound of the full one), or
    its argmax alone where a record has no top-k. The Markov head reads the text's token before each
    row's label, which on the greedy path (the only rows counted past the first) is the previous draft."""

    CE, TV, CONF = 0.1, 0.9, 1.0
    FIRST_ROW = 0
    BLOCK_SIZE = 7  # the default --block-size: B drafts
    MIN_BLOCK = 1  # one draft token

    def __init__(self, model, cfg, mask_token_id: int, recs=()):
        super().__init__(model, cfg, mask_token_id, recs)
        dense = self.drafter.state_dict()
        self.drafter = DSparkDrafter(dflash_config_for(model.config, num_layers=cfg.layers, block_size=cfg.block_size,
                                                       num_taps=cfg.taps, mask_token_id=mask_token_id), cfg.markov_rank)
        self.drafter.load_state_dict(dense, strict=False)  # the backbone as DFlash's trainer set it up
        self.drafter.to(self.device)
        self.weights = position_weights(cfg.block_size + 1).to(self.device)  # B drafts weighted like DFlash's B+1

    def _heads(self, h, rec, pos):
        """(draft logits [R, V], confidence logits [R]) of rows h [R, H] whose labels sit at `pos`."""
        return self.drafter.heads(F.linear(h, self.head), h, rec["ids"][pos].long())

    def _row_loss(self, h, rec, pos):
        logits, conf = self._heads(h, rec, pos)
        logp = logits.float().log_softmax(-1)
        ce = -logp.gather(-1, rec["labels"][pos].long().unsqueeze(-1)).squeeze(-1)
        tv = total_variation(logp.exp(), rec, pos)
        conf_loss = F.binary_cross_entropy_with_logits(conf.float(), (1 - tv).detach().clamp(0, 1), reduction="none")
        return self.CE * ce + self.TV * tv + self.CONF * conf_loss

    def _draft_logits(self, rec, anchors, block):
        # A chain's Markov input past the anchor is the previous draft; while the chain is accepted that
        # is the target's label one position earlier (training reads the text's token instead: the same
        # on the rows it counts, which follow the greedy path).
        hidden, pos, _ = self._logits(rec, anchors, block, head=False)
        prev = torch.cat((rec["ids"][pos[:, :1]], rec["labels"][pos[:, :-1]]), dim=1).long()
        h = hidden.reshape(-1, hidden.shape[-1])
        logits, _ = self.drafter.heads(F.linear(h, self.head), h, prev.reshape(-1))
        return logits.view(*pos.shape, -1), pos

    def _write(self, drafter, path: Path) -> None:
        save_dspark(drafter, path)

    def _read(self, path: Path):
        return load_dspark(path)


def total_variation(p, rec: dict, rows: torch.Tensor) -> torch.Tensor:
    """½‖p - p_target‖₁ per row [R] for drafter probabilities p [R, V] at the record's positions
    `rows`: over the target's top-k and one cell for the rest of the vocabulary where the record has
    its top-k (a lower bound of the full distance), else against its argmax (exact: 1 - p(label))."""
    if "topk_ids" not in rec:
        return 1 - p.gather(-1, rec["labels"][rows].long().unsqueeze(-1)).squeeze(-1)
    pt = rec["topk_logp"][rows].float().exp()
    pd = p.gather(-1, rec["topk_ids"][rows].long())
    rest = ((1 - pd.sum(-1)) - (1 - pt.sum(-1))).abs()
    return 0.5 * ((pd - pt).abs().sum(-1) + rest)
