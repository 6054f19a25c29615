"""`specc train`: self-distillation of a drafter (DFlash, DSpark or MTP) from its own target.

    ShareGPT prompts (never MT-Bench or HumanEval) -> sequences: the target's own greedy responses
    ("regenerate") or the dataset's responses ("data") -> the target's view of every sequence, once
    (taps / hidden states and argmax labels, cached) -> for each training step one sequence: the
    drafter's loss (bf16 autocast where the CPU has bf16) -> AdamW, cosine schedule -> checkpoints
    (resumable) and a held-out tau (fp32, exact).

Each drafter's trainer lives with its kind (specc/drafters/<kind>/train.py) and is found through the
kinds' registry (the kind's TRAINER); this module holds what every run shares: sequences, target
features, the loop, checkpoints, evaluation and plots.

Labels are always the target's own argmax at each position given the true prefix, so with
regenerated sequences (the default) a label is exactly what greedy verification will accept,
and the held-out tau is the exact greedy acceptance length of a chain over those sequences.

On a GPU (`--device cuda`): the target and the drafter live there, steps run under bf16 autocast,
and `--feature-stream` reads a pre-tokenized corpus whose features the target computes on the fly
(specc.features.FeatureStream), packing several sequences into one step's record (`--pack-tokens`);
`--time-budget` bounds the steps by the clock, the learning rate annealing by elapsed time, so a run
stopped by it ends annealed (examples/gpu_train.sh).

Output directory: the drafter in its published format at the top (DFlash and DSpark: config.json +
model.safetensors; MTP: the DeepSeek-V3 layout) with training.json (command, configuration, final
held-out figures), and `train/` with the sequences (data.safetensors), the target's features
(features.safetensors), the optimizer state (state.safetensors), progress.json (config, step, loss
and tau history) and curve.png. Running the same command again resumes from the last checkpoint.
"""
from __future__ import annotations

import functools
import json
import math
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from tqdm import tqdm

from .drafters import KINDS
from .errors import SpeccError
from .features import atomic_write as _atomic
from .features import normalised as _norm

# The kinds `specc train` trains (those with a TRAINER), in the registry's order.
DRAFTERS = tuple(name for name, kind in KINDS.items() if kind.TRAINER is not None)


def trainer_of(drafter: str):
    """The class that trains the drafter kind `drafter` (its TRAINER: specc/drafters/__init__.py), or None."""
    return KINDS[drafter].TRAINER if drafter in KINDS else None


