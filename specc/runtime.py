"""The runtime: a thin host loop around the compiled graphs of one engine (batch 1).

prefill (static chunks) -> first token -> repeat the step graph: inputs are the committed
length, the tree's tokens (root = last committed token, then the drafts), the sampling
parameters and uniform random numbers; outputs are the number of accepted drafts and the
accepted tokens followed by the bonus token. One host/device sync per step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .errors import SpeccError


# A prompt tail this short goes through the one-token graph token by token: on the 2-core CPU a
# 32-token chunk call costs about 110 ms and a one-token call about 31 ms (SmolLM2, fp32).
PLAIN_TAIL = 3


def tap_rows(taps, rows) -> torch.Tensor:
    """The hidden-state taps [1, T, H] each of a graph call, at row indices `rows`, side by side [n, L*H]."""
    return torch.cat([t[0].index_select(0, rows) for t in taps], dim=-1)


def prefill(ids: list[int], chunk_graph, one_graph, chunk: int, temperature, top_p, gen, on_rows=None,
            device="cpu") -> int:
    """Fill the cache with `ids` (static chunks, a short tail one token at a time) and return the
    token that follows them, drawn by the same rule as a decode step. `on_rows(rows, start)`
    receives the taps of the prompt's rows (when the graphs have taps). The graphs' inputs are
    made on `device`; the random numbers come from the CPU generator `gen` on every device, so a
    seed gives the same draws everywhere."""
    L = len(ids)
    dev = lambda v, **kw: torch.tensor(v, device=device, **kw)  # noqa: E731
    tail = L % chunk
    chunked = L - tail if 0 < tail <= PLAIN_TAIL else L
    first = None
    for start in range(0, chunked, chunk):
        piece = ids[start:start + chunk]
        toks = dev(piece + [0] * (chunk - len(piece)), dtype=torch.int64)
        res = chunk_graph(toks, dev(start), dev(len(piece)), temperature, top_p,
                          torch.rand(2, generator=gen).to(device))
        first = res[0]
        if on_rows is not None:
            on_rows(tap_rows(res[1:], torch.arange(len(piece), device=device)), start)
    for pos in range(chunked, L):
        res = one_graph(dev([ids[pos]]), dev(pos), temperature, top_p, torch.rand(2, generator=gen).to(device))
        first = res[2][0]
        if on_rows is not None:
            on_rows(tap_rows(res[3:], torch.arange(1, device=device)), pos)
    return int(first)


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

    def as_dict(self) -> dict:
        return {"new_tokens": self.new_tokens, "steps": self.steps, "tau": round(self.tau, 4),
                "tokens_per_s": round(self.tokens_per_s, 3), "wall_s": round(self.wall_s, 4),
                "prefill_s": round(self.prefill_s, 4), "prompt_tokens": self.prompt_tokens, "stop": self.stop,
                "accepted_hist": self.accepted_hist}


@dataclass
class Result:
    token_ids: list[int]
    text: str
    stats: Stats


class Engine:
    """Holds the engine's tensors (weights + KV caches), graphs, tree and drafter; see `specc.load`."""

    def __init__(self, manifest: dict, graphs: dict, tokenizer, drafter, tree, path=None, device: str = "cpu"):
        self.manifest, self.graphs, self.tokenizer, self.drafter, self.tree = manifest, graphs, tokenizer, drafter, tree
        self.path, self.device = path, torch.device(device)
        self.max_len = manifest["max_len"]
        self.chunk = manifest["prefill_chunk"]
        self.eos = set(manifest["target"].get("eos_token_ids") or [])
        # One graph per step where the engine has a fused step; False runs the unfused path (its reference).
        self.use_fused = True

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
        budget = min(max_new_tokens, self.max_len - L)
        gen = torch.Generator().manual_seed(seed)  # on the CPU: the same draws on every device
        device = self.device
        dev = lambda v, **kw: torch.tensor(v, device=device, **kw)  # noqa: E731
        temp_t, top_p_t = dev(float(temperature)), dev(float(top_p))
        drafter = self.drafter if speculate else None
        step = self.graphs["step"] if drafter is not None else self.graphs["plain"]
        T = self.tree.size if drafter is not None else 1
        t0 = time.perf_counter()
        on_rows = None
        n_u = getattr(drafter, "n_uniforms", 0)  # sampled children: draws per proposal (0: top-k drafts)
        if drafter is not None:
            drafter.start(ids, temp_t, top_p_t, gen)
            on_rows = drafter.add_rows if getattr(drafter, "needs_taps", False) else None
        first = prefill(ids, self.graphs["prefill"], self.graphs["plain"], self.chunk, temp_t, top_p_t, gen, on_rows,
                        device)
        committed = ids + [int(first)]
        stats.prefill_s = time.perf_counter() - t0
        stats.prompt_tokens = L
        yield [int(first)]
        produced = 1
        if stop_at_eos and int(first) in self.eos:
            stats.stop = "eos"
            return
        base_len = L  # tokens whose K/V are in the cache; the root committed[-1] is not yet
        # Fused: the step graph also updates the drafter and returns the next tree's drafts, so after
        # the first proposal (which flushes the prompt's rows) there is one graph call per step.
        fused = self.graphs.get("fused") if drafter is not None and self.use_fused else None
        next_drafts = next_q = None
        while produced < budget:
            if next_drafts is not None:
                graph, size = fused, T
                tokens = torch.cat((dev([committed[-1]]), next_drafts))
            elif drafter is not None:
                drafts, found = drafter.propose(committed)
                graph, size = (fused or step, T) if found else (self.graphs["plain"], 1)
                tokens = dev([committed[-1]] + drafts[: size - 1], dtype=torch.int64)
            else:
                graph, size = step, 1
                tokens = dev([committed[-1]], dtype=torch.int64)
            uniforms = torch.rand(size + 1, generator=gen).to(device)
            extra = ()
            if n_u and size > 1:  # this tree's q; the fused graph also draws the next tree (after these uniforms)
                extra = (next_q if next_drafts is not None else drafter.q,)
                if graph is fused:
                    extra += (torch.rand(n_u, generator=gen).to(device),)
            n, path, out, *taps = graph(tokens, dev(base_len), temp_t, top_p_t, uniforms, *extra)
            if graph is fused:
                next_drafts, next_q, taps, on_step_rows = taps[0], taps[1] if n_u else None, [], None
            else:
                on_step_rows = on_rows
            n = int(n)
            if size > 1:
                stats.rank_paths.append(tuple(self.tree.ranks[i] for i in path[1: n + 1].tolist()))
            if on_step_rows is not None:  # the root and the accepted drafts are now committed context
                on_step_rows(tap_rows(taps, path[: n + 1]), base_len)
            new = out[: n + 1].tolist()
            stats.steps += 1
            while len(stats.accepted_hist) <= n:
                stats.accepted_hist.append(0)
            stats.accepted_hist[n] += 1
            base_len += n + 1
            new = new[: budget - produced]
            if stop_at_eos:
                for i, t in enumerate(new):
                    if t in self.eos:
                        new = new[: i + 1]
                        stats.stop = "eos"
                        break
            committed += new
            produced += len(new)
            if drafter is not None:
                drafter.accepted(committed, n)
            yield new
            if stats.stop == "eos":
                return
        stats.stop = "max_len" if budget < max_new_tokens else "max_new_tokens"

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
