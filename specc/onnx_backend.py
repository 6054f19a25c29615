"""The onnx backend: every graph of an engine as a functional ONNX graph, run by onnxruntime.

Lowering (compile): the finished program goes through the `functional_kv` pass (caches become
`past.<name>` inputs and `present.<name>` outputs, specc ops become standard operators, each cache
write one block), then torch.onnx (opset 24: Attention-23, TensorScatter-24). A graph that compacts
the accepted path's K/V is split in two: the main graph returns the compaction's source slots and
destination, and a tiny `.compact.onnx` graph gathers those rows and writes them as one block. (In
one graph the first write's result is an intermediate that onnxruntime and TensorRT would copy
whole; split, both writes are made in place.)

Weights: every initializer of 1 KiB or more goes to one shared file, `graphs/weights.data`, once
per distinct content (the graphs of an engine reference the same bytes, the transposes the exporter
folded included); `graphs/weights.index.json` lists what it holds. Small constants (tree tables,
shapes) stay in each graph.

Running (load): one onnxruntime session per graph file, all fed the same weight buffers (the data
file memory-mapped once, handed to every session as external initializers, so memory does not grow
with the number of graphs). IOBinding: each `present` is bound to its `past`'s memory, the engine's
cache tensor, which TensorScatter then updates in place; other outputs go to two preallocated sets
used alternately, so a call never writes the buffer its inputs (the previous call's outputs) live in
and nothing is allocated per call.
"""
from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .errors import SpeccError
from .pipeline import canonical_name, example_inputs

OPSET = 24  # TensorScatter-24; TensorRT 10.15's ONNX parser takes opsets 9-24
WEIGHTS, WEIGHTS_INDEX = "weights.data", "weights.index.json"
ALIGN = 4096  # each tensor's offset in the data file: page-aligned, so it can be memory-mapped
INLINE_BYTES = 1024


def require_onnx() -> None:
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as e:
        raise SpeccError(f"the onnx backend needs onnx, onnxscript and onnxruntime, and {e.name} is not installed; "
                         f"pip install 'specc[onnx]'.") from None


# ---------------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------------

def kv_write_translation(opset: int):
    """specc::kv_write in ONNX: TensorScatter-24 (one block at write_indices[batch]) from opset 24,
    ScatterND with reduction "none" (the rows' indices listed) below it."""
    if opset >= 24:
        from onnxscript.onnx_opset import opset24 as op

        def kv_write(cache, update, start, axis: int):
            # write_indices has one start per row of the leading (batch) axis: the same start for each
            starts = op.Expand(op.Reshape(start, op.Constant(value_ints=[1])), op.Shape(cache, start=0, end=1))
            return op.TensorScatter(cache, update, starts, axis=axis)
        return kv_write

    from onnxscript.onnx_opset import opset18 as op

    def kv_write_scatternd(cache, update, start, axis: int):
        # ScatterND indexes leading axes: the slots axis (-2 of [B, KV, S, D]) moved first, rows
        # start + i written, moved back.
        perm, back = [2, 0, 1, 3], [1, 2, 0, 3]
        rows = op.Shape(update, start=2, end=3)
        idx = op.Add(op.Range(op.Constant(value_int=0), op.Squeeze(rows), op.Constant(value_int=1)),
                     op.Reshape(start, op.Constant(value_ints=[1])))
        out = op.ScatterND(op.Transpose(cache, perm=perm), op.Unsqueeze(idx, op.Constant(value_ints=[1])),
                           op.Transpose(update, perm=perm), reduction="none")
        return op.Transpose(out, perm=back)
    return kv_write_scatternd


def sort_translation(self, stable: bool = False, dim: int = -1, descending: bool = False):
    """aten.sort (top-p's stable descending sort of the vocabulary) as TopK over the whole axis: ONNX's
    TopK puts equal values in index order, which is the stable sort. (TensorRT's TopK takes K < 3840:
    the lint reports top-p graphs of larger vocabularies.)"""
    from onnxscript.onnx_opset import opset24 as op

    k = op.Shape(self, start=dim, end=dim + 1 if dim != -1 else None)
    return op.TopK(self, k, axis=dim, largest=1 if descending else 0, sorted=1)