@dataclass
class TrainConfig:
    drafter: str = "dflash"
    layers: int = 1  # DFlash / DSpark decoder layers; MTP modules
    # DFlash block (B - 1 drafts; default 16); DSpark block (B drafts; default 7); MTP: depth + 1 (default 5)
    block_size: int | None = None
    taps: int = 3  # DFlash / DSpark target layers
    labels: str = "regenerate"  # "regenerate" | "data"
    prompts: int = 1000  # training sequences
    eval_prompts: int = 24  # held-out sequences (ShareGPT too, disjoint from training)
    max_prompt_len: int = 256
    response_len: int = 192
    gen_batch: int = 32  # 170 tokens/s here (16: 119)
    steps: int = 2000
    anchors: int = 64  # DFlash / DSpark blocks per sequence per step
    markov_rank: int = 256  # DSpark: rank of the Markov head (V x r twice: 2 x 25 MB in bf16 on a 49k vocabulary)
    rows: int = 0  # MTP: rows scored per depth per step, drawn from the counted ones (0: all of them)
    lr: float = 6e-4
    warmup: float = 0.04
    clip: float = 1.0
    seed: int = 0
    eval_every: int = 200
    checkpoint_every: int = 100
    soft: float = 0.0  # weight of the cross-entropy to the target's top-k distribution (features only)
    regress: float = 0.0  # weight of a smooth-L1 regression of the drafter's head input onto the target's (EAGLE)
    init: str = "random"  # drafter decoder layers: "random", or "target" (copies of its last layers)
    # Teacher-forced features (specc.features): a folder, shared between runs; extracted up to
    # feature_tokens positions when it holds fewer. Steps then draw from it and from the regenerated
    # sequences (--prompts, 0 for none) in proportion to their numbers of sequences.
    features: str | None = None
    feature_tokens: int = 0
    feature_sources: str = "sharegpt,code"
    feature_max_len: int = 1024
    feature_shard_tokens: int = 1 << 17
    # A pre-tokenized corpus (`specc features --pretokenize`) whose features the target computes while
    # training reads them (FeatureStream); instead of --features. One record per step: a sequence, or
    # several packed back to back up to pack_tokens positions (dflash, dspark).
    feature_stream: str | None = None
    pack_tokens: int = 0
    feature_precision: str = "float32"  # the stream's target forward: float32 | tf32 | bfloat16
    feature_batch_tokens: int = 1 << 15  # the stream's padded positions per target forward
    feature_window_tokens: int = 1 << 19  # the stream's positions computed at once (held in memory)
    time_budget: float = 0.0  # seconds of training steps (0: none); the schedule anneals by elapsed time too

    def __post_init__(self):
        trainer = trainer_of(self.drafter)
        if self.block_size is None and trainer is not None:  # an unknown drafter: check() refuses it
            self.block_size = trainer.BLOCK_SIZE

    def check(self) -> None:
        if self.drafter not in DRAFTERS:
            raise SpeccError(f"`specc train` trains {' and '.join(DRAFTERS)} drafters, not {self.drafter!r}.")
        trainer = trainer_of(self.drafter)
        if self.labels not in ("regenerate", "data"):
            raise SpeccError(f"--labels {self.labels!r} is unknown; use regenerate or data.")
        if self.rows < 0:
            raise SpeccError("--rows must not be negative (0 scores every counted row).")
        for name in ("layers", "prompts", "eval_prompts", "steps", "anchors", "response_len", "gen_batch",
                     "eval_every", "checkpoint_every", "markov_rank"):
            if getattr(self, name) < (0 if name == "prompts" and (self.features or self.feature_stream) else 1):
                raise SpeccError(f"--{name.replace('_', '-')} must be at least 1.")
        if self.init not in ("random", "target"):
            raise SpeccError(f"--init {self.init!r} is unknown; use random or target.")
        if self.regress < 0:
            raise SpeccError("--regress must not be negative.")
        if not 0.0 <= self.soft <= 1.0:
            raise SpeccError("--soft must be between 0 and 1 (the weight of the soft targets).")
        if self.features and self.eval_prompts > HELD_OUT_RESERVE:
            raise SpeccError(f"--eval-prompts may be at most {HELD_OUT_RESERVE} with --features (the conversations "
                             f"kept out of every feature extraction).")
        if self.block_size < trainer.MIN_BLOCK:
            raise SpeccError(f"--block-size must be at least {trainer.MIN_BLOCK} (one draft token).")
        if self.features and self.feature_stream:
            raise SpeccError("--features and --feature-stream are two sources of the same features; give one.")
        if self.feature_stream and self.eval_prompts > HELD_OUT_RESERVE:
            raise SpeccError(f"--eval-prompts may be at most {HELD_OUT_RESERVE} with --feature-stream (the "
                             f"conversations kept out of every feature extraction).")
        if self.pack_tokens and (not self.feature_stream or not trainer.PACKS):
            packers = " and ".join(n for n in DRAFTERS if trainer_of(n).PACKS)
            raise SpeccError(f"--pack-tokens packs the sequences of a --feature-stream for {packers} drafters.")
        if self.pack_tokens < 0 or self.time_budget < 0 or min(self.feature_batch_tokens,
                                                                self.feature_window_tokens) < 1:
            raise SpeccError("--pack-tokens and --time-budget must not be negative, --feature-batch-tokens and "
                             "--feature-window-tokens at least 1.")
        from .features import PRECISIONS

        if self.feature_precision not in PRECISIONS:
            raise SpeccError(f"--feature-precision {self.feature_precision!r} is unknown; use "
                             f"{', '.join(PRECISIONS)}.")


HELD_OUT_RESERVE = 64  # the first ShareGPT prompts: held out of every feature extraction
DATA_FIELDS = ("labels", "prompts", "eval_prompts", "max_prompt_len", "response_len", "seed")  # what the sequences depend on
SMOKE = dict(layers=1, block_size=4, taps=2, prompts=8, eval_prompts=2, max_prompt_len=48, response_len=24,
             gen_batch=4, steps=40, anchors=16, lr=3e-3, eval_every=20, checkpoint_every=20)


# ------------------------------------------------------------------------------------ data


def sharegpt_pairs(n: int, exclude: set[str]):
    """(first human turn, first model reply) of ShareGPT conversations, skipping empty ones and any
    prompt that appears in an evaluation set."""
    from .data import sharegpt_conversations

    out = []
    for conv in sharegpt_conversations():
        turns = conv.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        prompt, reply = (turns[0].get("value") or "").strip(), (turns[1].get("value") or "").strip()
        if not prompt or not reply or _norm(prompt) in exclude:
            continue
        out.append((prompt, reply))
        if len(out) == n:
            break
    return out


