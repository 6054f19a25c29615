"""The MTP heads' trainer (`specc train --drafter mtp`): specc/train.py's loop calls it."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ..training import copy_target_layers, first_scored, hidden_loss, target_loss
from .model import build_heads, load_deepseek_v3, save_deepseek_v3, target_parts


class MTPTrainer:
    """Trains MTP heads on the target's post-norm hidden states (a record's `hidden`), one module
    reused at every depth when there are fewer modules than depths; saved in the DeepSeek-V3 layout."""

    layer_ids = ()
    BLOCK_SIZE = 5  # the default --block-size: depth + 1
    MIN_BLOCK = 2  # one draft token
    READS_TAPS, READS_HIDDEN = False, True  # the target features its records need
    PACKS = False  # a record is one sequence: its depths' rows do not stop at a packed sequence's end

    def __init__(self, model, cfg, mask_token_id: int, recs=()):
        self.model, self.cfg = model, cfg
        self.depth = cfg.block_size - 1
        self.heads = build_heads(model, num_modules=cfg.layers, depth=self.depth)
        if cfg.init == "target":
            with torch.no_grad():
                copy_target_layers([m.layer for m in self.heads.mtp], model)
        self.parts = target_parts(model)

    def _hidden(self, rec):
        """Per depth d = 1..D: the LM head's inputs [N-d, H] (the final norm applied) whose row i is
        labelled at position i+d (the target's argmax there: its prediction of token i+d+1). The head
        itself is applied by the caller to the rows it scores: it is most of the compute."""
        parts = {**self.parts, "lm_head": torch.nn.Identity()}
        return [h[0] for h in self.heads.forward_train(rec["hidden"].float()[None], rec["ids"].long()[None], **parts)]

    def loss(self, rec, gen):
        """Depth d row i counts where position i+d is scored and, for d >= 2, where the tokens it reads
        after the root (t_{i+2} .. t_{i+d}) are the target's greedy choices: at run time they are the
        previous depths' drafts, and a chain only goes on while those are accepted."""
        total, D, head = 0.0, self.depth, self.parts["lm_head"].weight
        for d, (h, rows) in enumerate(zip(self._hidden(rec), self.counted(rec)), start=1):
            if self.cfg.rows and len(rows) > self.cfg.rows:  # the LM head is most of the step: score a sample
                rows = rows[torch.randperm(len(rows), generator=gen)[:self.cfg.rows].to(rows.device)].sort().values
            if len(rows):
                per_row = target_loss(F.linear(h[rows], head), rec, rows + d, self.cfg.soft)
                if self.cfg.regress:
                    per_row = per_row + self.cfg.regress * hidden_loss(h[rows], rec, rows + d)
                total = total + per_row.mean() / D
        return total if torch.is_tensor(total) else None

    def counted(self, rec) -> list[torch.Tensor]:
        """Per depth d = 1..D, the rows i that count (see loss)."""
        ids, labels = rec["ids"].long(), rec["labels"].long()
        follows = ids[1:] == labels[:-1]  # follows[j]: token j+1 is the target's greedy choice after j
        on_path, out = torch.ones(len(ids), dtype=torch.bool, device=ids.device), []
        for d in range(1, self.depth + 1):
            n = max(len(ids) - d, 0)
            if d >= 2:
                on_path = on_path[:n] & follows[d - 1:d - 1 + n]
            out.append((rec["loss"][d:d + n] & on_path[:n]).nonzero().view(-1))
        return out

    def shorter_blocks(self) -> list[int]:
        return []  # a chain of depths has no block lengths to vary

    @torch.no_grad()
    def accepted(self, rec, block=None):
        N, D = len(rec["ids"]), self.depth
        lo, hi = first_scored(rec), N - D  # rows whose every depth has a label
        if hi <= lo:
            return torch.zeros(0, D, dtype=torch.bool, device=rec["ids"].device)
        hidden, head = self._hidden(rec), self.parts["lm_head"].weight
        rows, labels = torch.arange(lo, hi, device=rec["ids"].device), rec["labels"].long()
        return torch.stack([F.linear(hidden[d - 1][rows], head).argmax(-1) == labels[rows + d]
                            for d in range(1, D + 1)], dim=1)

    def save(self, path: Path) -> None:
        save_deepseek_v3(self.heads, path, self.model)

    def load(self, path: Path) -> None:
        self.heads.load_state_dict(load_deepseek_v3(path, self.model).state_dict())

    def parameters(self):
        return self.heads.parameters()

    def named_parameters(self):
        return self.heads.named_parameters()
