"""CUDA graphs for the decode calls: each graph is captured once per engine, then replayed.

A decode call is hundreds of kernel launches; replaying a captured CUDA graph is one. A captured
graph reads its inputs from fixed buffers and writes its outputs to fixed tensors, so a call
copies its inputs into the buffers (on the device: they are almost always the last call's
outputs) and replays; the outputs it returns are the graph's own tensors, valid until the next
replay of the same graph, which is how the runtime uses them (it reads the report and copies the
rest into the next call's inputs before that replay).

Capture writes the KV caches at the example positions (base_len 0); that is harmless when it
happens before a generation's prefill, which rewrites the cache from position 0, and slots past
the committed length are never read. The runtime captures the mode's decode graphs when a
generation first needs them, before its prefill. AOTInductor packages are loaded with
`run_single_threaded=True` for this (their default runner is not capture-safe).

Only on CUDA; on other devices `capture` is never called (the runtime skips it, it does not
pretend). This module has not run on this project's machines (no GPU): the device check
(examples/gpu_check.sh) runs it with and without.
"""
from __future__ import annotations

import torch

from .errors import SpeccError

WARMUP_CALLS = 2  # before capture, on a side stream: lazy initialisation must not land in the graph


class CapturedCall:
    """`graph(*args)` captured for inputs shaped like `example_args`; call it like the graph."""

    def __init__(self, graph, example_args: tuple):
        self.inputs = [a.clone() for a in example_args]
        self.device = self.inputs[0].device  # capture and replay on the engine's GPU, whichever is current
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.no_grad():
                for _ in range(WARMUP_CALLS):
                    graph(*self.inputs)
            torch.cuda.current_stream().wait_stream(side)
            self.cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.cuda_graph), torch.no_grad():
                self.outputs = graph(*self.inputs)

    def __call__(self, *args):
        if len(args) != len(self.inputs):
            raise SpeccError(f"a captured graph takes {len(self.inputs)} inputs, not {len(args)}.")
        with torch.cuda.device(self.device):
            for i, (buf, a) in enumerate(zip(self.inputs, args)):
                if a.shape != buf.shape or a.dtype != buf.dtype:  # copy_ would broadcast or cast silently
                    raise SpeccError(f"captured graph input {i} has shape {tuple(a.shape)} {a.dtype}, expected "
                                     f"{tuple(buf.shape)} {buf.dtype}.")
                buf.copy_(a, non_blocking=True)  # device to device, in stream order before the replay
            self.cuda_graph.replay()
        return self.outputs


def capture(graph, example_args: tuple) -> CapturedCall:
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA graphs need a CUDA device")
    return CapturedCall(graph, example_args)