def eval_set_prompts() -> set[str]:
    from .data import humaneval_prompts, mt_bench_prompts

    return {_norm(p) for p in mt_bench_prompts() + humaneval_prompts()}


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@torch.no_grad()
def build_sequences(model, tokenizer, pairs, cfg: TrainConfig, eos: set[int], progress: bool, desc: str):
    """[(ids [N], prompt_len)]: chat-formatted prompt + response (regenerated greedily by the target
    in left-padded batches, or the dataset's reply), cut at the first EOS (kept)."""
    items = []
    for prompt, reply in pairs:
        ids = _chat_ids(tokenizer, prompt)
        if len(ids) <= cfg.max_prompt_len:
            items.append((ids, tokenizer(reply, add_special_tokens=False)["input_ids"][: cfg.response_len]))
    seqs = []
    if cfg.labels == "data":
        return [(torch.tensor(p + r), len(p)) for p, r in items if r]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos or {0})
    bar = tqdm(range(0, len(items), cfg.gen_batch), desc=desc, unit="batch", disable=not progress)
    for b in bar:
        batch = [p for p, _ in items[b: b + cfg.gen_batch]]
        width = max(len(p) for p in batch)
        dev = next(model.parameters()).device
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=dev)
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=dev)
        out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=cfg.response_len, do_sample=False,
                             pad_token_id=pad, eos_token_id=sorted(eos) or None)
        for p, row in zip(batch, out[:, width:].tolist()):
            resp = []
            for t in row:
                resp.append(t)
                if t in eos:
                    break
            if resp:
                seqs.append((torch.tensor(p + resp), len(p)))
    return seqs


def save_sequences(seqs, path: Path) -> None:
    from safetensors.torch import save_file

    ids = torch.cat([s for s, _ in seqs]) if seqs else torch.zeros(0, dtype=torch.long)
    lens = torch.tensor([len(s) for s, _ in seqs], dtype=torch.long)
    plen = torch.tensor([p for _, p in seqs], dtype=torch.long)
    _atomic(path, lambda tmp: save_file({"ids": ids, "lengths": lens, "prompt_lengths": plen}, str(tmp)))


def load_sequences(path: Path):
    from safetensors.torch import load_file

    t = load_file(str(path))
    out, at = [], 0
    for n, p in zip(t["lengths"].tolist(), t["prompt_lengths"].tolist()):
        out.append((t["ids"][at: at + n], p))
        at += n
    return out


# --------------------------------------------------------------------------------- features


@torch.no_grad()
def target_view(model, ids, layer_ids):
    """One target forward over a sequence: taps [N, L*H] (decoder-layer outputs), the post-norm
    hidden [N, H] (lm_head's input) and labels [N] (labels[j] = the target's argmax for token j+1)."""
    out = model(ids.view(1, -1).to(next(model.parameters()).device), output_hidden_states=True)
    hs = out.hidden_states
    taps = torch.cat([hs[i + 1][0] for i in layer_ids], dim=-1) if layer_ids else None
    return taps, hs[-1][0], out.logits[0].argmax(-1)


def usable_cpus() -> int:
    """The CPUs this process may run on (taskset / cgroup affinity), not all the machine's: two runs
    pinned to one core each must not oversubscribe."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def fast_dtype(device="cpu"):
    """bfloat16 where the device multiplies it natively (a CUDA GPU with bf16; a CPU with AVX512-BF16 /
    AMX: about 4x fp32 here), else None."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    try:
        return torch.bfloat16 if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported() else None
    except AttributeError:
        return None


def response_loss(n: int, prompt_len: int, device=None) -> torch.Tensor:
    """The loss mask of a prompt + response sequence of n tokens: position j is scored when its label
    (the target's prediction of token j+1) continues the response, the last position's included."""
    return torch.arange(n, device=device) >= prompt_len - 1


@torch.no_grad()
def sequence_features(model, seqs, layer_ids, want_hidden: bool, regenerated: bool, dtype=None,
                      progress: bool = False, desc: str = "features"):
    """The target's view of every (ids, prompt_len) sequence, computed once, as training records
    (specc.features' fields): ids, labels, loss (the response's positions), taps, hidden. With `dtype`
    (bf16) a copy of the target in that dtype computes them (about 2x faster here, and half the
    memory): features are then slightly perturbed, which is harmless; labels of a regenerated response
    are its own next tokens (the target's greedy choices, exact whatever the dtype) and elsewhere the
    forward's argmax."""
    import copy

    if dtype is not None and dtype != model.dtype:
        model = copy.deepcopy(model).to(dtype)
    out = []
    keep = dtype or torch.float32
    dev = next(model.parameters()).device  # the records live where the target does
    for ids, plen in tqdm(seqs, desc=desc, unit="seq", disable=not progress):
        ids = ids.to(dev)
        taps, hidden, labels = target_view(model, ids, layer_ids)
        if regenerated:
            labels = labels.clone()
            labels[plen - 1: len(ids) - 1] = ids[plen:]
        rec = {"ids": ids, "labels": labels, "loss": response_loss(len(ids), plen, dev)}
        if taps is not None:
            rec["taps"] = taps.to(keep)
        if want_hidden:
            rec["hidden"] = hidden.to(keep)
        out.append(rec)
    return out


