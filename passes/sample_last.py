"""Pass `sample_last`: a prefill chunk returns only the token that follows its last valid row."""
from __future__ import annotations

import torch
from torch import nn

from specc.pipeline import example_inputs, capture
from specc.acceptance import accept
from specc.signature import parse_sampling, sampling_inputs


class SampleLast(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.parents = (-1,)
        self.register_buffer("child_table", torch.full((1, 1), -1, dtype=torch.int64), persistent=False)

    def forward(self, tokens, base_len, n_valid, *sampling_args):
        s = parse_sampling(sampling_args)
        logits, *taps = self.inner(tokens, base_len)
        last = logits[0].index_select(0, (n_valid - 1).view(1))
        _, _, out = accept(last, tokens[:1], self.parents, self.child_table, s.temperature, s.top_p, s.uniforms,
                           mode=s.mode)
        return (out[0], *taps)


def sample_last(ep: torch.export.ExportedProgram, mode: str = "greedy") -> torch.export.ExportedProgram:
    """Invariant: inputs are (tokens [C], base_len [], n_valid [], then the mode's sampling inputs
    with uniforms [2]); the output is the next token after row n_valid - 1, drawn by the same rule
    as a decode step of the mode (argmax when greedy). Rows past n_valid are padding whose cache
    writes land beyond the committed length and are overwritten later."""
    tokens, base_len = example_inputs(ep)
    args = (tokens, base_len, torch.tensor(1),
            *sampling_inputs(mode, torch.tensor(1.0), torch.tensor(0.5), torch.zeros(2)))
    return capture(SampleLast(ep.module()), args)
