"""Drafters trained by `specc train` for the embedded SmolLM2-135M-Instruct and shipped with specc.

Each directory under specc/assets holds the drafter in its published format, `training.json`
(the exact command, the configuration, the held-out evaluation at the end of training and, for runs
shipped since the curves were kept, every evaluation along the way) and `curve.png` when the run drew one.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
SHIPPED = {"dflash": "smollm2-135m-dflash", "mtp": "smollm2-135m-mtp", "dspark": "smollm2-135m-dspark"}


def shipped_drafter(kind: str) -> Path | None:
    """The shipped drafter directory of this kind for the embedded SmolLM2, or None."""
    path = ASSETS / SHIPPED[kind] if kind in SHIPPED else None
    return path if path is not None and (path / "config.json").is_file() else None


def training_summary(path) -> dict | None:
    """What trained a drafter directory: its shipped training.json, or the progress of a `specc train` run."""
    path = Path(path)
    if (path / "training.json").is_file():
        return json.loads((path / "training.json").read_text())
    progress = path / "train" / "progress.json"
    if progress.is_file():
        prog = json.loads(progress.read_text())
        return {"config": prog["config"], "step": prog["step"], "sequences": prog["sequences"],
                "eval": next((h["eval"] for h in reversed(prog["history"]) if "eval" in h), {})}
    return None


def ship(run_dir, kind: str, dtype: str = "float32", command: str | None = None) -> Path:
    """Copy a `specc train` run's drafter (weights, config, training.json) into specc/assets,
    optionally storing the weights in a smaller dtype (the engine casts them back to its own). A run
    stopped before its last step ships its last checkpoint, marked unfinished (`command` then says
    what was run: rerunning it resumes)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    run_dir, dest = Path(run_dir), ASSETS / SHIPPED[kind]
    if dtype not in ("float32", "bfloat16", "float16"):
        raise SystemExit(f"dtype {dtype!r}: use float32, bfloat16 or float16.")
    summary = training_summary(run_dir)
    if summary is None:
        raise SystemExit(f"{run_dir} is not a specc training run.")
    if not (run_dir / "training.json").is_file():
        summary.update(command=command, finished=False)
    if summary["config"]["drafter"] != kind:
        raise SystemExit(f"{run_dir} holds a {summary['config']['drafter']} drafter, not {kind}.")
    dest.mkdir(parents=True, exist_ok=True)
    files: dict[str, dict] = {}
    for f in sorted(run_dir.glob("*.safetensors")):
        # A drafter that came back from the GPU machine in parts (model-00001-of-00002...) ships as one file.
        files.setdefault(re.sub(r"-\d{5}-of-\d{5}(?=\.safetensors$)", "", f.name), {}).update(load_file(str(f)))
    for name, weights in files.items():
        # MTP checkpoints may carry copies of the target's embedding and head: the engine uses the target's own.
        tensors = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v for k, v in weights.items()
                   if not k.endswith(("shared_head.head.weight", "embed_tokens.weight"))}
        save_file(tensors, str(dest / name))
    for f in dest.glob("*.safetensors"):
        if f.name not in files:  # the weights shipped before under another name: a loader would read them too
            f.unlink()
    shutil.copy(run_dir / "config.json", dest / "config.json")
    progress, curve = run_dir / "train" / "progress.json", run_dir / "train" / "curve.png"
    if progress.is_file():  # the measured curve: what more steps would buy
        summary["curve"] = [{"step": h["step"], "tau": h["eval"]["tau"]}
                            for h in json.loads(progress.read_text())["history"] if "eval" in h]
    if curve.is_file():
        shutil.copy(curve, dest / "curve.png")
    summary["shipped_dtype"] = dtype
    (dest / "training.json").write_text(json.dumps(summary, indent=1))
    return dest


if __name__ == "__main__":
    import sys

    if len(sys.argv) not in (3, 4) or sys.argv[2] not in SHIPPED:
        raise SystemExit(f"usage: python -m specc.shipped RUN_DIR {'|'.join(SHIPPED)} [float32|bfloat16]")
    print(ship(*sys.argv[1:]))