def save_features(recs, path: Path, meta: dict) -> None:
    from safetensors.torch import save_file

    t = {k: torch.cat([r[k] for r in recs]).cpu() for k in recs[0]}
    t["lengths"] = torch.tensor([len(r["ids"]) for r in recs])
    _atomic(path, lambda tmp: save_file(t, str(tmp), metadata={"meta": json.dumps(meta, sort_keys=True)}))


def load_features(path: Path, meta: dict, device="cpu"):
    """The cached records (on `device`), or None when absent or made for other settings."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if not path.is_file():
        return None
    with safe_open(str(path), "pt") as f:
        if (f.metadata() or {}).get("meta") != json.dumps(meta, sort_keys=True) or "loss" not in f.keys():
            return None
    t = load_file(str(path), device=str(device))
    lens = t.pop("lengths").tolist()
    parts = {k: v.split(lens) for k, v in t.items()}
    return [{k: parts[k][i] for k in parts} for i in range(len(lens))]


def tau_of(accepted: torch.Tensor, k: int | None = None) -> float:
    """Greedy chain acceptance length (bonus token included) from per-position matches [n, D]."""
    if accepted.shape[0] == 0:
        return float("nan")
    a = accepted[:, :k] if k else accepted
    return 1.0 + float(a.long().cumprod(dim=1).sum(dim=1).float().mean())


# ------------------------------------------------------------------------------- the loop


def lr_at(step: int, cfg: TrainConfig, elapsed: float | None = None) -> float:
    """Linear warm-up over cfg.warmup of the run, then a cosine to zero at its end. The run's progress
    is step / steps, or with cfg.time_budget the larger of that and elapsed / time_budget (seconds of
    steps so far), so a run the clock stops is annealed when it stops."""
    if cfg.time_budget and elapsed is not None:
        frac = min(1.0, max((step + 1) / cfg.steps, elapsed / cfg.time_budget))
        if frac < cfg.warmup:
            return cfg.lr * frac / cfg.warmup
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * (frac - cfg.warmup) / max(1e-9, 1 - cfg.warmup)))
    warm = max(1, int(cfg.warmup * cfg.steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


def _save_state(opt, trainer, path: Path, step: int) -> None:
    from safetensors.torch import save_file

    tensors = {"step": torch.tensor(step)}
    for i, (name, p) in enumerate(trainer.named_parameters()):
        st = opt.state.get(p)
        if st:
            tensors[f"{name}.exp_avg"] = st["exp_avg"].contiguous().cpu()
            tensors[f"{name}.exp_avg_sq"] = st["exp_avg_sq"].contiguous().cpu()
            tensors[f"{name}.step"] = torch.as_tensor(st["step"]).reshape(()).cpu()
    _atomic(path, lambda tmp: save_file(tensors, str(tmp)))


def _load_state(opt, trainer, path: Path) -> int:
    from safetensors.torch import load_file

    t = load_file(str(path))
    for name, p in trainer.named_parameters():
        if f"{name}.exp_avg" in t:
            opt.state[p] = {"exp_avg": t[f"{name}.exp_avg"].to(p.device),
                            "exp_avg_sq": t[f"{name}.exp_avg_sq"].to(p.device),
                            "step": t[f"{name}.step"].clone().float()}
    return int(t["step"])


def evaluate(trainer, recs) -> dict:
    """Held-out greedy acceptance. `tau`: a chain of every draft of the trained block (DFlash) or depth
    (MTP); `tau_chain{k}`: its first k drafts; `tau_block{b}`: blocks run at size b, for each of the
    trainer's shorter_blocks() (DFlash, DSpark)."""
    acc = torch.cat([trainer.accepted(r) for r in recs])
    D = acc.shape[1]
    out = {"tau": round(tau_of(acc), 4), "anchors": int(acc.shape[0]),
           "per_position": [round(float(x), 4) for x in acc.float().mean(0)]}
    for k in (1, 2, 3, 4, 8, 16):
        if k < D:
            out[f"tau_chain{k}"] = round(tau_of(acc, k), 4)
    for b in trainer.shorter_blocks():
        short = torch.cat([trainer.accepted(r, b) for r in recs])
        out[f"tau_block{b}"] = round(tau_of(short), 4)
    return out