def to_onnx(ep: torch.export.ExportedProgram, input_names: list[str], output_names: list[str], opset: int = OPSET):
    """torch.onnx over a functional program; returns the onnx_ir model (weights still in memory)."""
    import logging

    from specc.passes.functional_kv import kv_write

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # torchvision-not-installed chatter
    prog = torch.onnx.export(ep, (), None, dynamo=True, opset_version=opset, input_names=input_names,
                             output_names=output_names, verbose=False, optimize=False,
                             custom_translation_table={kv_write._opoverload: kv_write_translation(opset),
                                                       torch.ops.aten.sort.stable: sort_translation})
    simplify(prog.model)
    return prog.model


def simplify(model) -> None:
    """The exporter's own clean-up without its pattern rewrites, which took half of SmolLM2's export
    time: functions inlined, constants folded (shapes become constants, as TensorRT wants them),
    dead nodes dropped, constants lifted to initializers, duplicates and common subexpressions merged."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common
    import onnxscript.optimizer as opt

    common.InlinePass()(model)
    for _ in range(2):
        opt.fold_constants(model, should_fold=keeps_quantized_weights)
        common.RemoveUnusedNodesPass()(model)
    for p in (common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
              common.DeduplicateInitializersPass(), common.CommonSubexpressionEliminationPass(),
              common.OutputFixPass(), common.NameFixPass()):
        p(model)
    assert isinstance(model, ir.Model)


def keeps_quantized_weights(node) -> bool | None:
    """Constant folding's veto: the Cast of an int8 weight to the activations' dtype stays in the
    graph (`--quant int8`), so the engine stores and the runtime reads one byte per weight; folding
    it would store the float weight instead. None: the folder's own rule for everything else."""
    import onnx_ir as ir

    if node.op_type == "Cast" and node.inputs and node.inputs[0] is not None:
        if node.inputs[0].dtype in (ir.DataType.INT8, ir.DataType.UINT8):
            return False
    return None


