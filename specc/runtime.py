"""The runtime: a thin host loop around the compiled graphs of one engine (batch 1).

prefill (static chunks) -> first token -> repeat one decode strategy (specc/strategies.py: plain,
host drafts or fused, chosen once per generation; adaptive verification and hybrid trees inside
the speculative two) -> commit what each step accepted. A generation picks its mode's graphs
(greedy / sample / top_p) and, when it samples, draws its whole table of uniforms once from the
seeded generator on the CPU (the same draws on every device); the graphs index it by position.
Each decode call returns what the next one takes (the committed length and the next tokens: the
root, and with a fused step the next tree's drafts), so those never leave the device, and a small
report (accepted count, path, tokens) that the host reads once per step: the only device-to-host
read of a step on the plain and fused paths and with host drafters that need no reads of their own
(ngram). The draft-model drafter reads each draft token it makes; an adaptive fused engine also
reads the next drafts' confidences, to choose the next call's graph, and may let its drafter rest
for a run of plain steps (specc/adaptive.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .adaptive import StepClock
from .errors import SpeccError
from .hybrid import NgramBranch
from .manifest import Manifest
from .prefill import prefill, prefill_name
from .signature import (MODES, SampledChildren, StepSignature, graph_name, graphs_for_mode, mode_of, split_report,
                        uniform_columns)
from .strategies import Run, pick_step

MODE_WORDS = {"greedy": "greedy decoding", "sample": "sampling (temperature > 0)",
              "top_p": "sampling with top-p < 1"}


@dataclass
class Stats:
    new_tokens: int = 0
    steps: int = 0  # verify passes (speculative or plain)
    tau: float = 0.0  # committed tokens per verify pass, bonus included
    tokens_per_s: float = 0.0
    wall_s: float = 0.0
    prefill_s: float = 0.0
    prompt_tokens: int = 0
    stop: str = ""  # "eos" | "max_new_tokens" | "max_len"
    accepted_hist: list[int] = field(default_factory=list)  # count of steps by accepted drafts
    # Per speculative step, the sibling ranks along the accepted path ((0, 2): rank 0, then rank 2);
    # what `--tree sequoia/auto` measure acceptance from. Not in as_dict (one entry per step).
    rank_paths: list[tuple[int, ...]] = field(default_factory=list)
    # Steps by the size of the tree they verified (1: plain): an adaptive engine's choices, and
    # the plain steps a host drafter falls back to when it has nothing to propose.
    verified_sizes: dict[int, int] = field(default_factory=dict)
    # Steps by the graph that ran (plain, step, step3, fused2, ...): how often an adaptive engine
    # chose each member; `plain` counts the steps its drafter rested too.
    graphs: dict[str, int] = field(default_factory=dict)
    # Hybrid trees (--ngram-branch): steps whose tree carried prompt lookup's continuation, and
    # those whose accepted path went through a node it wrote.
    lookup_steps: int = 0
    lookup_accepted: int = 0
    # With Engine.record_confidences (adaptive calibration), per speculative step beside rank_paths,
    # the confidences of the nodes it verified, (class or a class per node, values), or None.
    confidences: list[tuple] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"new_tokens": self.new_tokens, "steps": self.steps, "tau": round(self.tau, 4),
                "tokens_per_s": round(self.tokens_per_s, 3), "wall_s": round(self.wall_s, 4),
                "prefill_s": round(self.prefill_s, 4), "prompt_tokens": self.prompt_tokens, "stop": self.stop,
                "accepted_hist": self.accepted_hist,
                "verified_sizes": {str(k): v for k, v in sorted(self.verified_sizes.items())},
                "graphs": dict(sorted(self.graphs.items())),
                "lookup_steps": self.lookup_steps, "lookup_accepted": self.lookup_accepted}


@dataclass
class Result:
    token_ids: list[int]
    text: str
    stats: Stats


class Engine:
    """Holds the engine's tensors (weights + KV caches), graphs, tree and drafter; see `specc.load`."""

    def __init__(self, manifest: Manifest, graphs: dict, tokenizer, drafter, tree, path=None, device: str = "cpu",
                 cuda_graphs: bool = False):
        self.manifest, self.graphs, self.tokenizer, self.drafter, self.tree = manifest, graphs, tokenizer, drafter, tree
        self.path, self.device = path, torch.device(device)
        # Capture each decode graph once and replay it (CUDA only; specc/cuda_graphs.py).
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self._captured: dict[str, object] = {}
        self.max_len = manifest.max_len
        self.chunk = manifest.prefill_chunk
        # the prefill chunk graphs' sizes and their measured costs
        self.chunks = manifest.prefill_chunks
        self.prefill_ms = {int(k): v for k, v in manifest.prefill_ms.items()} if manifest.prefill_ms else None
        self.eos = set(manifest.target.eos_token_ids or [])
        # One graph per step where the engine has a fused step; False runs the unfused path (its reference).
        self.use_fused = True
        self.sampled = SampledChildren.from_entry(manifest.drafter, manifest.target.vocab_size)
        self.rates = manifest.drafter.get("confidence", False)  # its fused graph returns confidences
        self.modes = tuple(manifest.modes)
        self._report_buffers: dict[tuple, torch.Tensor] = {}  # pinned host buffers for the reports (CUDA)
        # Adaptive verification (specc/adaptive.py): the family's latencies and the calibrated rates.
        entry = manifest.adaptive or {}
        self.adaptive = entry if "latency_ms" in entry else None
        # Greedy adaptive generations choose from step times measured as they run (StepClock; kept
        # across generations, renewed when `adaptive` is replaced); False: the compiled table alone.
        self.time_steps = True
        self._clock: StepClock | None = None
        self._row0 = torch.zeros(1, dtype=torch.int64, device=self.device)  # a one-token call's tap row
        # Read each step's confidences into Stats.confidences (adaptive.calibrate_on_steps sets it).
        self.record_confidences = False
        # `--tree auto` found plain decoding fastest on its calibration prompts: the engine decodes
        # plainly unless it chooses per step (adaptive).
        self.speculates = manifest.tree.get("picked") != "plain" or self.adaptive is not None
        # A hybrid tree (specc/hybrid.py): the host writes prompt lookup's continuation into each tree.
        branch = manifest.drafter.get("ngram_branch")
        self.ngram_branch = NgramBranch(tree, branch) if branch else None

    def signatures(self, mode: str) -> tuple[StepSignature, StepSignature, StepSignature]:
        """The plain, step and fused graphs' calling conventions in `mode`."""
        T, q = self.tree.size, self.sampled
        return (StepSignature(1, mode=mode), StepSignature(T, q, mode=mode),
                StepSignature(T, q, fused=True, mode=mode, confidence=self.rates))

    # -- prompts ---------------------------------------------------------------------------
    def encode(self, prompt, chat: bool = False) -> list[int]:
        if isinstance(prompt, (list, tuple)):
            ids = [int(t) for t in prompt]
            vocab = self.manifest.target.vocab_size
            if not ids or any(not 0 <= t < vocab for t in ids):
                raise SpeccError(f"prompt token ids must be a non-empty list of ids in [0, {vocab}).")
            return ids
        if self.tokenizer is None:
            raise SpeccError("this engine has no tokenizer, so prompts must be given as token ids.")
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise SpeccError("--chat was given but the model has no chat template.")
            out = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                     add_generation_prompt=True, tokenize=True)
            ids = list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
        else:
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if not ids:
            raise SpeccError("the prompt is empty after tokenisation.")
        return list(ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    # -- generation ------------------------------------------------------------------------
    def _start(self, ids: list[int], max_new_tokens: int, temperature: float, top_p: float, seed: int,
               speculate: bool, stop_at_eos: bool) -> Run:
        """Check a request and set up its generation: its mode's graphs, its table of uniforms, and
        the engine's parts it runs with."""
        L = len(ids)
        if L >= self.max_len:
            raise SpeccError(f"the prompt has {L} tokens, which does not fit --max-len {self.max_len} "
                             f"(it must leave room for at least one new token).")
        if temperature < 0 or not 0 < top_p <= 1:
            raise SpeccError("temperature must be >= 0 and top-p must be in (0, 1].")
        mode = mode_of(temperature, top_p)
        if mode not in self.modes:
            raise SpeccError(f"{MODE_WORDS[mode]} needs the {mode} graphs, and this engine was compiled with "
                             f"--modes {','.join(self.modes)}; compile it again with --modes "
                             f"{','.join(m for m in MODES if m in self.modes or m == mode)}.")
        table = None
        if mode != "greedy":  # the whole generation's draws, once, on the CPU: the same on every device
            gen = torch.Generator().manual_seed(seed)
            table = torch.rand(self.manifest.cache_len, uniform_columns(self.tree.size, self.sampled),
                               generator=gen).to(self.device)
        drafter = self.drafter if speculate and self.speculates else None
        run = Run(committed=list(ids), base_len=L, budget=min(max_new_tokens, self.max_len - L), produced=0,
                  stop_ids=self.eos if stop_at_eos else set(), temperature=self._tensor(float(temperature)),
                  top_p=self._tensor(float(top_p)), mode=mode, graphs=self._mode_graphs(mode),
                  signatures=self.signatures(mode), table=table, tree=self.tree, drafter=drafter,
                  sampled=self.sampled, rates=self.rates, adaptive=self.adaptive,
                  record_confidences=self.record_confidences, ngram_branch=self.ngram_branch, device=self.device,
                  report_buffers=self._report_buffers, row0=self._row0)
        if drafter is not None and mode == "greedy":
            run.clock = self.step_clock()
        return run

    def _steps(self, ids: list[int], max_new_tokens: int, temperature: float, top_p: float, seed: int,
               speculate: bool, stop_at_eos: bool, stats: Stats) -> Iterator[list[int]]:
        """Yield the tokens committed by prefill, then by each step of the generation's strategy."""
        run = self._start(ids, max_new_tokens, temperature, top_p, seed, speculate, stop_at_eos)
        step, drafter = pick_step(run, self.use_fused), run.drafter
        t0 = time.perf_counter()
        on_rows = None
        if drafter is not None:
            drafter.start(ids, run.mode, run.temperature, run.top_p, run.table)
            on_rows = drafter.add_rows if drafter.needs_rows else None
        chunk_graphs = {c: run.graphs[prefill_name(c, self.chunk)] for c in self.chunks}
        first = prefill(ids, chunk_graphs, run.graphs["plain"], run.mode, run.temperature, run.top_p, run.table,
                        on_rows, self.device, self.prefill_ms, self.manifest.cache_len)
        run.base_dev = self._tensor(len(ids))
        stats.prefill_s, stats.prompt_tokens = time.perf_counter() - t0, len(ids)
        run.committed.append(first)
        run.produced = 1
        yield [first]
        if first in run.stop_ids:
            stats.stop = "eos"
            return
        while run.produced < run.budget:
            t = time.perf_counter()
            report, size = step(run)
            if run.clock is not None:
                run.clock.record(run.graph, (time.perf_counter() - t) * 1000)
            n, path, out = split_report(report)
            new = commit(run, stats, n, path, out, size)
            if drafter is not None:
                drafter.accepted(run.committed, n)
            yield new
            if stats.stop == "eos":
                return
        stats.stop = "max_len" if run.budget < max_new_tokens else "max_new_tokens"

    def step_clock(self) -> StepClock | None:
        """The step times an adaptive engine's greedy choices read (None: the compiled table)."""
        if self.adaptive is None or not self.time_steps:
            return None
        if self._clock is None or self._clock.entry is not self.adaptive:
            self._clock = StepClock(self.adaptive)
        return self._clock

    def _mode_graphs(self, mode: str) -> dict:
        """The mode's graphs by name; with CUDA graphs, its decode calls captured (before any prefill:
        capture writes cache slots that prefill then rewrites)."""
        graphs = graphs_for_mode(self.graphs, mode)
        if not self.cuda_graphs:
            return graphs
        from .cuda_graphs import capture

        # Every decode graph: plain, the step and the fused step, and an adaptive family's members.
        for name in [n for n in graphs if n == "plain" or n.startswith(("step", "fused"))]:
            key = graph_name(name, mode) if graph_name(name, mode) in self.graphs else name
            if key in self.graphs:
                if key not in self._captured:
                    example = tuple(torch.zeros(s, dtype=d, device=self.device)
                                    for s, d in self.manifest.graphs[key].input_specs())
                    self._captured[key] = capture(self.graphs[key], example)
                graphs[name] = self._captured[key]
        return graphs

    def _tensor(self, value, **kw) -> torch.Tensor:
        return torch.tensor(value, device=self.device, **kw)

    def stream(self, prompt, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0, chat: bool = False, speculate: bool = True, stop_at_eos: bool = True,
               stats: Stats | None = None) -> Iterator[str]:
        """Yield text pieces as tokens are committed; `stats` (if given) is filled as in generate()."""
        stats = stats if stats is not None else Stats()
        if max_new_tokens < 1:
            raise SpeccError("max_new_tokens must be at least 1.")
        ids = self.encode(prompt, chat)
        out: list[int] = []
        shown = ""
        t0 = time.perf_counter()
        for new in self._steps(ids, max_new_tokens, temperature, top_p, seed, speculate, stop_at_eos, stats):
            out += new
            text = self.decode(out)
            if text.startswith(shown) and not text.endswith("\ufffd"):
                yield text[len(shown):]
                shown = text
            _finish(stats, out, t0)
        text = self.decode(out)
        if text.startswith(shown) and len(text) > len(shown):
            yield text[len(shown):]

    def generate(self, prompt, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, chat: bool = False, speculate: bool = True, stop_at_eos: bool = True) -> Result:
        """Generate from text or token ids; `speculate=False` runs plain decoding through the same backend."""
        if max_new_tokens < 1:
            raise SpeccError("max_new_tokens must be at least 1.")
        ids = self.encode(prompt, chat)
        stats = Stats()
        t0 = time.perf_counter()
        out: list[int] = []
        for new in self._steps(ids, max_new_tokens, temperature, top_p, seed, speculate, stop_at_eos, stats):
            out += new
        _finish(stats, out, t0)
        return Result(token_ids=out, text=self.decode(out), stats=stats)


def _finish(stats: Stats, out: list[int], t0: float) -> None:
    stats.wall_s = time.perf_counter() - t0
    stats.new_tokens = len(out)
    stats.tau = (len(out) - 1) / stats.steps if stats.steps else 0.0
    stats.tokens_per_s = len(out) / stats.wall_s if stats.wall_s > 0 else 0.0


def commit(run: Run, stats: Stats, n: int, path, out, size: int) -> list[int]:
    """What every strategy shares: record the step, commit the accepted tokens and the bonus token
    (cut at the budget and at EOS), and advance the committed length."""
    if size > 1:
        stats.rank_paths.append(tuple(run.tree.ranks[i] for i in path[1: n + 1]))
        if run.record_confidences:  # one entry per rank path (None: the step had no confidences)
            cls, values = run.confidence or (0, None)
            stats.confidences.append(None if values is None else
                                     (cls if isinstance(cls, int) else cls[: size - 1], values[: size - 1]))
    run.confidence = None
    if run.lookup_nodes:
        stats.lookup_steps += 1
        stats.lookup_accepted += bool(set(path[1: n + 1]) & set(run.lookup_nodes))
    stats.steps += 1
    stats.verified_sizes[size] = stats.verified_sizes.get(size, 0) + 1
    stats.graphs[run.graph] = stats.graphs.get(run.graph, 0) + 1
    while len(stats.accepted_hist) <= n:
        stats.accepted_hist.append(0)
    stats.accepted_hist[n] += 1
    run.base_len += n + 1
    new = out[: n + 1][: run.budget - run.produced]
    for i, t in enumerate(new):
        if t in run.stop_ids:
            new = new[: i + 1]
            stats.stop = "eos"
            break
    run.committed += new
    run.produced += len(new)
    return new
