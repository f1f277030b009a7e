"""MAC counts of heavy ONNX ops, checked against the arithmetic of each op."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from amppass.onnx.macs import node_macs, value_shapes


def _typed(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_matmul_gemm_conv_and_conv_transpose_counts():
    f = TensorProto.FLOAT
    w = numpy_helper.from_array(np.zeros((16, 3, 3, 3), np.float32), "w")  # 16 out, 3 in, 3x3
    wt = numpy_helper.from_array(np.zeros((16, 8, 2, 2), np.float32), "wt")  # 16 in, 8 out, 2x2
    g = numpy_helper.from_array(np.zeros((10, 64), np.float32), "g")
    model = _typed(
        [helper.make_node("MatMul", ["a", "b"], ["mm"]),
         helper.make_node("Gemm", ["g", "c"], ["gm"], transA=1),
         helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], name="conv"),
         helper.make_node("ConvTranspose", ["y", "wt"], ["z"], strides=[2, 2])],
        [helper.make_tensor_value_info("a", f, [4, 5, 6]), helper.make_tensor_value_info("b", f, [6, 7]),
         helper.make_tensor_value_info("c", f, [10, 3]), helper.make_tensor_value_info("x", f, [2, 3, 8, 8])],
        [helper.make_tensor_value_info(n, f, None) for n in ("mm", "gm", "z")], [w, wt, g])
    shapes = value_shapes(model, {v for n in model.graph.node for v in list(n.input) + list(n.output)})
    counts = {n.op_type: node_macs(n, shapes) for n in model.graph.node}
    assert counts == {
        "MatMul": 4 * 5 * 7 * 6,
        "Gemm": 64 * 3 * 10,  # A is (10, 64) read transposed: out (64, 3), K = 10
        "Conv": 2 * 16 * 8 * 8 * (3 * 3 * 3),
        "ConvTranspose": 2 * 16 * 8 * 8 * (8 * 2 * 2),
    }


def test_unknown_dimensions_and_light_ops_count_as_none():
    f = TensorProto.FLOAT
    model = _typed([helper.make_node("MatMul", ["a", "b"], ["mm"]), helper.make_node("Relu", ["mm"], ["r"])],
                   [helper.make_tensor_value_info("a", f, ["batch", 6]), helper.make_tensor_value_info("b", f, [6, 7])],
                   [helper.make_tensor_value_info("r", f, None)])
    shapes = value_shapes(model, {v for n in model.graph.node for v in list(n.input) + list(n.output)})
    assert [node_macs(n, shapes) for n in model.graph.node] == [None, None]


def test_converted_model_reports_macs_and_the_low_share():
    import amppass

    f = TensorProto.FLOAT
    w1 = numpy_helper.from_array(np.ones((8, 16), np.float32) / 8, "w1")
    w2 = numpy_helper.from_array(np.ones((16, 4), np.float32) / 16, "w2")
    model = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2")],
        "g", [helper.make_tensor_value_info("x", f, [2, 8])], [helper.make_tensor_value_info("y", f, [2, 4])],
        [w1, w2]), opset_imports=[helper.make_opsetid("", 17)])
    report = amppass.report(amppass.convert_onnx(model, "fp16", keep_fp32=["mm2"]))
    macs = {row.name: row.macs for row in report.rows}
    assert macs["mm1"] == 2 * 16 * 8 and macs["mm2"] == 2 * 4 * 16
    share = report.stats()["macs"]["low_share"]
    assert share == (2 * 16 * 8) / (2 * 16 * 8 + 2 * 4 * 16)



def test_a_heavy_op_without_a_formula_counts_as_unknown():
    f = TensorProto.FLOAT
    model = _typed([helper.make_node("Einsum", ["a", "b"], ["c"], equation="ij,jk->ik")],
                   [helper.make_tensor_value_info("a", f, [4, 5]), helper.make_tensor_value_info("b", f, [5, 6])],
                   [helper.make_tensor_value_info("c", f, None)])
    shapes = value_shapes(model, {"a", "b", "c"})
    assert shapes == {"a": [4, 5], "b": [5, 6], "c": [4, 6]}
    assert node_macs(model.graph.node[0], shapes) is None
