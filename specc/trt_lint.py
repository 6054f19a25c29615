"""TensorRT compatibility lint for ONNX graphs, without TensorRT.

No machine of this project can install TensorRT, so its ONNX parser's rules are checked here, from
the operator table in specc/trt_ops.py (transcribed from onnx-tensorrt, version stated there) and
the restrictions that matter for a specc step graph (TensorRT 10.15's ONNX parser documentation):

* the default-domain opset lies in TensorRT's range; no custom domains (a specc op must have been
  translated to standard operators);
* every operator is in the table as supported, for the type of tensor it gets;
* ScatterND only with reduction "none"; TopK sorted, with a build-time constant K below 3840;
  CumSum's axis, Reduce*'s axes and (Un)Squeeze's axes build-time constants;
* Attention with 4-D Q / K / V / mask and none of past_key, past_value, nonpad_kv_seqlen, present_*,
  qk_matmul_output, softcap;
* TensorScatter on 4-D caches at axis -2 (the layout TensorRT's in-place KV-cache layer takes);
* no Random* (specc passes random numbers in as inputs: TensorRT ignores their seed), RotaryEmbedding
  position ids in int64, graph inputs of static shape (one static graph per step).

A finding is an error (TensorRT would refuse the graph or run it differently) or a note (it would
build, with a caveat: DOUBLE tensors are cast to float).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from .trt_ops import OPSETS, SUPPORTED, TOPK_MAX, TRT_VERSION, UNSUPPORTED

_TYPE_NAMES = {1: "FP32", 2: "UINT8", 3: "INT8", 6: "INT32", 7: "INT64", 9: "BOOL", 10: "FP16", 11: "FP64",
               16: "BF16", 8: "STRING"}
# ops whose listed types are those of what they make, not of their first input
_BY_OUTPUT = {"Constant", "ConstantOfShape", "Range", "Shape", "Size", "EyeLike"}
_CONST_AXES = {"CumSum": 1, "Squeeze": 1, "Unsqueeze": 1, **{op: 1 for op in SUPPORTED if op.startswith("Reduce")}}


PLAIN_SCATTER = "none"  # ScatterND's reduction attribute when it writes (TensorRT's only one)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass
class Finding:
    graph: str
    node: str
    op: str
    severity: str  # "error" or "note"
    message: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.graph}: {self.op} {self.node}: {self.message}"


def _types(model) -> dict[str, tuple[str, list]]:
    """name -> (type name, shape as dim values or None per dim) for every typed value of the graph."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    g = inferred.graph
    out = {}
    for v in list(g.input) + list(g.output) + list(g.value_info):
        t = v.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim] if t.HasField("shape") else None
        out[v.name] = (_TYPE_NAMES.get(t.elem_type, str(t.elem_type)), dims)
    for init in g.initializer:
        out[init.name] = (_TYPE_NAMES.get(init.data_type, str(init.data_type)), list(init.dims))
    return out


def _constants(graph, types) -> set[str]:
    """Values TensorRT knows when it builds: initializers, Constant outputs, shapes of static tensors,
    and whatever is computed from those alone."""
    const = {i.name for i in graph.initializer}
    for node in graph.node:
        ins = [i for i in node.input if i]
        if node.op_type == "Constant":
            const.update(node.output)
        elif node.op_type == "Shape" and ins and (dims := types.get(ins[0], (None, None))[1]) is not None \
                and all(d is not None for d in dims):
            const.update(node.output)
        elif ins and all(i in const for i in ins) and not node.op_type.startswith("Random"):
            const.update(node.output)
    return const


def _constant_value(graph, name: str):
    """The integer value of a constant made by an initializer or a Constant node, else None."""
    from onnx import numpy_helper

    for init in graph.initializer:
        if init.name == name and init.data_location != 1:
            return numpy_helper.to_array(init)
    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            for a in node.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
                if a.name in ("value_int", "value_ints"):
                    return a.i if a.name == "value_int" else list(a.ints)
    return None