class SharedWeights:
    """The engine's one weight file: each distinct tensor content stored once, page-aligned."""

    def __init__(self, graphs_dir: Path):
        self.dir = graphs_dir
        self.data, self.index_path = graphs_dir / WEIGHTS, graphs_dir / WEIGHTS_INDEX
        self.index = json.loads(self.index_path.read_text()) if self.index_path.is_file() else {}

    def add(self, name: str, raw: bytes) -> tuple[int, int]:
        digest = hashlib.sha256(raw).hexdigest()
        if digest not in self.index:
            with open(self.data, "ab") as f:
                end = f.seek(0, 2)
                offset = -(-end // ALIGN) * ALIGN
                f.write(b"\0" * (offset - end))
                f.write(raw)
            self.index[digest] = {"offset": offset, "length": len(raw), "first_name": name}
        e = self.index[digest]
        return e["offset"], e["length"]

    def save(self) -> None:
        self.index_path.write_text(json.dumps(self.index, indent=0))


def externalize(model, weights: SharedWeights, names: dict[str, str]) -> None:
    """Move the model's large initializers into the shared file; the exporter's parameter names become
    the engine's names (`names`: exporter name -> canonical), folded constants keep theirs."""
    import onnx_ir as ir

    for old, value in list(model.graph.initializers.items()):
        t = value.const_value
        if t is None or t.nbytes < INLINE_BYTES:
            continue
        new = names.get(old, old)
        if new != old:
            model.graph.initializers.pop(old)
            value.name = new
            model.graph.initializers[new] = value
        offset, length = weights.add(new, t.tobytes())
        value.const_value = ir.ExternalTensor(WEIGHTS, offset, length, t.dtype, shape=t.shape, name=new,
                                              base_dir=str(weights.dir))


def save_model(model, path: Path) -> None:
    import onnx_ir as ir

    ir.save(model, str(path))


def check_model(path: Path) -> None:
    """onnx.checker with full shape inference (the external weights are read from disk)."""
    import onnx

    onnx.checker.check_model(str(path), full_check=True)


def lower_onnx(ep: torch.export.ExportedProgram, state: dict[str, torch.Tensor], folder: Path, name: str,
               opset: int = OPSET) -> dict:
    """The program as `graphs/<name>.onnx` (and `graphs/<name>.compact.onnx` when it compacts K/V);
    returns the manifest fields."""
    from specc.passes.functional_kv import compaction_program, functional_kv

    require_onnx()
    graphs = folder / "graphs"
    graphs.mkdir(exist_ok=True)
    fp = functional_kv(ep)
    user_in = [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    n_out = fp.n_outputs
    extra = ["compact.src", "compact.dst"] if fp.compacted else []
    out_names = [f"out.{i}" for i in range(n_out)] + extra + [f"present.{c}" for c in fp.caches]
    in_names = [f"past.{c}" for c in fp.caches] + user_in
    model = to_onnx(fp.program, in_names, out_names, opset)
    param_names = {i: canonical_name(i.split("inner.", 1)[-1] if i.startswith("inner.") else i)
                   for i in model.graph.initializers}
    weights = SharedWeights(graphs)
    externalize(model, weights, {k: v for k, v in param_names.items() if v in state})
    rel = f"graphs/{name}.onnx"
    save_model(model, folder / rel)
    entry = {"file": rel, "caches": fp.caches, "outputs": n_out, "opset": opset, "compact": None,
             # what the program returns: a tuple, or one tensor (as its eager module does)
             "tuple": ep.call_spec.out_spec.type in (tuple, list)}
    if fp.compacted:
        cep = compaction_program(ep, fp.compacted)
        cmodel = to_onnx(cep, [f"past.{c}" for c in fp.compacted] + ["src", "dst"],
                         [f"present.{c}" for c in fp.compacted], opset)
        crel = f"graphs/{name}.compact.onnx"
        save_model(cmodel, folder / crel)
        entry["compact"] = {"file": crel, "caches": fp.compacted}
    weights.save()
    for rel_file in [rel] + ([entry["compact"]["file"]] if entry["compact"] else []):
        try:
            check_model(folder / rel_file)
        except Exception as e:  # a graph onnx rejects must not reach an engine
            raise SpeccError(f"the exported graph {rel_file} fails onnx.checker: {str(e).splitlines()[0]}") from None
    return entry


# ---------------------------------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------------------------------

_NP = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.int32: np.int32,
       torch.bool: np.bool_, torch.float64: np.float64}
_TORCH = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16, "tensor(int64)": torch.int64,
          "tensor(int32)": torch.int32, "tensor(bool)": torch.bool, "tensor(double)": torch.float64,
          "tensor(bfloat16)": torch.bfloat16}


@functools.lru_cache(maxsize=8)
def _weight_file(path: str, size: int, mtime: float) -> np.memmap:
    return np.memmap(path, dtype=np.uint8, mode="r")


def _initializer_values(model_path: Path) -> tuple[list[str], list]:
    """The model's external initializers as OrtValues over the engine's one memory-mapped data file."""
    import onnx
    import onnxruntime as ort
    from onnx.helper import tensor_dtype_to_np_dtype

    model = onnx.load(str(model_path), load_external_data=False)
    names, values = [], []
    for init in model.graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in init.external_data}
        data = model_path.parent / info["location"]
        st = data.stat()
        buf = _weight_file(str(data), st.st_size, st.st_mtime)
        off, length = int(info.get("offset", 0)), int(info["length"])
        if init.data_type == onnx.TensorProto.BFLOAT16:
            raw = np.asarray(buf[off:off + length]).view(np.uint16).reshape(tuple(init.dims))
            values.append(ort.OrtValue.ortvalue_from_numpy_with_onnx_type(raw, onnx.TensorProto.BFLOAT16))
        else:
            arr = np.asarray(buf[off:off + length]).view(tensor_dtype_to_np_dtype(init.data_type))
            values.append(ort.OrtValue.ortvalue_from_numpy(arr.reshape(tuple(init.dims))))
        names.append(init.name)
    return names, values


