"""The TensorRT lint: a graph breaking each rule is reported, a clean one is not, and the operator
table says which TensorRT it was read from. (Every graph specc exports is linted in test_onnx.py.)"""
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from specc.trt_lint import lint_model  # noqa: E402
from specc.trt_ops import OPSETS, SUPPORTED, TRT_VERSION, UNSUPPORTED  # noqa: E402

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def model(nodes, inputs, outputs, inits=(), opset=24, domains=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]
                             + [helper.make_opsetid(d, 1) for d in domains])


def vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def const(name, value):
    return numpy_helper.from_array(np.asarray(value), name)


def clean_step():
    """A miniature of a step graph: a block write of a 4-D cache, masked attention, greedy argmax."""
    nodes = [
        helper.make_node("Expand", ["start", "batch"], ["starts"]),
        helper.make_node("TensorScatter", ["past", "k", "starts"], ["present"], axis=-2),
        helper.make_node("Attention", ["q", "present", "present", "mask"], ["o"]),
        helper.make_node("ReduceSum", ["o", "axes"], ["s"], keepdims=0),
        helper.make_node("TopK", ["s", "k2"], ["vals", "idx"], sorted=1),
        helper.make_node("ArgMax", ["s"], ["best"], axis=-1),
    ]
    inputs = [vi("past", F, [1, 2, 16, 8]), vi("k", F, [1, 2, 3, 8]), vi("start", I64, [1]),
              vi("q", F, [1, 2, 3, 8]), vi("mask", TensorProto.BOOL, [1, 1, 3, 16])]
    outputs = [vi("present", F, [1, 2, 16, 8]), vi("best", I64, [1, 2, 1]), vi("vals", F, [1, 2, 2])]
    inits = [const("batch", np.array([1], np.int64)), const("axes", np.array([3], np.int64)),
             const("k2", np.array([2], np.int64))]
    return model(nodes, inputs, outputs, inits)


def test_the_table_names_its_source():
    assert TRT_VERSION == "10.15" and OPSETS == (9, 24)
    assert not set(SUPPORTED) & UNSUPPORTED
    assert {"Attention", "TensorScatter", "TopK", "ScatterND", "RMSNormalization"} <= set(SUPPORTED)
    assert {"SequenceConstruct", "Unique", "StringSplit"} <= UNSUPPORTED


def test_a_clean_graph_passes():
    m = clean_step()
    onnx.checker.check_model(m, full_check=True)
    assert lint_model(m) == []


def test_a_bad_graph_fails_every_rule():
    nodes = [
        helper.make_node("ScatterND", ["past", "rows", "upd"], ["s1"], reduction="add"),
        helper.make_node("TopK", ["x", "kbig"], ["tv", "ti"], sorted=0),
        helper.make_node("TopK", ["x", "kin"], ["tv2", "ti2"]),
        helper.make_node("CumSum", ["x", "axis_in"], ["cs"]),
        helper.make_node("RandomUniform", [], ["u"], shape=[4]),
        helper.make_node("SequenceConstruct", ["x"], ["seq"]),
        helper.make_node("Attention", ["q", "past", "past", "", "past", "past"], ["o"]),
        helper.make_node("TensorScatter", ["past3", "upd3", "start"], ["p3"], axis=1),
        helper.make_node("KvWrite", ["past"], ["kw"], domain="specc"),
        helper.make_node("Swish", ["x"], ["sw"]),
        helper.make_node("Cast", ["x"], ["xd"], to=TensorProto.DOUBLE),
        helper.make_node("Exp", ["xd"], ["ed"]),
    ]
    inputs = [vi("past", F, [1, 2, 16, 8]), vi("rows", I64, [3, 1]), vi("upd", F, [3, 2, 16, 8]),
              vi("x", F, [1, 4000]), vi("kin", I64, [1]), vi("axis_in", I64, []), vi("q", F, [1, 2, 3, 8]),
              vi("past3", F, [2, 16, 8]), vi("upd3", F, [2, 3, 8]), vi("start", I64, [1]),
              vi("dyn", F, ["n", 8])]
    outputs = [vi(n, F, None) for n in ("s1", "tv", "tv2", "cs", "u", "o", "p3", "kw", "sw", "ed")]
    m = model(nodes, inputs, outputs, [const("kbig", np.array([4000], np.int64))], opset=25, domains=["specc"])
    messages = "\n".join(str(f) for f in lint_model(m, "bad.onnx"))
    for words in ["opset 25 is outside", "reduction none only", "TopK must be sorted", "K = 4000",
                  "K is not a build-time constant", "CumSum's axes are not a build-time constant",
                  "random numbers in the graph", "does not parse SequenceConstruct", "Attention with past_key",
                  "Attention with past_value", "TensorScatter on a 3-D tensor", "TensorScatter at axis 1",
                  "custom domain 'specc'", "Swish is not in TensorRT 10.15's operator table",
                  "input dyn has no static shape", "note: bad.onnx: Exp", "is DOUBLE"]:
        assert words in messages, f"{words!r} not reported:\n{messages}"
    assert all(str(f).startswith(("error: bad.onnx", "note: bad.onnx")) for f in lint_model(m, "bad.onnx"))


def test_types_are_checked():
    m = model([helper.make_node("MatMul", ["a", "b"], ["c"])], [vi("a", TensorProto.INT32, [2, 2]),
                                                                 vi("b", TensorProto.INT32, [2, 2])],
              [vi("c", TensorProto.INT32, [2, 2])])
    (f,) = lint_model(m)
    assert f.severity == "error" and "a is INT32; TensorRT runs MatMul on FP32, FP16, BF16" in f.message
