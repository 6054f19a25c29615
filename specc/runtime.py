"""The runtime: a thin host loop around the compiled graphs of one engine (batch 1).

prefill (static chunks) -> first token -> repeat the step graph. A generation picks its mode's
graphs (greedy / sample / top_p) and, when it samples, draws its whole table of uniforms once from
the seeded generator on the CPU (the same draws on every device); the graphs index it by position.
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

from .adaptive import StepClock, choose, fused_name, next_rest_run, step_name
from .errors import SpeccError
from .hybrid import NgramBranch
from .prefill import prefill, prefill_name, tap_rows
from .signature import (MODES, SampledChildren, StepSignature, graph_name, graphs_for_mode, mode_of, split_report,
                        uniform_columns)


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
class Run:
    """The host loop's state during one generation."""
    committed: list[int]  # prompt and generated tokens
    base_len: int  # tokens whose K/V are in the cache; the root committed[-1] is not yet
    budget: int  # new tokens allowed
    produced: int
    temperature: torch.Tensor
    top_p: torch.Tensor
    mode: str  # greedy | sample | top_p: which of the engine's graphs run
    graphs: dict  # the mode's graphs, by name without the mode (prefill, plain, step, fused, ...)
    signatures: tuple  # the mode's plain, step and fused StepSignatures (Engine.signatures), made once
    table: torch.Tensor | None  # the generation's uniforms (sampling modes), on the device
    # What the last decode call returned for the next one, on the device: base_len [] and the
    # root [1]; after a fused call, the next tree [T] (root + drafts) and its q.
    base_dev: torch.Tensor | None = None
    root_dev: torch.Tensor | None = None
    next_tokens: torch.Tensor | None = None
    next_q: torch.Tensor | None = None
    next_confidence: torch.Tensor | None = None  # a DSpark drafter's confidence in each of next_tokens' drafts
    lookup_nodes: list[int] = field(default_factory=list)  # the nodes prompt lookup wrote in this call's tree
    confidence: tuple | None = None  # this call's drafts' confidences, where read (Stats.confidences)
    graph: str = "plain"  # the graph this call ran (Stats.graphs)
    # An adaptive fused engine's resting drafter (specc/adaptive.py): plain steps left before the
    # next probe, and the length of the current run of them (0: the engine speculates).
    rest_left: int = 0
    rest_run: int = 0
    clock: StepClock | None = None  # an adaptive greedy generation's step times (Engine.step_clock)


@dataclass
class Result:
    token_ids: list[int]
    text: str
    stats: Stats


