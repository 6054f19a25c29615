"""Pass `sample_last`: a prefill chunk returns only the token that follows its last valid row."""
from __future__ import annotations

import torch
from torch import nn

from specc.pipeline import Uncaptured
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
        row = base_len + n_valid - 1  # the position of the chunk's last token: the next token's draws are its row
        last = logits[0].index_select(0, (n_valid - 1).view(1))
        uniforms = s.uniforms.index_select(0, row.view(1))[0, :2] if s.uniforms is not None else None
        _, _, out = accept(last, tokens[:1], self.parents, self.child_table, s.temperature, s.top_p, uniforms,
                           mode=s.mode)
        return (out[0], *taps)


def sample_last(prev: Uncaptured, mode: str = "greedy", table: tuple[int, int] = (1, 2)) -> Uncaptured:
    """Invariant: inputs are (tokens [C], base_len [], n_valid [], then the mode's sampling inputs
    with the generation's uniforms table `table` (rows, cols)); the output is the next token after
    row n_valid - 1, drawn by the same rule as a decode step of the mode (argmax when greedy) with
    the first two draws of the table's row base_len + n_valid - 1 (the plain step whose root is the
    chunk's last token would read the same). Rows past n_valid are padding whose cache writes land
    beyond the committed length and are overwritten later."""
    tokens, base_len = prev.args
    args = (tokens, base_len, torch.tensor(1),
            *sampling_inputs(mode, torch.tensor(1.0), torch.tensor(0.5), torch.zeros(table)))
    return Uncaptured(SampleLast(prev.module), args)