def _attr(node, name, default=None):
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def lint_model(model, name: str = "graph") -> list[Finding]:
    """All findings for one ONNX model (a ModelProto; external weights need not be loaded)."""
    findings: list[Finding] = []

    def bad(node, msg, severity="error"):
        findings.append(Finding(name, node.name if node is not None else "-", node.op_type if node is not None else "-",
                                severity, msg))

    default = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    if not default or not OPSETS[0] <= default[0] <= OPSETS[1]:
        bad(None, f"opset {default[0] if default else 'none'} is outside TensorRT {TRT_VERSION}'s "
                  f"{OPSETS[0]}-{OPSETS[1]}")
    types = _types(model)
    g = model.graph
    const = _constants(g, types)
    for inp in g.input:
        dims = types.get(inp.name, (None, None))[1]
        if dims is None or any(d is None for d in dims):
            bad(None, f"input {inp.name} has no static shape; specc graphs are static")
    for node in g.node:
        op = node.op_type
        if node.domain not in ("", "ai.onnx"):
            bad(node, f"custom domain {node.domain!r}: TensorRT needs a plugin for it")
            continue
        if op in UNSUPPORTED:
            bad(node, f"TensorRT {TRT_VERSION} does not parse {op}")
            continue
        if op not in SUPPORTED:
            bad(node, f"{op} is not in TensorRT {TRT_VERSION}'s operator table")
            continue
        allowed = SUPPORTED[op][0].split()
        ref = node.output[0] if op in _BY_OUTPUT else next((i for i in node.input if i), node.output[0])
        ty = types.get(ref, (None, None))[0]
        if ty == "FP64":
            bad(node, f"{ref} is DOUBLE: TensorRT casts it to FP32", "note")
        elif ty is not None and ty not in allowed:
            bad(node, f"{ref} is {ty}; TensorRT runs {op} on {', '.join(allowed)}")
        if op.startswith("Random"):
            bad(node, "random numbers in the graph (TensorRT ignores the seed); pass them in as inputs")
        elif op == "ScatterND" and _text(_attr(node, "reduction", PLAIN_SCATTER)) != PLAIN_SCATTER:
            bad(node, "ScatterND with a reduction; TensorRT takes reduction none only")
        elif op == "TopK":
            if _attr(node, "sorted", 1) != 1:
                bad(node, "TopK must be sorted")
            k = node.input[1] if len(node.input) > 1 else None
            kval = _k_value(g, k) if k else None
            if k and k not in const:
                bad(node, "TopK's K is not a build-time constant")
            elif kval is not None and kval > TOPK_MAX:
                bad(node, f"TopK with K = {kval}; TensorRT takes K below {TOPK_MAX + 1}")
        elif op in _CONST_AXES:
            i = _CONST_AXES[op]
            if len(node.input) > i and node.input[i] and node.input[i] not in const:
                bad(node, f"{op}'s axes are not a build-time constant")
        elif op == "Attention":
            for i, what in ((4, "past_key"), (5, "past_value"), (6, "nonpad_kv_seqlen")):
                if len(node.input) > i and node.input[i]:
                    bad(node, f"Attention with {what}; TensorRT takes none")
            for i, what in ((1, "present_key"), (2, "present_value"), (3, "qk_matmul_output")):
                if len(node.output) > i and node.output[i]:
                    bad(node, f"Attention with {what}; TensorRT takes none")
            if _attr(node, "softcap", 0.0) or _attr(node, "qk_matmul_output_mode", 0):
                bad(node, "Attention with softcap or qk_matmul_output_mode; TensorRT takes neither")
            for i in range(min(4, len(node.input))):
                dims = types.get(node.input[i], (None, None))[1] if node.input[i] else []
                if dims is not None and node.input[i] and len(dims) != 4:
                    bad(node, f"Attention input {node.input[i]} is {len(dims)}-D; TensorRT takes 4-D Q, K, V, mask")
        elif op == "TensorScatter":
            for i in (0, 1):
                dims = types.get(node.input[i], (None, None))[1]
                if dims is not None and len(dims) != 4:
                    bad(node, f"TensorScatter on a {len(dims)}-D tensor ({node.input[i]}); TensorRT takes 4-D")
            if _attr(node, "axis", -2) != -2:
                bad(node, f"TensorScatter at axis {_attr(node, 'axis')}; TensorRT takes axis -2")
        elif op == "RotaryEmbedding" and len(node.input) > 3 and node.input[3]:
            if types.get(node.input[3], (None,))[0] != "INT64":
                bad(node, "RotaryEmbedding's position_ids must be INT64")
        elif op in ("If", "Loop", "Scan"):
            bad(node, f"{op} in a step graph: specc's graphs are straight-line (one static graph per step)")
    return findings


def _k_value(graph, name):
    v = _constant_value(graph, name)
    if v is not None:
        import numpy as np

        return int(np.asarray(v).reshape(-1)[0])
    return None


def lint_file(path: Path, name: str | None = None) -> list[Finding]:
    import onnx

    return lint_model(onnx.load(str(path), load_external_data=False), name or Path(path).name)


def graph_files(lowered: dict) -> list[str]:
    """The ONNX files of one graph (its lowered fields): the graph's, and its compaction graph's."""
    return [lowered["file"]] + ([lowered["compact"]["file"]] if lowered.get("compact") else [])


def engine_graph_files(manifest) -> list[str]:
    """The ONNX files of an onnx or tensorrt engine (its Manifest)."""
    return [f for g in manifest.graphs.values() for f in graph_files(g.lowered)]


def lint_engine(folder: Path, manifest) -> list[Finding]:
    """Every ONNX graph of an onnx or tensorrt engine."""
    out = []
    for f in engine_graph_files(manifest):
        out += lint_file(Path(folder) / f, f)
    return out


def findings_json(findings: list[Finding]) -> list[dict]:
    return [asdict(f) for f in findings]
