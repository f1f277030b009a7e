"""Defects the ONNX conformance suite found, each on the smallest model that shows it: an op that
reads a value the default plan runs in fp16 (the MatMul in front of it) must still give a valid model that
runs, and calibration must take every legal model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import amppass
from tests.conformance import onnx_backend_harness as suite
from tests.helpers.onnx_graphs import session

F32 = TensorProto.FLOAT
RNG = np.random.default_rng(0)


def _model(nodes, inputs, outputs, initializers=(), opset=18, ml=False):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("ai.onnx.ml", 5)] if ml else [])
    model = helper.make_model(graph, opset_imports=imports)
    model.ir_version = 10
    return model


def _weight(name, shape):
    return numpy_helper.from_array(RNG.standard_normal(shape).astype(np.float32), name)


def _valid_and_runs(model, feeds):
    onnx.checker.check_model(model, full_check=True)
    return session(model).run(None, feeds)


def test_sequence_map_reading_an_fp16_tensor_gives_a_valid_model():
    """MatMul -> SequenceMap: the body's formal inputs are declared float, so the extra tensor crosses into the
    body in fp32 (main: '[TypeInferenceError] Inferred elem type differs ... (10) vs (1)')."""
    body = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["c"], name="body_add")], "body",
        [helper.make_tensor_value_info("a", F32, [4]), helper.make_tensor_value_info("b", F32, [4])],
        [helper.make_tensor_value_info("c", F32, [4])])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("SequenceConstruct", ["p", "q"], ["seq"], name="construct"),
             helper.make_node("SequenceMap", ["seq", "h"], ["out"], name="map", body=body)]
    out_type = helper.make_tensor_sequence_value_info("out", F32, [4])
    model = _model(nodes, [helper.make_tensor_value_info(n, F32, [4]) for n in ("x", "p", "q")], [out_type],
                   [_weight("w", (4, 4))], opset=17)
    feeds = {n: RNG.standard_normal(4).astype(np.float32) for n in ("x", "p", "q")}
    converted = amppass.convert_onnx(model)
    got = _valid_and_runs(converted, feeds)[0]
    want = session(model).run(None, feeds)[0]
    for g, w in zip(got, want, strict=False):
        np.testing.assert_allclose(g, w, rtol=1e-2, atol=1e-2)
    rows = {r.name: r for r in amppass.report(converted).rows}
    assert rows["mm"].precision == "fp16" and "subgraph boundary in fp32" in rows["map"].reason


def test_a_kept_input_slot_reads_fp32_where_its_producer_runs_low():
    """Resize's scales are kept as the model wrote them (fp32); when the value comes from a node the plan runs
    low (here an Identity forced to fp16), Resize still reads it in fp32 (main: shape inference refuses the
    model: 'scales typestr: tensor(float), has unsupported type: tensor(float16)')."""
    nodes = [helper.make_node("Identity", ["s"], ["scales"], name="scales_id"),
             helper.make_node("Resize", ["x", "", "scales"], ["y"], name="resize", mode="nearest")]
    model = _model(nodes, [helper.make_tensor_value_info("x", F32, [1, 1, 2, 2]),
                           helper.make_tensor_value_info("s", F32, [4])],
                   [helper.make_tensor_value_info("y", F32, None)])
    feeds = {"x": RNG.standard_normal((1, 1, 2, 2)).astype(np.float32), "s": np.array([1, 1, 2, 2], np.float32)}
    converted = amppass.convert_onnx(model, force_low=["scales_id"])
    np.testing.assert_allclose(_valid_and_runs(converted, feeds)[0], session(model).run(None, feeds)[0], rtol=1e-3)
    resize = next(n for n in converted.graph.node if n.name == "resize")
    assert resize.input[2] != "scales", "the fp16 scales reach Resize through a Cast to fp32"


def test_bitcast_reads_the_width_the_model_wrote():
    """MatMul -> BitCast(to=int32): the bit pattern of a float32 (main: 'BitCast requires input and output types
    to have the same bit-width, but input type has 16 bits')."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("BitCast", ["h"], ["y"], name="bits", to=TensorProto.INT32)]
    model = _model(nodes, [helper.make_tensor_value_info("x", F32, [2, 4])],
                   [helper.make_tensor_value_info("y", TensorProto.INT32, [2, 4])], [_weight("w", (4, 4))], opset=26)
    feeds = {"x": RNG.standard_normal((2, 4)).astype(np.float32)}
    got = _valid_and_runs(amppass.convert_onnx(model), feeds)[0]
    assert got.dtype == np.int32 and got.shape == (2, 4)


def test_an_op_holding_float_tensor_attributes_keeps_fp32():
    """TreeEnsemble types its split values (a tensor attribute) like its input: fed fp16 it is an invalid
    model (main: "Attribute 'nodes_splits' must have same type as input")."""
    tree = helper.make_node(
        "TreeEnsemble", ["h"], ["y"], name="tree", domain="ai.onnx.ml", aggregate_function=1,
        leaf_targetids=[0, 0], leaf_weights=numpy_helper.from_array(np.array([1.0, 2.0], np.float32)),
        n_targets=1, nodes_falseleafs=[1], nodes_falsenodeids=[1], nodes_featureids=[0],
        nodes_modes=numpy_helper.from_array(np.array([0], np.uint8)),
        nodes_splits=numpy_helper.from_array(np.array([0.0], np.float32)), nodes_trueleafs=[1],
        nodes_truenodeids=[0], post_transform=0, tree_roots=[0])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), tree]
    model = _model(nodes, [helper.make_tensor_value_info("x", F32, [3, 2])],
                   [helper.make_tensor_value_info("y", F32, [3, 1])], [_weight("w", (2, 2))], ml=True)
    feeds = {"x": RNG.standard_normal((3, 2)).astype(np.float32)}
    converted = amppass.convert_onnx(model)
    np.testing.assert_allclose(_valid_and_runs(converted, feeds)[0], session(model).run(None, feeds)[0])
    row = {r.name: r for r in amppass.report(converted).rows}["tree"]
    assert row.precision == "fp32" and "nodes_splits" in row.reason


