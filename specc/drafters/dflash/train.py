"""The DFlash drafter's trainer (`specc train --drafter dflash`): specc/train.py's loop calls it, and
DSpark's trainer extends it."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ..training import copy_target_layers, first_scored, hidden_loss, target_loss
from .model import (DFlashDrafter, block_hidden, dflash_config_for, load_dflash, position_weights, save_dflash,
                    segment_starts, trained_blocks)


class DFlashTrainer:
    """Trains fc on scaled inputs: LLM hidden states carry a few "massive" dimensions (SmolLM2's
    layers 14 and 27 reach |x| ~ 25000 where a row's RMS is ~10), so one Adam step on fc's columns
    for those dimensions swings its output wildly, and at initialisation they swamp the context
    feature after hidden_norm. Training therefore sees every tapped dimension divided by its RMS over
    a few training sequences (a fixed vector), and the saved fc.weight has that scale folded back in:
    the checkpoint is the published format and computes exactly the trained function.

    `rec` arguments are one sequence's record (sequence_features / specc.features), or several
    sequences packed back to back with their lengths in `segments` (FeatureStream): each block then
    sees its own sequence's context only, at positions counted from that sequence's start, and its rows
    count only inside it, so a packed record trains what its sequences would one by one. The drafter
    lives on the target's device, and the records must too."""

    BLOCK_SIZE = 16  # the default --block-size: B - 1 drafts
    MIN_BLOCK = 2  # one draft token
    READS_TAPS, READS_HIDDEN = True, False  # the target features its records need (taps; hidden with --regress)
    PACKS = True  # a --feature-stream record may pack several sequences (`segments`)

    def __init__(self, model, cfg, mask_token_id: int, recs=()):
        self.model, self.cfg = model, cfg
        self.device = next(model.parameters()).device
        self.drafter = DFlashDrafter(dflash_config_for(model.config, num_layers=cfg.layers, block_size=cfg.block_size,
                                                       num_taps=cfg.taps, mask_token_id=mask_token_id))
        # The target's final norm is where the drafter's output lands (its LM head's input): start there.
        with torch.no_grad():
            self.drafter.norm.weight.copy_(model.model.norm.weight)
            if cfg.init == "target":
                copy_target_layers(self.drafter.layers, model)
        self.embed = model.get_input_embeddings()
        self.head = model.get_output_embeddings().weight
        self.weights = position_weights(cfg.block_size).to(self.device)
        self.scale = torch.ones(self.drafter.fc.in_features, device=self.device)
        if recs:
            sq = torch.cat([r["taps"].float() for r in recs[:8]]).pow(2).mean(0)
            self.scale = (1.0 / sq.sqrt().clamp(min=1e-3)).to(self.device)
        self.drafter.to(self.device)

    @property
    def layer_ids(self):
        return self.drafter.config.target_layer_ids

    def _logits(self, rec, anchors, block=None, lengths=None, head=True):
        """(logits [nb, D, V], label positions [nb, D], valid [nb, D]) of the D drafting rows of each
        block: row k of anchor a predicts token a+k (DFlash; rows 1..B-1) or a+k+1 (DSpark, FIRST_ROW 0:
        rows 0..B-1), whose label is the target's argmax one position earlier; a row counts where that
        position is scored and, past the first draft, where the text from a+1 on followed the target's
        greedy path (the only context a chain of drafts reaches). head=False: hidden states [nb, D, H]."""
        ids = rec["ids"].long()
        dev, N = ids.device, len(ids)
        starts = segment_starts(rec["segments"]) if "segments" in rec else None
        hidden = block_hidden(self.drafter, self.embed, rec["taps"].float() * self.scale, ids, anchors, block,
                              lengths, starts)[:, self.FIRST_ROW:]
        D = hidden.shape[1]
        pos = anchors.view(-1, 1) + torch.arange(D, device=dev)  # the label position of each row
        if starts is None:
            end = N
        else:  # the end of each anchor's own sequence [nb, 1]
            seg = rec["segments"]
            end = torch.repeat_interleave(torch.cumsum(seg, 0), seg)[anchors].view(-1, 1)
        inside = pos < end
        pos = torch.where(inside, pos, end - 1)
        on_path = torch.ones_like(inside)
        if D > 1:  # the tokens before a row's own, from a+1 on, equal the labels one position earlier
            follows = torch.cat([ids[1:] == rec["labels"][:-1].long(), torch.zeros(1, dtype=torch.bool, device=dev)])
            on_path[:, 1:] = follows[pos[:, :-1]].cumprod(dim=1).bool()
        valid = inside & rec["loss"][pos] & on_path
        return (F.linear(hidden, self.head) if head else hidden), pos, valid

    FIRST_ROW = 1  # the first block row that drafts (DSpark: 0)

    def _blocks(self, rec, gen):
        """Random anchors among the scored positions, each with a run-time block length; None if none."""
        lo, N, dev = first_scored(rec), len(rec["ids"]), rec["ids"].device
        cand = lo + rec["loss"][lo:].nonzero().view(-1) if lo < N else torch.zeros(0, dtype=torch.long, device=dev)
        if len(cand) == 0:
            return None
        # The draws come from the CPU generator whatever the device: a run draws the same anchors anywhere.
        anchors = cand[torch.randperm(len(cand), generator=gen)[: self.cfg.anchors].to(dev)].sort().values
        # Each block is as long as one of the run-time block sizes, so one drafter serves them all.
        sizes = torch.tensor(trained_blocks(self.cfg.block_size))
        return anchors, sizes[torch.randint(len(sizes), (len(anchors),), generator=gen)].to(dev)

    def loss(self, rec, gen):
        blocks = self._blocks(rec, gen)
        if blocks is None:
            return None
        anchors, lengths = blocks
        hidden, pos, valid = self._logits(rec, anchors, lengths=lengths, head=False)
        drafting = torch.arange(self.FIRST_ROW, self.cfg.block_size, device=lengths.device) < lengths.view(-1, 1)
        w = self.weights.view(1, -1) * valid * drafting
        rows = w.reshape(-1).nonzero().view(-1)  # the LM head (most of the compute) on counted rows only
        if len(rows) == 0:
            return None
        h, pos = hidden.reshape(-1, hidden.shape[-1])[rows], pos.reshape(-1)[rows]
        per_row = self._row_loss(h, rec, pos)
        if self.cfg.regress:
            per_row = per_row + self.cfg.regress * hidden_loss(h, rec, pos)
        return (per_row * w.reshape(-1)[rows]).sum() / w.sum()

    def _row_loss(self, h, rec, pos):
        return target_loss(F.linear(h, self.head), rec, pos, self.cfg.soft)

    def _draft_logits(self, rec, anchors, block):
        """(logits [nb, drafts, V], label positions [nb, drafts]) of blocks of `block` rows."""
        logits, pos, _ = self._logits(rec, anchors, block)
        return logits, pos

    def shorter_blocks(self) -> list[int]:
        """The run-time block lengths below the trained one, which evaluate() scores too (tau_block{b})."""
        return trained_blocks(self.cfg.block_size)[:-1]

    @torch.no_grad()
    def accepted(self, rec, block=None):
        """Per anchor with a full block (of `block` rows, default the trained size) inside the scored
        part of the sequence: drafts matching the target, as a chain."""
        B, N, dev = block or self.cfg.block_size, len(rec["ids"]), rec["ids"].device
        drafts = B - self.FIRST_ROW
        lo, hi = first_scored(rec), N - drafts
        if hi <= lo:
            return torch.zeros(0, drafts, dtype=torch.bool, device=dev)
        anchors = torch.arange(lo, hi)
        anchors = anchors[torch.linspace(0, len(anchors) - 1, min(64, len(anchors))).long()].to(dev)
        logits, pos = self._draft_logits(rec, anchors, block)
        return logits.argmax(-1) == rec["labels"][pos].long()

    def save(self, path: Path) -> None:
        import copy

        folded = copy.deepcopy(self.drafter).cpu()
        with torch.no_grad():
            folded.fc.weight.mul_(self.scale.cpu())
        self._write(folded, path)

    def load(self, path: Path) -> None:
        self.drafter.load_state_dict(self._read(path).state_dict())
        with torch.no_grad():
            self.drafter.fc.weight.div_(self.scale)

    def _write(self, drafter, path: Path) -> None:
        save_dflash(drafter, path)

    def _read(self, path: Path):
        return load_dflash(path)

    def parameters(self):
        return self.drafter.parameters()

    def named_parameters(self):
        return self.drafter.named_parameters()