def plot_curve(history: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.5))
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    losses = [(h["step"], h["loss"]) for h in history if "loss" in h]
    taus = [(h["step"], h["eval"]["tau"]) for h in history if "eval" in h]
    if losses:
        ax1.plot(*zip(*losses), color="#4477aa")
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss")
    if taus:
        ax2.plot(*zip(*taus), marker="o", color="#228833")
    ax2.set_xlabel("step")
    ax2.set_ylabel("held-out tau (greedy, full block)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def smoke_target(out: Path, tokenizer):
    """A tiny random Llama over the real tokenizer's vocabulary, saved for compiling an engine."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model


def _check_run_dir(out: Path, cfg: TrainConfig) -> dict | None:
    """The saved progress of a run to resume in `out` (None for a new run). Refuses anything that is
    not a specc training directory, and a run made with another configuration."""
    work = out / "train"
    progress_file, data_meta = work / "progress.json", work / "data.json"
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (progress_file.is_file()
                                                                           or data_meta.is_file()))):
        raise SpeccError(f"output {str(out)!r} exists and is not a specc training directory; refusing to overwrite it.")
    if not progress_file.is_file():
        return None
    resumed = json.loads(progress_file.read_text())
    # A run from before a setting existed ran with its default.
    defaults = {f.name: f.default for f in fields(TrainConfig)}
    saved = {**{k: defaults[k] for k in asdict(cfg) if k not in resumed["config"]}, **resumed["config"]}
    if saved != asdict(cfg):
        changed = next(k for k in asdict(cfg) if saved.get(k) != asdict(cfg)[k])
        raise SpeccError(f"{str(out)!r} holds a run with another configuration ({changed} was "
                         f"{saved.get(changed)!r}); use a new -o directory to start over.")
    return resumed


def load_target(model, work: Path, smoke: bool, device: str = "cpu"):
    """(target, tokenizer, EOS ids, name): the target frozen for inference on `device`; with `smoke` a tiny
    random Llama over MODEL's tokenizer, saved in work/smoke-target. Creates `work`."""
    from .models import load_model

    loaded = load_model(model, torch.float32)
    tokenizer = loaded.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise SpeccError("training needs the target's tokenizer with a chat template.")
    work.mkdir(parents=True, exist_ok=True)
    target = smoke_target(work / "smoke-target", tokenizer) if smoke else loaded.model
    target.requires_grad_(False).eval().to(device)
    eos = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    # MODEL's generation config can name more EOS ids (chat end-of-turn tokens) than its tokenizer.
    gen_cfg = getattr(loaded.model, "generation_config", None)
    if gen_cfg is not None and gen_cfg.eos_token_id is not None:
        e = gen_cfg.eos_token_id
        eos |= set(e) if isinstance(e, (list, tuple)) else {int(e)}
    return target, tokenizer, eos, f"smoke:{loaded.name}" if smoke else loaded.name


def run_sequences(target, tokenizer, eos: set[int], cfg: TrainConfig, out: Path, progress: bool):
    """(training, held-out) sequences, cached in the run directory: regenerating is the slow part."""
    work = out / "train"
    data_file, eval_file, data_meta = work / "data.safetensors", work / "eval.safetensors", work / "data.json"
    meta = {k: asdict(cfg)[k] for k in DATA_FIELDS}
    if data_file.is_file() and eval_file.is_file() and data_meta.is_file():
        old = json.loads(data_meta.read_text())
        if old != meta:
            changed = next(k for k in meta if old.get(k) != meta[k])
            raise SpeccError(f"{str(out)!r} holds sequences made with another {changed} ({old.get(changed)!r}); "
                             f"use a new -o directory.")
        return load_sequences(data_file), load_sequences(eval_file)
    pairs = sharegpt_pairs(cfg.prompts + cfg.eval_prompts, eval_set_prompts())
    held = build_sequences(target, tokenizer, pairs[: cfg.eval_prompts], cfg, eos, progress, "held-out sequences")
    seqs = build_sequences(target, tokenizer, pairs[cfg.eval_prompts:], cfg, eos, progress, "training sequences")
    if (cfg.prompts and not seqs) or not held:
        raise SpeccError("no usable training sequences (prompts too long for --max-prompt-len?).")
    save_sequences(held, eval_file)
    save_sequences(seqs, data_file)
    data_meta.write_text(json.dumps(meta))
    return seqs, held


def _run_features(target, seqs, held, cfg: TrainConfig, work: Path, fast, progress: bool):
    """(training, held-out) records: the target's view of every sequence, once, so training steps run the
    drafter alone. Training features are computed and kept in `fast` (bf16 where the CPU has it) and cached;
    held-out ones in fp32, so the held-out tau is exact."""
    layer_ids = _layer_ids(target, cfg)
    want_hidden = _wants_hidden(cfg)
    fmeta = {**{k: asdict(cfg)[k] for k in DATA_FIELDS}, "drafter": cfg.drafter, "layer_ids": layer_ids,
             "dtype": str(fast), "hidden": want_hidden}
    recs = load_features(work / "features.safetensors", fmeta, next(target.parameters()).device) if seqs else []
    if recs is None:
        recs = sequence_features(target, seqs, layer_ids, want_hidden, cfg.labels == "regenerate", fast, progress,
                                 "target features")
        save_features(recs, work / "features.safetensors", fmeta)
    return recs, sequence_features(target, held, layer_ids, want_hidden, False)


def _layer_ids(target, cfg: TrainConfig) -> list[int]:
    from .drafters.dflash.model import default_layer_ids

    return default_layer_ids(target.config.num_hidden_layers, cfg.taps) if trainer_of(cfg.drafter).READS_TAPS else []


def _wants_hidden(cfg: TrainConfig) -> bool:
    """Whether records carry the target's post-norm hidden: the drafter reads it, or --regress does."""
    return trainer_of(cfg.drafter).READS_HIDDEN or cfg.regress > 0


def feature_spec(target, name: str, taps: int, max_len: int, sources: str, shard_tokens: int = 1 << 17,
                 code_share: float = 0.25):
    """The FeatureSpec of a run: taps and hidden both, so one extraction serves MTP, DFlash and DSpark."""
    from .drafters.dflash.model import default_layer_ids
    from .features import FeatureSpec

    return FeatureSpec(taps=tuple(default_layer_ids(target.config.num_hidden_layers, taps)), hidden=True,
                       max_len=max_len, sources=tuple(sources.split(",")), model=name, shard_tokens=shard_tokens,
                       code_share=code_share)


def feature_exclusions() -> set[str]:
    """Prompts no feature extraction reads: the evaluation sets and the first HELD_OUT_RESERVE ShareGPT
    prompts (every run's held-out set comes from those)."""
    evals = eval_set_prompts()
    return evals | {_norm(p) for p, _ in sharegpt_pairs(HELD_OUT_RESERVE, evals)}


def extract_features(model, folder, tokens: int, taps: int = 3, max_len: int = 1024, sources: str = "sharegpt,code",
                     progress: bool = True, log=print, device: str = "cpu", batch_tokens: int = 0,
                     code_share: float = 0.25, pretokenize: bool = False) -> dict:
    """`specc features`: extract (or extend) a features folder for MODEL, the same as `specc train
    --features FOLDER --feature-tokens N` would, without training; on `device`, `batch_tokens` positions
    per padded forward (0: one sequence per forward). `pretokenize`: write the corpus' token ids and loss
    masks alone (TokenCorpus, for `specc train --feature-stream`); returns its meta then."""
    from .backends import check_device
    from .features import FeatureSpec, TokenCorpus, extract

    if tokens < 1:
        raise SpeccError("--tokens must be at least 1.")
    if batch_tokens < 0:
        raise SpeccError("--batch-tokens must not be negative.")
    device = check_device(device)
    # before the target loads (and mkdir)
    FeatureSpec(max_len=max_len, sources=tuple(sources.split(",")), code_share=code_share).check()
    target, tokenizer, _, name = load_target(model, Path(folder), False, "cpu" if pretokenize else device)
    spec = feature_spec(target, name, taps, max_len, sources, code_share=code_share)
    torch.set_num_threads(usable_cpus())
    if pretokenize:
        return TokenCorpus.write(folder, tokenizer, spec, tokens, feature_exclusions(), progress)
    return extract(target, tokenizer, spec, folder, tokens, feature_exclusions(), progress, log, batch_tokens)


def _feature_store(target, tokenizer, cfg: TrainConfig, name: str, progress: bool, log, shards: int | None = None):
    """The teacher-forced features of cfg.features (extracted up to cfg.feature_tokens first), or None;
    `shards`: a resumed run's count (it reads those, whatever was extracted since). With cfg.feature_stream,
    the FeatureStream of that pre-tokenized corpus."""
    if cfg.feature_stream:
        return _feature_stream(target, tokenizer, cfg)
    if not cfg.features:
        return None
    from .features import Features, extract

    spec = feature_spec(target, name, cfg.taps, cfg.feature_max_len, cfg.feature_sources, cfg.feature_shard_tokens)
    if cfg.feature_tokens and shards is None:
        extract(target, tokenizer, spec, cfg.features, cfg.feature_tokens, feature_exclusions(), progress, log)
    store = Features.open(cfg.features, shards)
    if store.spec != spec:
        raise SpeccError(f"the features in {cfg.features!r} were extracted with other settings than this run's "
                         f"(taps, sources, length or target); use another --features folder.")
    return store


def _feature_stream(target, tokenizer, cfg: TrainConfig):
    """The FeatureStream of cfg.feature_stream: the corpus' sequences, the features this drafter reads
    (taps for DFlash / DSpark, the last hidden state for MTP or --regress, the corpus' top-k)."""
    import dataclasses

    from .features import FeatureStream, TokenCorpus, tokenizer_digest

    corpus = TokenCorpus.open(cfg.feature_stream)
    if corpus.meta["tokenizer"] != tokenizer_digest(tokenizer):
        raise SpeccError(f"the corpus in {cfg.feature_stream!r} was tokenized with another tokenizer than this "
                         f"target's; pre-tokenize it with this target.")
    spec = dataclasses.replace(corpus.spec, taps=tuple(_layer_ids(target, cfg)), hidden=_wants_hidden(cfg))
    return FeatureStream(corpus, target, spec, cfg.seed, cfg.pack_tokens, cfg.feature_batch_tokens,
                         cfg.feature_window_tokens, cfg.feature_precision)


class Draws:
    """The record a training step uses: from the regenerated sequences or the feature store, in
    proportion to their numbers of sequences; a function of the step, so a resumed run draws the same.
    Records are handed out on `device` (a features folder's shards are read to the CPU)."""

    def __init__(self, recs: list, store, seed: int, device="cpu"):
        self.recs, self.store, self.seed = recs, store, seed
        self.n_store = store.sequences if store is not None else 0
        self.device = torch.device(device)

    def __len__(self) -> int:
        return len(self.recs) + self.n_store

    def _on_device(self, rec: dict) -> dict:
        if rec["ids"].device == self.device:
            return rec
        return {k: v.to(self.device, non_blocking=True) for k, v in rec.items()}

    def first(self, n: int) -> list:
        return [self._on_device(r) for r in (self.recs + (self.store.first(n) if self.store is not None else []))[:n]]

    def __call__(self, step: int, gen) -> dict:
        i = int(torch.randint(len(self), (1,), generator=gen))
        return self.recs[i] if i < len(self.recs) else self._on_device(self.store.record(step, self.seed))


def _checkpoint(out: Path, trainer, opt, progress_doc: dict, step: int) -> None:
    """Everything a rerun resumes from: the drafter (in its published format), the optimizer state and
    progress.json (`progress_doc` with this step), and the curve."""
    work = out / "train"
    trainer.save(out)
    _save_state(opt, trainer, work / "state.safetensors", step)
    _atomic(work / "progress.json", lambda tmp: tmp.write_text(json.dumps({**progress_doc, "step": step}, indent=1)))
    plot_curve(progress_doc["history"], work / "curve.png")


def _train_steps(trainer, opt, cfg: TrainConfig, draw, held, history: list, start: int, checkpoint, fast,
                 progress: bool, device="cpu") -> dict:
    """Steps start..cfg.steps, appending to `history` (an evaluation every eval_every steps) and calling
    checkpoint(step) every checkpoint_every steps and at the end. With cfg.time_budget the steps also end
    once that many seconds have passed (evaluated and checkpointed there). Returns the seconds they
    took, the last step done, whether the clock ended them, and the positions of the records read."""
    t0, running, positions, stopped = time.perf_counter(), None, 0, False
    if start == 0:
        history.append({"step": 0, "eval": evaluate(trainer, held)})
        checkpoint(0)
    bar = tqdm(range(start, cfg.steps), desc=f"train {cfg.drafter}", unit="step", disable=not progress,
               initial=start, total=cfg.steps)
    done = start
    for step in bar:
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)  # a resumed run draws the same data
        rec = draw(step, gen)
        positions += len(rec["ids"])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg, time.perf_counter() - t0)
        with torch.autocast(torch.device(device).type, dtype=fast, enabled=fast is not None):  # fp32 master weights
            loss = trainer.loss(rec, gen)
        done = step + 1
        entry = {"step": done}
        if loss is not None:  # None: a record with nothing to score
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(trainer.parameters()), cfg.clip)
            opt.step()
            running = float(loss) if running is None else 0.95 * running + 0.05 * float(loss)
            entry["loss"] = round(float(loss), 4)
        stopped = bool(cfg.time_budget) and time.perf_counter() - t0 >= cfg.time_budget and done < cfg.steps
        last = done == cfg.steps or stopped
        if done % cfg.eval_every == 0 or last:
            entry["eval"] = evaluate(trainer, held)
            bar.set_postfix(loss=f"{running or float('nan'):.3f}", tau=entry["eval"]["tau"])
        else:
            bar.set_postfix(loss=f"{running or float('nan'):.3f}")
        history.append(entry)
        if done % cfg.checkpoint_every == 0 or last:
            checkpoint(done)
        if stopped:
            break
    bar.close()
    return {"train_s": time.perf_counter() - t0, "steps": done, "stopped_by_time": stopped, "positions": positions}