def test_forcing_affine_grid_low_says_what_the_user_risks():
    """AffineGrid stays fp32 by default; forced low it runs low and the report gives the policy's reason."""
    nodes = [helper.make_node("AffineGrid", ["theta", "size"], ["grid"], name="grid", align_corners=0)]
    model = _model(nodes, [helper.make_tensor_value_info("theta", F32, [1, 2, 3])],
                   [helper.make_tensor_value_info("grid", F32, None)],
                   [numpy_helper.from_array(np.array([1, 1, 4, 5], np.int64), "size")], opset=20)
    default = {r.name: r for r in amppass.report(amppass.convert_onnx(model)).rows}["grid"]
    assert default.precision == "fp32" and "sampling coordinates" in default.reason
    forced = {r.name: r for r in amppass.report(amppass.convert_onnx(model, force_low=["AffineGrid"])).rows}["grid"]
    assert forced.precision == "fp16"
    assert "over the policy's fp32" in forced.reason and "sampling coordinates" in forced.reason


def _with_unused_initializers(big: bool):
    """A MatMul model that also holds initializers no node reads (legal: the dynamo exporter leaves some)."""
    size = 64 if big else 2  # 64x64 float32 is over the weight store's 1 KiB: handed to onnxruntime as an array
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    unused = [_weight("val_7", (size, size)), _weight("val_8", (3,))]
    return _model(nodes, [helper.make_tensor_value_info("x", F32, ["n", 64])],
                  [helper.make_tensor_value_info("y", F32, ["n", 64])], [_weight("w", (64, 64)), *unused])


@pytest.mark.parametrize("big", [True, False])
def test_calibration_takes_a_model_with_unused_initializers(big):
    """main: '[ONNXRuntimeError] ... Failed to find existing initializer with name val_7'."""
    model = _with_unused_initializers(big)
    feeds = [{"x": RNG.standard_normal((2, 64)).astype(np.float32)} for _ in range(2)]
    converted = amppass.convert_onnx(model, calibration=feeds, tolerance=1e-2)
    got = _valid_and_runs(converted, feeds[0])[0]
    np.testing.assert_allclose(got, session(model).run(None, feeds[0])[0], rtol=1e-2, atol=1e-2)
    assert {t.name for t in converted.graph.initializer} >= {"val_7", "val_8"}, "the model keeps what it held"


# -- lean plans on the light nets: weights the planner did not see as weights ---------------------------------

LIGHT = Path(onnx.__file__).resolve().parent / "backend" / "test" / "data" / "light"


def _casts(model) -> int:
    return sum(1 for n in model.graph.node if n.op_type == "Cast")


def test_densenet121_from_the_light_suite_converts_lean_and_right():
    """main: 364 Casts for 176 fp16 nodes. Its weights are ConstantOfShape fills, its batch-norm statistics
    initializers listed as graph inputs (IR version 3), its per-channel scales Unsqueeze(weight): none of them
    counted as weights, so every batch norm mixed 'fp32 values' with its fp16 input and ran fp32."""
    model = onnx.load(LIGHT / "light_densenet121.onnx")
    feeds = dict(zip(suite.feed_names(model), suite.light_inputs(model), strict=False))
    expected = numpy_helper.to_array(onnx.load_tensor(str(LIGHT / "light_densenet121_output_0.pb")))
    converted = amppass.convert_onnx(model)
    got = _valid_and_runs(converted, feeds)[0]
    assert suite.error(got, expected) < suite.FP16_BOUND
    rows = amppass.report(converted).rows
    assert _casts(converted) <= 4, "the input's cast and the output's, and at most two more"
    assert sum(r.precision == "fp16" for r in rows) >= 900 and all(r.precision == "fp16" for r in rows
                                                                 if r.op in ("BatchNormalization", "Concat"))


