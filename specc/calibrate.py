"""Measured trees: `--tree sequoia:BUDGET` and `--tree auto`.

    calibration engine (eager; a comb tree: the rank-0 chain with WIDTH ranked siblings at every depth)
    -> generate on calibration prompts (ShareGPT, past what `specc train` reads; never MT-Bench/HumanEval)
    -> the sibling ranks along each accepted path -> acceptance[d][r] (tree.measure_acceptance)
    -> sequoia: the best tree for the budget by dynamic programming (tree.sequoia)
    -> auto: a real engine per candidate budget on the chosen backend, timed on the same prompts;
       the pick maximises expected tokens / measured step time (tree.pick_tree)

Acceptance is measured with greedy verification: the ranks at one depth then exclude each other,
which is what the Sequoia model assumes. A comb measures each depth's ranks below an accepted
rank-0 parent; a tree uses the same numbers under its other branches (an approximation that the
report's measured columns check).
"""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from .errors import SpeccError
from .tree import Tree, chain, expected_tokens, measure_acceptance, pick_tree, sequoia, tree_from_paths

WIDTH = 4  # ranks measured per depth
PROMPTS = 6
NEW_TOKENS = 64
AUTO_BUDGETS = (2, 4, 8, 16, 32)
PLAIN = "plain"  # auto's candidate without drafts


def comb(depth: int, width: int) -> Tree:
    """The rank-0 chain of `depth` drafts, each of its nodes with `width` ranked children."""
    return tree_from_paths([(0,) * d + (r,) for d in range(depth) for r in range(width)])


def calibration_inputs(tokenizer, vocab: int, n: int | None = None) -> list:
    """Prompts for calibration: chat-formatted ShareGPT prompts, or fixed random ids for a model
    without a tokenizer (a random test model has no text to be good at)."""
    n = PROMPTS if n is None else n
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(0, vocab, (24,), generator=g).tolist() for _ in range(n)]
    from .data import calibration_prompts

    return calibration_prompts(n)