def _session(model_path: Path, device: str):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3  # TensorScatter's "copying past_cache" notice: fresh sessions warn once
    # as many threads as torch uses here (one process runs one graph at a time; more would oversubscribe)
    so.intra_op_num_threads = torch.get_num_threads()
    so.inter_op_num_threads = 1
    # no spinning after a run: the host and torch's graphs share these cores between calls
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    names, values = _initializer_values(model_path)
    if names:
        so.add_external_initializers(names, values)
    providers = ["CUDAExecutionProvider"] if torch.device(device).type == "cuda" else ["CPUExecutionProvider"]
    if providers[0] not in ort.get_available_providers():
        raise SpeccError(f"onnxruntime here has no {providers[0]}; install onnxruntime-gpu to run this engine on "
                         f"{device}.")
    sess = ort.InferenceSession(str(model_path), so, providers=providers)
    sess._specc_keepalive = values  # the session reads these buffers for its whole life
    return sess


class _Binder:
    """IOBinding helpers for torch tensors (CPU, or CUDA with onnxruntime-gpu)."""

    def __init__(self, session, device: str):
        self.session, self.io = session, session.io_binding()
        d = torch.device(device)
        self.dev, self.dev_id = ("cuda", d.index or 0) if d.type == "cuda" else ("cpu", 0)

    def bind_in(self, name: str, t: torch.Tensor) -> None:
        self.io.bind_input(name, self.dev, self.dev_id, _NP[t.dtype], tuple(t.shape), t.data_ptr())

    def bind_out(self, name: str, t: torch.Tensor) -> None:
        self.io.bind_output(name, self.dev, self.dev_id, _NP[t.dtype], tuple(t.shape), t.data_ptr())

    def run(self) -> None:
        self.session.run_with_iobinding(self.io)


def _outputs_like(session, names: list[str], device: str) -> list[torch.Tensor]:
    by_name = {o.name: o for o in session.get_outputs()}
    return [torch.empty(tuple(by_name[n].shape), dtype=_TORCH[by_name[n].type], device=device) for n in names]


class OnnxGraph:
    """One graph of an onnx engine: `graph(*inputs)` -> its outputs, the engine's caches updated in place."""

    def __init__(self, folder: Path, entry: dict, state: dict[str, torch.Tensor], device: str):
        require_onnx()
        missing = [c for c in entry["caches"] if c not in state]
        if missing:
            raise SpeccError(f"graph {entry['file']} needs cache {missing[0]!r}, which the engine does not have.")
        for c in entry["caches"]:
            if state[c].dtype == torch.bfloat16:
                raise SpeccError("the onnx backend runs float32 and float16 engines; compile with --dtype float32.")
        self.session = _session(folder / entry["file"], device)
        # The bindings hold raw addresses: keep the engine's cache tensors alive as long as this graph.
        self.caches = {c: state[c] for c in entry["caches"]}
        n_out = entry["outputs"]
        self.inputs = [i.name for i in self.session.get_inputs() if not i.name.startswith("past.")]
        outs = [o.name for o in self.session.get_outputs() if not o.name.startswith("present.")]
        self.n_out, self.tuple = n_out, entry["tuple"]
        self.compact = None
        # Two bindings with their own output buffers, used alternately; the caches are bound once, in place.
        self.sets = []
        for _ in range(2):
            b = _Binder(self.session, device)
            for c in entry["caches"]:
                b.bind_in(f"past.{c}", state[c])
                b.bind_out(f"present.{c}", state[c])
            bufs = _outputs_like(self.session, outs, device)
            for n, t in zip(outs, bufs):
                b.bind_out(n, t)
            self.sets.append((b, bufs))
        if entry["compact"] is not None:
            cs = _session(folder / entry["compact"]["file"], device)
            self.compact = []
            for _, bufs in self.sets:  # each compaction binding reads its main set's src / dst
                b = _Binder(cs, device)
                for c in entry["compact"]["caches"]:
                    b.bind_in(f"past.{c}", state[c])
                    b.bind_out(f"present.{c}", state[c])
                b.bind_in("src", bufs[n_out])
                b.bind_in("dst", bufs[n_out + 1])
                self.compact.append(b)
        self.turn = 0

    def __call__(self, *args):
        binder, bufs = self.sets[self.turn]
        args = [a.contiguous() for a in args]  # held until the call returns: ORT reads their memory
        for name, a in zip(self.inputs, args):
            binder.bind_in(name, a)
        binder.run()
        if self.compact is not None:
            self.compact[self.turn].run()
        self.turn ^= 1
        return tuple(bufs[:self.n_out]) if self.tuple else bufs[0]