def _write_training_json(out: Path, res: dict, cfg: TrainConfig, command: str | None, compute_dtype: str) -> None:
    # Beside the weights: what produced them, so a copied (shipped) drafter still says how it was trained.
    summary = {"command": command, "config": asdict(cfg), "step": res["steps"], "sequences": res["sequences"],
               "held_out": res["held_out"], "compute_dtype": compute_dtype, "eval": res["eval"],
               "finished": time.strftime("%Y-%m-%d"), "last_session_train_s": res["train_s"]}
    if res.get("device", "cpu") != "cpu" or cfg.feature_stream or cfg.time_budget:  # a GPU / streamed run's figures
        summary.update({k: res.get(k) for k in ("device", "stopped_by_time", "positions", "feature_positions")})
    _atomic(out / "training.json", lambda tmp: tmp.write_text(json.dumps(summary, indent=1)))


def train(model=None, output_dir=None, config: TrainConfig | None = None, smoke: bool = False,
          progress: bool = True, log=print, command: str | None = None, device: str = "cpu") -> dict:
    """Train a drafter for MODEL (HF dir, .gguf, or None: the embedded SmolLM2) into output_dir.
    `smoke`: the target is a tiny random Llama over MODEL's tokenizer (saved in train/smoke-target),
    and the default config is SMOKE. `device`: where the target and the drafter run (cpu, cuda[:N])."""
    from .backends import check_device
    from .drafters.dflash.model import choose_mask_token

    cfg = config or (TrainConfig(**SMOKE) if smoke else TrainConfig())
    cfg.check()
    if output_dir is None:
        raise SpeccError("an output directory is required (-o DIR).")
    out = Path(output_dir)
    work = out / "train"
    device = check_device(device)
    if cfg.feature_stream:  # refused before the run directory or any sequence is made
        from .features import TokenCorpus

        TokenCorpus.check(cfg.feature_stream)
    resumed = _check_run_dir(out, cfg)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(usable_cpus())
    target, tokenizer, eos, name = load_target(model, work, smoke, device)
    seqs, held = run_sequences(target, tokenizer, eos, cfg, out, progress)
    fast = fast_dtype(device)
    recs, held_recs = _run_features(target, seqs, held, cfg, work, fast, progress)
    store = _feature_store(target, tokenizer, cfg, name, progress, log,
                           resumed.get("feature_shards") if resumed is not None else None)
    draw = Draws(recs, store, cfg.seed, device)

    # Drafter and optimizer, from the last checkpoint when resuming.
    mask = choose_mask_token(tokenizer, target.config.vocab_size)
    trainer = trainer_of(cfg.drafter)(target, cfg, mask, draw.first(8))
    opt = torch.optim.AdamW(trainer.parameters(), lr=cfg.lr, weight_decay=0.0)
    history, step = [], 0
    if resumed is not None and (work / "state.safetensors").is_file():
        trainer.load(out)
        step = _load_state(opt, trainer, work / "state.safetensors")
        history = resumed["history"]
        log(f"resuming at step {step} of {cfg.steps}")
    compute_dtype = str(fast or torch.float32)
    # progress.json's keys in their historical order; _checkpoint fills in "step".
    progress_doc = {"config": asdict(cfg), "step": step, "sequences": len(draw), "held_out": len(held),
                    "mask_token_id": mask, "compute_dtype": compute_dtype, "history": history,
                    "feature_shards": len(store.index["shards"]) if hasattr(store, "index") else None}

    checkpoint = functools.partial(_checkpoint, out, trainer, opt, progress_doc)
    ran = _train_steps(trainer, opt, cfg, draw, held_recs, history, step, checkpoint, fast, progress, device)
    final = next((h["eval"] for h in reversed(history) if "eval" in h), None)
    res = {"output": str(out), "drafter": cfg.drafter, "steps": ran["steps"], "sequences": len(draw),
           "held_out": len(held), "train_s": round(ran["train_s"], 1), "eval": final,
           "smoke_target": str(work / "smoke-target") if smoke else None, "device": device,
           "stopped_by_time": ran["stopped_by_time"], "positions": ran["positions"],
           "feature_positions": getattr(store, "positions", None)}
    _write_training_json(out, res, cfg, command, compute_dtype)
    return res