@dataclass
class Measured:
    records: list = field(default_factory=list)  # accepted rank paths, one per speculative step
    steps: int = 0
    tokens: int = 0
    wall_s: float = 0.0

    @property
    def tau(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


def run_prompts(engine, prompts, new_tokens: int | None = None, speculate: bool = True) -> Measured:
    """Greedy generation over the prompts (a first short warm-up call is not counted); with
    speculate=False, plain decoding through the same engine."""
    chat = engine.tokenizer is not None and bool(getattr(engine.tokenizer, "chat_template", None))
    new_tokens = max(2, min(NEW_TOKENS if new_tokens is None else new_tokens, engine.max_len // 2))
    # The prompt's tail, so that prompt + new tokens fit --max-len.
    inputs = [engine.encode(p, chat)[-(engine.max_len - new_tokens):] for p in prompts]
    engine.generate(inputs[0], max_new_tokens=4, speculate=speculate)
    m = Measured()
    for ids in inputs:
        res = engine.generate(ids, max_new_tokens=new_tokens, stop_at_eos=False, speculate=speculate)
        m.records += res.stats.rank_paths
        m.steps += res.stats.steps
        m.tokens += res.stats.new_tokens - 1  # the first token comes from prefill
        m.wall_s += res.stats.wall_s - res.stats.prefill_s
    return m


def _tree_file(tree: Tree, folder: Path, name: str) -> str:
    path = folder / f"{name}.json"
    path.write_text(json.dumps({"paths": [list(p) for p in tree.paths]}))
    return str(path)


def measure(build, spec: str, drafter: str, depth_limit: int, work: Path, progress: bool):
    """Acceptance table from a comb-tree calibration engine. `build(tree_file, backend, out_dir)`
    compiles an engine with the caller's model and drafter and returns it loaded."""
    budget = None if spec.strip() == "auto" else int(spec.strip().partition(":")[2])
    depth = depth_limit if budget is None else max(1, min(depth_limit, budget - 1))
    tree = comb(depth, WIDTH)
    if progress:
        print(f"calibrating {spec}: {drafter} drafts on a {tree.size}-node comb tree (depth {depth}, "
              f"{WIDTH} ranks per depth), {PROMPTS} ShareGPT prompts x {NEW_TOKENS} tokens, eager backend")
    engine = build(_tree_file(tree, work, "comb"), "eager", work / "calibration")
    m = run_prompts(engine, calibration_inputs(engine.tokenizer, engine.manifest.target.vocab_size))
    acceptance = measure_acceptance(m.records, tree)
    info = {"prompts": PROMPTS, "new_tokens": NEW_TOKENS, "comb_depth": depth, "width": WIDTH,
            "steps": m.steps, "tau": round(m.tau, 4)}
    return acceptance, depth, info


def resolve(spec: str, drafter: str, build, depth_limit: int, work: Path, progress: bool = True):
    """The tree for a measured spec, and the report the manifest keeps. For auto, also the path of
    the winning candidate's engine directory (already compiled on the requested backend)."""
    acceptance, depth, info = measure(build, spec, drafter, depth_limit, work, progress)
    report = {"acceptance": [[round(a, 4) for a in row] for row in acceptance], "calibration": info}
    if spec.strip() != "auto":
        budget = int(spec.strip().partition(":")[2])
        tree = sequoia(acceptance, budget, depth)
        if tree.size < 2:
            raise SpeccError(f"--tree {spec.strip()} found no draft the target ever accepted on the calibration "
                             f"prompts, so the best tree has no drafts; use --tree chain:K or no drafter.")
        report["expected_tokens"] = round(expected_tokens(tree, acceptance), 4)
        return tree, report, None
    return _auto(acceptance, depth, build, work, report, progress)


def _auto(acceptance, depth: int, build, work: Path, report: dict, progress: bool):
    candidates, seen = [], set()
    for b in AUTO_BUDGETS:
        tree = sequoia(acceptance, b, depth)
        if tree.size > 1 and tree.paths not in seen:  # a small table can give one tree for several budgets
            seen.add(tree.paths)
            candidates.append((f"sequoia:{b}", tree))
    if not candidates:
        raise SpeccError("--tree auto found no draft the target ever accepted on the calibration prompts; "
                         "use --tree chain:K.")
    prompts = None
    step_s, measured, dirs = {}, {}, {}
    bar = tqdm(candidates, desc="auto: time candidates", unit="tree", disable=not progress)
    for spec, tree in bar:
        bar.set_postfix_str(spec)
        out = work / f"candidate-{tree.size}"
        engine = build(_tree_file(tree, work, f"candidate-{tree.size}"), None, out)
        if prompts is None:
            prompts = calibration_inputs(engine.tokenizer, engine.manifest.target.vocab_size)
        runs = [(spec, tree.size, True)] + ([(PLAIN, 1, False)] if PLAIN not in measured else [])
        for name, size, speculate in runs:  # plain decoding is a candidate too, timed on the first engine
            t0 = time.perf_counter()
            m = run_prompts(engine, prompts, speculate=speculate)
            step_s[size] = m.wall_s / m.steps
            measured[name] = {"tau": round(m.tau, 4), "tokens_per_s": round(m.tokens_per_s, 3),
                              "seconds": round(time.perf_counter() - t0, 2)}
        dirs[spec] = out
    bar.close()
    best, rows = pick_tree([(PLAIN, chain(0))] + candidates, acceptance, step_s)
    for row in rows:
        row.update({f"measured_{k}": v for k, v in measured[row["tree"]].items() if k != "seconds"})
    report["candidates"] = rows
    # When plain decoding wins, the engine is the smallest candidate marked to decode plainly
    # (Engine.speculates): an auto engine is never slower than plain on its calibration prompts.
    report["picked"] = PLAIN if best == 0 else candidates[best - 1][0]
    spec, tree = candidates[max(best - 1, 0)]
    return tree, report, dirs[spec]


def staging(parent: Path, name: str) -> Path:
    return Path(tempfile.mkdtemp(dir=parent, prefix=f".{name}.calibrate-"))


def cleanup(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
