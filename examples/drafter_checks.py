"""Bug checks for drafter training on SmolLM2 (issue 14, item 1): can the pipeline memorise, and what
do trivial baselines reach on the same data?

1. Memorisation: MTP heads and a DFlash drafter trained on N regenerated ShareGPT sequences (the
   target's own greedy responses) and evaluated on the same N. A correct pipeline memorises them:
   tau far above 2. An offset or mask bug caps it near 1.
2. Baselines on held-out sequences (the training runs' held-out set), fitted on the training records:
   * bigram: the target's next token predicted from the current token alone (a count table);
   * linear probe: lm_head(norm(A . hnorm(h_i) + B . enorm(Emb(t_{i+1})))), the MTP head without its
     decoder block (A, B: H x H, Adam);
   * the shipped MTP heads, and (with --mtp) any others.
   The score is depth-1 accuracy: the share of positions where the prediction of the token after
   next (t_{i+2}, from h_i and t_{i+1}) equals the target's greedy choice. A head that reaches only
   the bigram's accuracy does not read the target's hidden state.

Usage: python examples/drafter_checks.py [--memorise 8] [--steps 300] [--held-out 24] [--train 200]
           [--features DIR] [--probe-steps 600] [--json]
Training records for the baselines: --features (teacher-forced, specc.features) when given, else
--train regenerated sequences. Prints a markdown report (or --json).
"""
import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from specc.models import quiet_libraries


def regenerated(target, tokenizer, eos, first: int, n: int, response_len: int):
    """Records of n regenerated ShareGPT sequences, from the first+1-th usable prompt on."""
    from specc.train import TrainConfig, build_sequences, eval_set_prompts, sequence_features, sharegpt_pairs

    cfg = TrainConfig(response_len=response_len, gen_batch=16)
    pairs = sharegpt_pairs(first + n, eval_set_prompts())[first:]
    seqs = build_sequences(target, tokenizer, pairs, cfg, eos, True, f"regenerate {n}")
    return sequence_features(target, seqs, [], True, True)


def memorise(target, recs, kind: str, steps: int, mask: int) -> dict:
    from specc.drafters import get_kind
    from specc.drafters.dflash.model import default_layer_ids
    from specc.train import TrainConfig, evaluate, sequence_features

    cfg = TrainConfig(drafter=kind, layers=1, block_size=5 if kind == "mtp" else 8, lr=1e-3, anchors=64)
    if kind == "dflash":  # DFlash reads taps: recompute the records with them
        ids = [(r["ids"], int(r["loss"].nonzero()[0]) + 1) for r in recs]
        recs = sequence_features(target, ids, default_layer_ids(target.config.num_hidden_layers, cfg.taps), False, True)
    tr = get_kind(kind).TRAINER(target, cfg, mask, recs)
    opt = torch.optim.AdamW(tr.parameters(), lr=cfg.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    before = evaluate(tr, recs)
    t0 = time.perf_counter()
    for step in range(steps):
        loss = tr.loss(recs[step % len(recs)], gen)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(tr.parameters()), 1.0)
        opt.step()
    return {"before": before, "after": evaluate(tr, recs), "steps": steps, "seconds": round(time.perf_counter() - t0)}


def bigram_accuracy(train_recs, held_recs) -> float:
    """Depth-1 rows of held-out: predict label[i+1] (the target's choice after t_{i+1}) from t_{i+1}."""
    table: dict[int, dict[int, int]] = {}
    for r in train_recs:
        for t, y, m in zip(r["ids"].tolist(), r["labels"].tolist(), r["loss"].tolist()):
            if m:
                row = table.setdefault(t, {})
                row[y] = row.get(y, 0) + 1
    best = {t: max(row, key=row.get) for t, row in table.items()}
    hits = total = 0
    for r in held_recs:
        ids, labels, loss = r["ids"].tolist(), r["labels"].tolist(), r["loss"].tolist()
        for j in range(1, len(ids)):
            if loss[j - 1] and loss[j]:  # row i = j-1 is scored at depth 1 (label j)
                hits += best.get(ids[j]) == labels[j]
                total += 1
    return hits / max(total, 1)


class Probe(torch.nn.Module):
    def __init__(self, target):
        super().__init__()
        H = target.config.hidden_size
        norm = type(target.model.norm)
        self.hnorm, self.enorm = norm(H, eps=target.config.rms_norm_eps), norm(H, eps=target.config.rms_norm_eps)
        self.proj = torch.nn.Linear(2 * H, H, bias=False)
        self.target = [target]  # not a submodule: frozen, not trained

    def forward(self, hidden, next_ids):
        t = self.target[0]
        x = self.proj(torch.cat([self.enorm(t.get_input_embeddings()(next_ids)), self.hnorm(hidden)], dim=-1))
        return t.lm_head(t.model.norm(x))


