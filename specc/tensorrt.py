"""The tensorrt backend: the onnx backend's graphs, built into TensorRT engines where they run.

A TensorRT engine is specific to the GPU and the TensorRT version that built it, so the portable
part of a tensorrt engine directory is its ONNX graphs (written by `specc compile --backend
tensorrt` anywhere: they are the onnx backend's, and must pass specc/trt_lint.py); the `.plan`
files are built on the machine that runs them, by `specc build DIR` (or by compile itself where
TensorRT and a GPU are present). The manifest says which: `tensorrt.built`.

Building: strongly typed networks (the dtype in the ONNX graph is the dtype TensorRT runs; no
fp16/bf16 builder flags), parsed from the ONNX file with its external weights. Running: each
`present.<cache>` output is bound to its `past.<cache>` input's address, the engine's cache tensor:
TensorScatter-24 parses to TensorRT's KV-cache update layer (10.15+), which writes the block in
place when the two share memory. Other outputs go to two preallocated sets used alternately, as in
the onnx runner. The compaction graph, where there is one, is its own engine, run after the step.

This module has NOT run on this project's machines: none can install TensorRT. Its test
(tests/test_tensorrt.py) runs wherever `tensorrt` imports on a CUDA machine and is skipped elsewhere.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from .errors import SpeccError

MIN_VERSION = (10, 15)  # TensorScatter-24 and the in-place KV-cache layer


def require_tensorrt() -> str:
    """TensorRT's version, or one sentence saying why it cannot build or run here."""
    try:
        import tensorrt as trt
    except ImportError:
        raise SpeccError("TensorRT is not installed here (pip install tensorrt on a CUDA machine); a tensorrt engine's "
                         "ONNX graphs are built into TensorRT engines on the GPU machine that runs them.") from None
    version = tuple(int(x) for x in trt.__version__.split(".")[:2])
    if version < MIN_VERSION:
        raise SpeccError(f"TensorRT {trt.__version__} is too old: specc's graphs need {'.'.join(map(str, MIN_VERSION))} "
                         f"or newer (TensorScatter-24, in-place KV-cache updates).")
    if not torch.cuda.is_available():
        raise SpeccError("TensorRT engines are built and run on a CUDA GPU, and this machine has none.")
    return trt.__version__


def _logger():
    import tensorrt as trt

    return trt.Logger(trt.Logger.WARNING)


def build_plan(onnx_path: Path, plan_path: Path) -> None:
    """Build one ONNX graph into a serialized TensorRT engine at plan_path (written whole or not at all)."""
    import tensorrt as trt

    logger = _logger()
    builder = trt.Builder(logger)
    flags = 0
    if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):  # TensorRT 11 is strongly typed only
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # reads the external weights beside the file
        first = parser.get_error(0).desc() if parser.num_errors else "no detail"
        raise SpeccError(f"TensorRT's ONNX parser rejects {onnx_path.name}: {first}")
    config = builder.create_builder_config()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise SpeccError(f"TensorRT could not build an engine from {onnx_path.name} (see its log above).")
    tmp = plan_path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(bytes(serialized))
    tmp.replace(plan_path)


def plan_files(entry: dict) -> list[tuple[str, str]]:
    """(onnx file, plan file) for one graph entry: the step graph, and its compaction graph if any."""
    pairs = [(entry["file"], entry["file"].removesuffix(".onnx") + ".plan")]
    if entry.get("compact"):
        f = entry["compact"]["file"]
        pairs.append((f, f.removesuffix(".onnx") + ".plan"))
    return pairs


def build_engines(folder: Path, graphs: dict, progress: bool = True) -> dict:
    """Build every graph's plan in `folder` (graphs: name -> the graph's lowered fields); returns the
    manifest's `tensorrt` field for them."""
    from tqdm import tqdm

    version = require_tensorrt()
    pairs = [p for g in graphs.values() for p in plan_files(g)]
    for onnx_file, plan in tqdm(pairs, desc="build (tensorrt)", unit="graph", disable=not progress):
        build_plan(folder / onnx_file, folder / plan)
    return {"built": True, "tensorrt_version": version, "gpu": torch.cuda.get_device_name(),
            "plans": [p for _, p in pairs]}


def unbuilt() -> dict:
    return {"built": False, "tensorrt_version": None, "gpu": None, "plans": []}