def _conv_bn_block(scale_node: str):
    """Conv -> Mul(scale) -> Add(bias) -> Relu, the scale a weight reached through ``scale_node``."""
    w, s, b = _weight("w", (4, 3, 3, 3)), numpy_helper.from_array(np.full((4,), 0.5, np.float32), "s"), \
        numpy_helper.from_array(np.full((4, 1, 1), 0.1, np.float32), "b")
    axes = numpy_helper.from_array(np.array([1, 2], np.int64), "axes")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node(scale_node, ["s", "axes"], ["s3"], name="scale_shape"),
             helper.make_node("Mul", ["c", "s3"], ["m"], name="scale"),
             helper.make_node("Add", ["m", "b"], ["a"], name="bias"),
             helper.make_node("Relu", ["a"], ["y"], name="relu"),
             helper.make_node("Conv", ["y", "w2"], ["z"], name="conv2")]
    return _model(nodes, [helper.make_tensor_value_info("x", F32, [1, 3, 8, 8])],
                  [helper.make_tensor_value_info("z", F32, None)], [w, s, b, axes, _weight("w2", (2, 4, 1, 1))])


def test_a_weight_reshaped_for_broadcasting_is_a_weight():
    """Unsqueeze(scale) -> Mul: the per-channel scale runs fp16 with its Mul (main: the Mul ran fp32 between
    two fp16 convolutions, with a Cast on each side)."""
    model = _conv_bn_block("Unsqueeze")
    feeds = {"x": RNG.standard_normal((1, 3, 8, 8)).astype(np.float32)}
    converted = amppass.convert_onnx(model)
    np.testing.assert_allclose(_valid_and_runs(converted, feeds)[0], session(model).run(None, feeds)[0],
                               rtol=2e-2, atol=2e-2)
    precision = {r.name: r.precision for r in amppass.report(converted).rows}
    assert precision["scale"] == precision["scale_shape"] == precision["relu"] == "fp16"
    assert _casts(converted) == 2  # the input to fp16, the output back


def test_a_fill_beside_low_values_is_stored_low_and_one_beyond_its_range_is_not():
    """ConstantOfShape(value=0.5) is a weight with its values in the node; value=1e5 does not fit fp16."""
    def model(fill):
        shape = numpy_helper.from_array(np.array([1, 4, 6, 6], np.int64), "shape")
        nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
                 helper.make_node("ConstantOfShape", ["shape"], ["f"], name="fill",
                                  value=numpy_helper.from_array(np.array([fill], np.float32))),
                 helper.make_node("Add", ["c", "f"], ["a"], name="add"),
                 helper.make_node("Conv", ["a", "w2"], ["z"], name="conv2")]
        return _model(nodes, [helper.make_tensor_value_info("x", F32, [1, 3, 8, 8])],
                      [helper.make_tensor_value_info("z", F32, None)],
                      [_weight("w", (4, 3, 3, 3)), shape, _weight("w2", (2, 4, 1, 1))])

    feeds = {"x": RNG.standard_normal((1, 3, 8, 8)).astype(np.float32)}
    fits = model(0.5)
    converted = amppass.convert_onnx(fits)
    np.testing.assert_allclose(_valid_and_runs(converted, feeds)[0], session(fits).run(None, feeds)[0],
                               rtol=2e-2, atol=2e-2)
    assert {r.name: r.precision for r in amppass.report(converted).rows}["add"] == "fp16"
    assert _casts(converted) == 2
    too_big = amppass.convert_onnx(model(1e5))
    _valid_and_runs(too_big, feeds)
    assert {r.name: r.precision for r in amppass.report(too_big).rows}["add"] == "fp32"


def test_ir3_initializers_listed_as_inputs_are_weights_and_leave_the_inputs():
    """IR version 3 requires every initializer among the inputs, where it is a constant all the same; at the
    IR version amppass writes it would become an input the caller may override."""
    model = _conv_bn_block("Unsqueeze")
    constants = [t for t in model.graph.initializer if t.name in ("s", "b")]
    model.graph.input.extend(helper.make_tensor_value_info(t.name, F32, list(t.dims)) for t in constants)
    model.ir_version = 3
    model.opset_import[0].version = 9
    unsqueeze = next(n for n in model.graph.node if n.op_type == "Unsqueeze")  # opset 9: axes an attribute
    del unsqueeze.input[1:]
    unsqueeze.attribute.append(helper.make_attribute("axes", [1, 2]))
    feeds = {"x": RNG.standard_normal((1, 3, 8, 8)).astype(np.float32)}
    converted = amppass.convert_onnx(model)
    _valid_and_runs(converted, feeds)
    assert [i.name for i in converted.graph.input] == ["x"] and _casts(converted) == 2
    assert [i.name for i in model.graph.input] == ["x", "s", "b"], "the caller's model is not changed"