def _depth1(rec):
    """(hidden [R, H], next ids [R], labels [R]) of a record's scored depth-1 rows."""
    n = len(rec["ids"])
    rows = torch.arange(n - 1)
    keep = rec["loss"][rows] & rec["loss"][rows + 1]
    rows = rows[keep]
    return rec["hidden"][rows].float(), rec["ids"][rows + 1].long(), rec["labels"][rows + 1].long()


def probe_accuracy(target, train_recs, held_recs, steps: int) -> float:
    probe = Probe(target)
    opt = torch.optim.AdamW(probe.parameters(), lr=1e-3, weight_decay=0.0)
    for step in range(steps):
        h, x, y = _depth1(train_recs[step % len(train_recs)])
        if len(y) == 0:
            continue
        loss = F.cross_entropy(probe(h, x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    hits = total = 0
    with torch.no_grad():
        for r in held_recs:
            h, x, y = _depth1(r)
            hits += int((probe(h, x).argmax(-1) == y).sum())
            total += len(y)
    return hits / max(total, 1)


def mtp_accuracy(target, heads_dir, held_recs) -> list[float]:
    from specc.drafters.mtp.model import load_deepseek_v3, target_parts
    from specc.drafters.mtp.train import MTPTrainer
    from specc.train import TrainConfig

    heads = load_deepseek_v3(heads_dir, target)
    tr = MTPTrainer(target, TrainConfig(drafter="mtp", block_size=heads.config.depth + 1), 0)
    tr.heads, tr.parts = heads, target_parts(target)
    acc = torch.cat([tr.accepted(r) for r in held_recs]).float().mean(0)
    return [round(float(a), 4) for a in acc]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--memorise", type=int, default=8, help="sequences to memorise (default 8)")
    ap.add_argument("--steps", type=int, default=300, help="memorisation steps per drafter (default 300)")
    ap.add_argument("--held-out", type=int, default=24, help="held-out sequences (default 24, as training)")
    ap.add_argument("--train", type=int, default=200, help="regenerated training sequences for the baselines")
    ap.add_argument("--features", help="teacher-forced features for the baselines instead of --train")
    ap.add_argument("--probe-steps", type=int, default=600)
    ap.add_argument("--response-len", type=int, default=192)
    ap.add_argument("--mtp", action="append", default=[], help="more MTP heads to score (repeatable)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from specc.drafters.dflash.model import choose_mask_token
    from specc.features import Features
    from specc.shipped import shipped_drafter
    from specc.train import load_target
    from pathlib import Path
    import tempfile

    torch.manual_seed(0)
    target, tok, eos, _ = load_target(None, Path(tempfile.mkdtemp()), False)
    mask = choose_mask_token(tok, target.config.vocab_size)
    held = regenerated(target, tok, eos, 0, a.held_out, a.response_len)  # the training runs' held-out set
    mem = regenerated(target, tok, eos, a.held_out, a.memorise, a.response_len)
    res = {"memorise": {k: memorise(target, mem, k, a.steps, mask) for k in ("mtp", "dflash")}}
    if a.features:
        store = Features.open(a.features)
        train_recs = [r for n in range(len(store.index["shards"])) for r in store.shard(n)]
        res["baseline_data"] = f"features {a.features} ({store.tokens} tokens)"
    else:
        train_recs = regenerated(target, tok, eos, a.held_out, a.train, a.response_len)
        res["baseline_data"] = f"{len(train_recs)} regenerated ShareGPT sequences"
    res["bigram_depth1"] = round(bigram_accuracy(train_recs, held), 4)
    res["probe_depth1"] = round(probe_accuracy(target, train_recs, held, a.probe_steps), 4)
    res["mtp_per_depth"] = {"shipped": mtp_accuracy(target, shipped_drafter("mtp"), held)}
    for path in a.mtp:
        res["mtp_per_depth"][path] = mtp_accuracy(target, path, held)
    if a.json:
        print(json.dumps(res))
        return 0
    print("| check | result |\n|---|---|")
    for k, m in res["memorise"].items():
        print(f"| memorise {a.memorise} sequences, {k} ({m['steps']} steps, {m['seconds']} s) | tau {m['before']['tau']} "
              f"-> {m['after']['tau']}; per position {m['after']['per_position']} |")
    print(f"| bigram, depth-1 accuracy (held-out {a.held_out}) | {res['bigram_depth1']} |")
    print(f"| linear probe on h_i and Emb(t_i+1), depth-1 accuracy ({a.probe_steps} steps) | {res['probe_depth1']} |")
    for k, v in res["mtp_per_depth"].items():
        print(f"| MTP heads {k}, accuracy by depth | {v} |")
    print(f"\nBaselines fitted on {res['baseline_data']}.")
    return 0


if __name__ == "__main__":
    quiet_libraries()
    sys.exit(main())