def check_built(manifest, folder: Path) -> None:
    """Refuse an engine (its Manifest) whose TensorRT engines were not built, or were built elsewhere."""
    info = manifest.tensorrt or unbuilt()
    if not info["built"]:
        raise SpeccError(f"this tensorrt engine has its ONNX graphs but no TensorRT engines yet; run `specc build "
                         f"{folder}` on the GPU machine that will run it.")
    version = require_tensorrt()
    if version != info["tensorrt_version"] or torch.cuda.get_device_name() != info["gpu"]:
        raise SpeccError(f"this engine's TensorRT engines were built by TensorRT {info['tensorrt_version']} for "
                         f"{info['gpu']}; this is TensorRT {version} on {torch.cuda.get_device_name()}: run "
                         f"`specc build {folder}` again here.")


class _Plan:
    """One deserialized engine and an execution context per binding set."""

    def __init__(self, path: Path):
        import tensorrt as trt

        self.trt = trt
        self.engine = trt.Runtime(_logger()).deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise SpeccError(f"TensorRT could not load {path.name}; run `specc build` again on this machine.")
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]

    def output_like(self, name: str, device: str) -> torch.Tensor:
        dtypes = {self.trt.float32: torch.float32, self.trt.float16: torch.float16, self.trt.bfloat16: torch.bfloat16,
                  self.trt.int32: torch.int32, self.trt.int64: torch.int64, self.trt.bool: torch.bool}
        shape = tuple(self.engine.get_tensor_shape(name))
        return torch.empty(shape, dtype=dtypes[self.engine.get_tensor_dtype(name)], device=device)


class TensorRTGraph:
    """One graph of a tensorrt engine: `graph(*inputs)` -> outputs, the engine's caches updated in place."""

    def __init__(self, folder: Path, entry: dict, state: dict[str, torch.Tensor], device: str):
        if torch.device(device).type != "cuda":
            raise SpeccError("TensorRT engines run on a CUDA GPU; load this engine with device='cuda'.")
        (onnx_file, plan), *compact = plan_files(entry)
        self.main = _Plan(folder / plan)
        self.caches = {c: state[c] for c in entry["caches"]}  # bound by address: keep them alive
        self.user_inputs = [n for n in self.main.inputs if not n.startswith("past.")]
        outs = [n for n in self.main.outputs if not n.startswith("present.")]
        self.n_out, self.tuple = entry["outputs"], entry["tuple"]
        self.sets = []
        for _ in range(2):
            ctx = self.main.engine.create_execution_context()
            for c, t in self.caches.items():
                ctx.set_tensor_address(f"past.{c}", t.data_ptr())
                ctx.set_tensor_address(f"present.{c}", t.data_ptr())  # in place: present aliases past
            bufs = [self.main.output_like(n, device) for n in outs]
            for n, t in zip(outs, bufs):
                ctx.set_tensor_address(n, t.data_ptr())
            self.sets.append((ctx, bufs))
        self.compact = None
        if compact:
            cplan = _Plan(folder / compact[0][1])
            self.compact = []
            for _, bufs in self.sets:  # reads its main set's src / dst
                ctx = cplan.engine.create_execution_context()
                for c in entry["compact"]["caches"]:
                    ctx.set_tensor_address(f"past.{c}", state[c].data_ptr())
                    ctx.set_tensor_address(f"present.{c}", state[c].data_ptr())
                ctx.set_tensor_address("src", bufs[self.n_out].data_ptr())
                ctx.set_tensor_address("dst", bufs[self.n_out + 1].data_ptr())
                self.compact.append(ctx)
            self._cplan = cplan
        self.turn = 0

    def __call__(self, *args):
        ctx, bufs = self.sets[self.turn]
        args = [a.contiguous() for a in args]  # held until the engine has read them (same stream)
        for name, a in zip(self.user_inputs, args):
            ctx.set_tensor_address(name, a.data_ptr())
        stream = torch.cuda.current_stream().cuda_stream
        if not ctx.execute_async_v3(stream):
            raise SpeccError("a TensorRT engine failed to run (see its log above).")
        if self.compact is not None:
            self.compact[self.turn].execute_async_v3(stream)
        self.turn ^= 1
        return tuple(bufs[:self.n_out]) if self.tuple else bufs[0]