class Engine:
    """Holds the engine's tensors (weights + KV caches), graphs, tree and drafter; see `specc.load`."""

    def __init__(self, manifest: dict, graphs: dict, tokenizer, drafter, tree, path=None, device: str = "cpu",
                 cuda_graphs: bool = False):
        self.manifest, self.graphs, self.tokenizer, self.drafter, self.tree = manifest, graphs, tokenizer, drafter, tree
        self.path, self.device = path, torch.device(device)
        # Capture each decode graph once and replay it (CUDA only; specc/cuda_graphs.py).
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self._captured: dict[str, object] = {}
        self.max_len = manifest["max_len"]
        self.chunk = manifest["prefill_chunk"]
        # the prefill chunk graphs' sizes (engines before several sizes: the one) and their measured costs
        self.chunks = manifest.get("prefill_chunks", [self.chunk])
        self.prefill_ms = {int(k): v for k, v in manifest["prefill_ms"].items()} if "prefill_ms" in manifest else None
        self.eos = set(manifest["target"].get("eos_token_ids") or [])
        # One graph per step where the engine has a fused step; False runs the unfused path (its reference).
        self.use_fused = True
        self.sampled = SampledChildren.from_entry(manifest["drafter"], manifest["target"]["vocab_size"])
        self.rates = manifest["drafter"].get("confidence", False)  # its fused graph returns confidences
        self.modes = tuple(manifest.get("modes", MODES))
        self._report_buffers: dict[tuple, torch.Tensor] = {}  # pinned host buffers for the reports (CUDA)
        # Adaptive verification (specc/adaptive.py): the family's latencies and the calibrated rates.
        entry = manifest.get("adaptive") or {}
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
        self.speculates = manifest["tree"].get("picked") != "plain" or self.adaptive is not None
        # A hybrid tree (specc/hybrid.py): the host writes prompt lookup's continuation into each tree.
        branch = manifest["drafter"].get("ngram_branch")
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
            vocab = self.manifest["target"]["vocab_size"]
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
    def _steps(self, ids: list[int], max_new_tokens: int, temperature: float, top_p: float, seed: int,
               speculate: bool, stop_at_eos: bool, stats: Stats) -> Iterator[list[int]]:
        """Yield the tokens committed by prefill, then by each step."""
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
        dev = self._tensor
        table = None
        if mode != "greedy":  # the whole generation's draws, once, on the CPU: the same on every device
            gen = torch.Generator().manual_seed(seed)
            table = torch.rand(self.manifest["cache_len"], uniform_columns(self.tree.size, self.sampled),
                               generator=gen).to(self.device)
        run = Run(committed=list(ids), base_len=L, budget=min(max_new_tokens, self.max_len - L), produced=0,
                  temperature=dev(float(temperature)), top_p=dev(float(top_p)), mode=mode,
                  graphs=self._mode_graphs(mode), signatures=self.signatures(mode), table=table)
        drafter = self.drafter if speculate and self.speculates else None
        if drafter is not None and mode == "greedy":
            run.clock = self.step_clock()
        step = (self._plain_step if drafter is None else
                self._fused_step if self.use_fused and "fused" in run.graphs else self._speculative_step)
        t0 = time.perf_counter()
        on_rows = None
        if drafter is not None:
            drafter.start(ids, mode, run.temperature, run.top_p, table)
            on_rows = drafter.add_rows if drafter.needs_rows else None
        chunk_graphs = {c: run.graphs[prefill_name(c, self.chunk)] for c in self.chunks}
        first = prefill(ids, chunk_graphs, run.graphs["plain"], mode, run.temperature, run.top_p, table, on_rows,
                        self.device, self.prefill_ms, self.manifest["cache_len"])
        run.base_dev = dev(L)
        stats.prefill_s, stats.prompt_tokens = time.perf_counter() - t0, L
        run.committed.append(first)
        run.produced = 1
        yield [first]
        if stop_at_eos and first in self.eos:
            stats.stop = "eos"
            return
        while run.produced < run.budget:
            t = time.perf_counter()
            report, size = step(run)
            if run.clock is not None:
                run.clock.record(run.graph, (time.perf_counter() - t) * 1000)
            n, path, out = split_report(report)
            new = self._commit(run, stats, n, path, out, size, stop_at_eos)
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
                    example = tuple(torch.zeros(s, dtype=getattr(torch, d.replace("torch.", "")), device=self.device)
                                    for s, d in self.manifest["graphs"][key]["inputs"])
                    self._captured[key] = capture(self.graphs[key], example)
                graphs[name] = self._captured[key]
        return graphs

    def _tensor(self, value, **kw) -> torch.Tensor:
        return torch.tensor(value, device=self.device, **kw)

    def _upload(self, tokens: list[int]) -> torch.Tensor:
        """Host tokens to the device without waiting for it (pinned memory, asynchronous copy)."""
        if self.device.type != "cuda":
            return torch.tensor(tokens, dtype=torch.int64)
        return torch.tensor(tokens, dtype=torch.int64).pin_memory().to(self.device, non_blocking=True)

    def _read(self, report: torch.Tensor) -> list:
        """The step's one device-to-host read: its report (or an adaptive engine's confidences),
        through a pinned buffer on CUDA."""
        if self.device.type != "cuda":
            return report.tolist()
        key = (report.shape[0], report.dtype)
        host = self._report_buffers.get(key)
        if host is None:
            host = self._report_buffers[key] = torch.empty(report.shape, dtype=report.dtype, pin_memory=True)
        host.copy_(report, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return host.tolist()

    def _root(self, run: "Run") -> torch.Tensor:
        """The next call's root [1]: on the device from the last call, or the first token from prefill."""
        return run.root_dev if run.root_dev is not None else self._upload([run.committed[-1]])

    def _advance(self, run: "Run", res) -> list[int]:
        """Keep what the next call takes on the device; read the report."""
        run.base_dev, run.root_dev = res.base_len, res.tokens[:1]
        return self._read(res.report)

    def _plain_step(self, run: "Run", keep_rows: bool = False):
        """Ordinary decoding: the one-node tree (the root alone) through the plain graph; `keep_rows`
        hands the root's hidden row to a drafter that reads them."""
        sig = run.signatures[0]
        res = sig.unpack(run.graphs["plain"](*sig.args(self._root(run), run.base_dev, run.temperature, run.top_p,
                                                       run.table)))
        if keep_rows and self.drafter.needs_rows:
            self.drafter.add_rows(tap_rows(res.taps, self._row0), run.base_len)
        run.next_tokens = run.next_confidence = None
        run.graph = "plain"
        return self._advance(run, res), 1

    def _rest_step(self, run: "Run", start: bool = False):
        """A plain step while an adaptive engine's drafter rests (`start`: a new run of them): the
        root's row waits with the drafter, and the next speculative call re-proposes through the
        drafter's own graphs, which flush the waiting rows (as the first call after prefill does)."""
        if start:
            run.rest_run = next_rest_run(run.rest_run)
            run.rest_left = run.rest_run
        run.rest_left -= 1
        return self._plain_step(run, keep_rows=True)

    def _choose(self, run: "Run") -> int:
        """The family member for this call's drafts (0: rest the drafter), from their confidences."""
        if run.clock is not None:
            latency, rest = run.clock.latency_ms, run.clock.rest_ms
        else:
            latency, rest = self.adaptive["latency_ms"], self.adaptive.get("rest_ms")
        k = choose(self.tree, latency, self.adaptive["rates"], run.confidence, rest)
        if run.clock is not None:  # a member untimed for long runs once, so that its time follows the machine
            k = run.clock.stale() or k
        if k:
            run.rest_run = 0
        return k

    def _speculative_step(self, run: "Run"):
        """The drafter proposes on the host, the step graph verifies; the accepted rows go back to a
        drafter that reads the target's hidden states. Without a proposal the step is plain."""
        if run.rest_left > 0:
            return self._rest_step(run)
        drafts, found = self.drafter.propose(run.committed)
        if not found:
            return self._plain_step(run)
        T, sig, name = self.tree.size, run.signatures[1], "step"
        if self.adaptive is not None or self.record_confidences:
            run.confidence = self.drafter.confidences()
        if self.adaptive is not None:  # the family member with the most expected tokens per second
            T = self._choose(run)
            if T == 0:
                return self._rest_step(run, start=True)
            if T == 1 and not self.drafter.needs_rows:
                return self._plain_step(run)
            sig, name = StepSignature(T, self.sampled, mode=run.mode), step_name(T, self.tree.size)
        drafts = drafts[: T - 1] if isinstance(drafts, torch.Tensor) else self._upload(drafts[: T - 1])
        tokens = self._with_lookup(run, torch.cat((self._root(run), drafts)))
        res = sig.unpack(run.graphs[name](*sig.args(tokens, run.base_dev, run.temperature, run.top_p, run.table,
                                                    self.drafter.q)))
        run.graph = name
        report = self._advance(run, res)
        if self.drafter.needs_rows:  # the root and the accepted drafts are now committed context
            n = report[0]
            _, path, _ = split_report(res.report)  # on the device: sliced, never read
            self.drafter.add_rows(tap_rows(res.taps, path[: n + 1]), run.base_len)
        return report, T

    def _fused_step(self, run: "Run"):
        """One graph per step: it verifies, updates the drafter and returns the next tree (root and
        drafts) and its q, which stay on the device for the next call. The first proposal (which
        flushes the prompt's rows) comes from the drafter's own graphs. An adaptive engine reads the
        drafts' confidences and runs the family member that verifies the first k nodes, or rests
        its drafter (the plain graph, re-probed after a run of plain steps)."""
        if run.rest_left > 0:
            return self._rest_step(run)
        T, sig, name = self.tree.size, run.signatures[2], "fused"
        if run.next_tokens is None:
            drafts, _ = self.drafter.propose(run.committed)
            drafts = drafts if isinstance(drafts, torch.Tensor) else self._upload(drafts[: T - 1])
            tokens, q, confidence = torch.cat((self._root(run), drafts)), self.drafter.q, self.drafter.confidence
        else:
            tokens, q, confidence = run.next_tokens, run.next_q, run.next_confidence
        if confidence is not None and (self.adaptive is not None or self.record_confidences):
            run.confidence = (list(self.tree.ranks[1:]), self._read(confidence))
        if self.adaptive is not None and run.confidence is not None:
            k = self._choose(run)
            if k == 0:
                return self._rest_step(run, start=True)
            if k < T:
                sig = StepSignature(k, self.sampled, fused=True, mode=run.mode, confidence=self.rates)
                name, tokens, T = fused_name(k, T), tokens[:k], k
        tokens = self._with_lookup(run, tokens)
        res = sig.unpack(run.graphs[name](*sig.args(tokens, run.base_dev, run.temperature, run.top_p, run.table,
                                                    q)))
        run.next_tokens, run.next_q, run.next_confidence = res.tokens, res.next_q, res.confidence
        run.graph = name
        return self._advance(run, res), T

    def _with_lookup(self, run: "Run", tokens: torch.Tensor) -> torch.Tensor:
        """A hybrid tree's tokens [T] with prompt lookup's continuation written in (specc/hybrid.py). The
        read follows the last step's report read, which already waited for the graph that drafted them."""
        if self.ngram_branch is None:
            return tokens
        merged, run.lookup_nodes = self.ngram_branch.merge(self._read(tokens), run.committed)
        return self._upload(merged) if run.lookup_nodes else tokens

    def _commit(self, run: "Run", stats: Stats, n: int, path, out, size: int, stop_at_eos: bool) -> list[int]:
        """What every mode shares: record the step, commit the accepted tokens and the bonus token
        (cut at the budget and at EOS), and advance the committed length."""
        if size > 1:
            stats.rank_paths.append(tuple(self.tree.ranks[i] for i in path[1: n + 1]))
            if self.record_confidences:  # one entry per rank path (None: the step had no confidences)
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
        if stop_at_eos:
            for i, t in enumerate(new):
                if t in self.eos:
                    new = new[: i + 1]
                    stats.stop = "eos"
                    break
        run.committed += new
        run.produced += len(new)
        return new

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
