"""Graphs with little or nothing to convert: all fp16, integer-only, no float at all, and QDQ-quantized.
Each converts, passes the checker, runs in onnxruntime like the original, and its report says why."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import amppass
from tests.helpers.onnx_graphs import session

RNG = np.random.default_rng(3)


def _model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def fp16_model() -> tuple[onnx.ModelProto, dict]:
    w = numpy_helper.from_array((RNG.standard_normal((8, 8)) * 0.3).astype(np.float16), "W")
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Softmax", ["r"], ["y"], name="sm"),
    ]
    model = _model(nodes, [helper.make_tensor_value_info("x", T.FLOAT16, [2, 8])],
                   [helper.make_tensor_value_info("y", T.FLOAT16, [2, 8])], [w])
    return model, {"x": RNG.standard_normal((2, 8)).astype(np.float16)}


def int_model() -> tuple[onnx.ModelProto, dict]:
    table = numpy_helper.from_array(np.arange(40, dtype=np.int64).reshape(10, 4), "table")
    nodes = [helper.make_node("Add", ["a", "b"], ["i"], name="add"),
             helper.make_node("Gather", ["table", "i"], ["y"], name="gather")]
    model = _model(nodes, [helper.make_tensor_value_info(n, T.INT64, [3]) for n in "ab"],
                   [helper.make_tensor_value_info("y", T.INT64, [3, 4])], [table])
    return model, {"a": np.array([1, 2, 3]), "b": np.array([0, 4, 6])}


def bool_model() -> tuple[onnx.ModelProto, dict]:
    nodes = [helper.make_node("Equal", ["a", "b"], ["e"], name="eq"), helper.make_node("Not", ["e"], ["y"], name="not")]
    model = _model(nodes, [helper.make_tensor_value_info(n, T.INT32, [3]) for n in "ab"],
                   [helper.make_tensor_value_info("y", T.BOOL, [3])])
    return model, {"a": np.array([1, 2, 3], np.int32), "b": np.array([1, 0, 3], np.int32)}


def qdq_model(opset: int) -> tuple[onnx.ModelProto, dict]:
    """onnxruntime.quantization's QDQ format around a Conv, then a float MatMul the plan may run low."""
    scalar = lambda name, value, dtype: numpy_helper.from_array(np.array(value, dtype), name)  # noqa: E731
    inits = [scalar("x_s", 0.02, np.float32), scalar("x_zp", 0, np.int8), scalar("w_s", 0.01, np.float32),
             scalar("w_zp", 0, np.int8), scalar("c_s", 0.05, np.float32), scalar("c_zp", 0, np.int8),
             numpy_helper.from_array(RNG.integers(-127, 127, (4, 3, 3, 3)).astype(np.int8), "w_q"),
             numpy_helper.from_array((RNG.standard_normal(4) * 0.1).astype(np.float32), "bias"),
             numpy_helper.from_array((RNG.standard_normal((8, 8)) * 0.3).astype(np.float32), "M")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_s", "x_zp"], ["xq"], name="q_x"),
             helper.make_node("DequantizeLinear", ["xq", "x_s", "x_zp"], ["xd"], name="dq_x"),
             helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_zp"], ["wd"], name="dq_w"),
             helper.make_node("Conv", ["xd", "wd", "bias"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("QuantizeLinear", ["c", "c_s", "c_zp"], ["cq"], name="q_c"),
             helper.make_node("DequantizeLinear", ["cq", "c_s", "c_zp"], ["cd"], name="dq_c"),
             helper.make_node("MatMul", ["cd", "M"], ["y"], name="mm")]
    model = _model(nodes, [helper.make_tensor_value_info("x", T.FLOAT, [1, 3, 8, 8])],
                   [helper.make_tensor_value_info("y", T.FLOAT, [1, 4, 8, 8])], inits, opset)
    return model, {"x": RNG.standard_normal((1, 3, 8, 8)).astype(np.float32)}


def _converted(model: onnx.ModelProto, feeds: dict, dtype: str = "fp16") -> tuple[onnx.ModelProto, dict]:
    converted = amppass.convert_onnx(model, dtype)
    onnx.checker.check_model(converted, full_check=True)
    want, got = session(model).run(None, feeds), session(converted).run(None, feeds)
    for w, g in zip(want, got, strict=False):
        assert g.dtype == w.dtype and g.shape == w.shape
        g64, w64 = g.astype(np.float64), w.astype(np.float64)
        assert np.linalg.norm(g64 - w64) <= 1e-2 * max(np.linalg.norm(w64), 1e-12)
    return converted, {r.name: r for r in amppass.report(converted).rows}


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_fp16_model_keeps_its_types_and_says_nothing_was_fp32(dtype):
    model, feeds = fp16_model()
    converted, rows = _converted(model, feeds, dtype)
    assert converted.graph == model.graph or [n.op_type for n in converted.graph.node] == ["MatMul", "Relu", "Softmax"]
    assert converted.graph.output[0].type.tensor_type.elem_type == T.FLOAT16
    assert {r.precision for r in rows.values()} == {"-"}
    assert {r.reason for r in rows.values()} == {"no fp32 tensors in or out"}
    assert amppass.report(converted).info["casts"] == 0


@pytest.mark.parametrize("build", [int_model, bool_model])
def test_graphs_without_float_work_are_left_alone(build):
    model, feeds = build()
    converted, rows = _converted(model, feeds)
    assert [(n.op_type, list(n.input), list(n.output)) for n in converted.graph.node] == \
        [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node]
    assert all(r.precision == "-" and r.reason == "no fp32 tensors in or out" for r in rows.values())
    info = amppass.report(converted).info
    assert info["casts"] == 0 and info["weights_converted"] == 0


@pytest.mark.parametrize("opset", [17, 21])  # 21: DequantizeLinear's schema allows fp16 scales
def test_qdq_graph_keeps_its_quantized_section_and_converts_the_rest(opset):
    model, feeds = qdq_model(opset)
    converted, rows = _converted(model, feeds)
    by_name = {n.name: n for n in converted.graph.node}
    for name in ("q_x", "dq_x", "dq_w", "q_c", "dq_c"):
        assert rows[name].precision == "-" and rows[name].reason.startswith("quantization: its fp32 scales")
    assert list(by_name["conv"].input) == ["xd", "wd", "bias"], "no casts inside the QDQ section"
    assert rows["conv"].precision == "fp32" and rows["conv"].reason.startswith("quantized (QDQ) node")
    assert rows["mm"].precision == "fp16", "the float MatMul after the section still runs low"
    scales = {t.name: t.data_type for t in converted.graph.initializer if t.name.endswith("_s")}
    assert scales == {"x_s": T.FLOAT, "w_s": T.FLOAT, "c_s": T.FLOAT}
