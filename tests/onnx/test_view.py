"""amppass.onnx.view: walking an ONNX model with its bodies (If/Loop), naming and typing its nodes, and the neutral
view it builds: which values are weights, what each node's category, reason and planned inputs are."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from amppass.analysis.plan import Category
from amppass.onnx.policy import CUSTOM_REASON
from amppass.onnx.view import (
    all_nodes,
    build_view,
    clear_value_info,
    constant_tensor,
    dims,
    name_nodes,
    opsets,
    replace_nodes,
    subgraphs,
    tensors,
    value_types,
    weight_tensor,
)
from amppass.targets import onnx_target

F, I64 = TensorProto.FLOAT, TensorProto.INT64
CPU = onnx_target("cpu", "fp16")


def _array(name, values, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(values, dtype), name)


def _branching() -> onnx.ModelProto:
    """y = If(c, then: Relu(x) + k (a Constant in the body), else: Neg(x)) then Sigmoid; unnamed and repeated
    node names."""
    then = helper.make_graph([helper.make_node("Relu", ["x"], ["t0"]),
                              helper.make_node("Constant", [], ["k"], value=_array("kv", [1.5])),
                              helper.make_node("Add", ["t0", "k"], ["t"], name="dup")],
                             "then", [], [helper.make_tensor_value_info("t", F, [2])])
    otherwise = helper.make_graph([helper.make_node("Neg", ["x"], ["e"], name="dup")], "else", [],
                                  [helper.make_tensor_value_info("e", F, [2])])
    nodes = [helper.make_node("If", ["c"], ["h"], name="if", then_branch=then, else_branch=otherwise),
             helper.make_node("Sigmoid", ["h"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [2]),
                                           helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", F, [2])], [_array("W", [[1.0]])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_subgraphs_tensors_and_all_nodes_reach_into_bodies():
    model = _branching()
    owner = model.graph.node[0]
    # in attribute order (helper.make_node sorts them by name: else_branch first)
    assert [g.name for g in subgraphs(owner)] == ["else", "then"] and list(subgraphs(model.graph.node[1])) == []
    assert [t.name for t in tensors(model.graph)] == ["W", "kv"]
    # bodies before the node that owns them, so painting sees captured values decided
    assert [n.op_type for n in all_nodes(model.graph)] == ["Neg", "Relu", "Constant", "Add", "If", "Sigmoid"]


def test_name_nodes_gives_every_node_a_unique_name_and_keeps_unique_ones():
    model = _branching()
    name_nodes(model)
    names = [n.name for n in all_nodes(model.graph)]
    assert names == ["dup", "Relu_amp1", "Constant_amp1", "dup_amp1", "if", "Sigmoid_amp1"]
    onnx.checker.check_model(model, full_check=True)
    name_nodes(model)
    assert [n.name for n in all_nodes(model.graph)] == names  # named already: unchanged


def test_value_types_cover_inputs_initializers_constants_and_bodies():
    model = onnx.shape_inference.infer_shapes(_branching())
    types = value_types(model)
    assert types["x"] == F and types["c"] == TensorProto.BOOL and types["W"] == F and types["k"] == F
    assert types["y"] == F and types["h"] == F and types["t0"] == F  # inferred, in the body too


def test_clear_value_info_clears_bodies_too():
    model = onnx.shape_inference.infer_shapes(_branching())
    then = next(g for g in subgraphs(model.graph.node[0]) if g.name == "then")
    assert len(model.graph.value_info) and len(then.value_info)
    clear_value_info(model.graph)
    assert not model.graph.value_info
    assert all(not body.value_info for body in subgraphs(model.graph.node[0]))


def test_replace_nodes_reorders_and_drops():
    model = _branching()
    first, second = model.graph.node
    replace_nodes(model.graph, [second, first])
    assert [n.op_type for n in model.graph.node] == ["Sigmoid", "If"]
    replace_nodes(model.graph, [model.graph.node[1]])
    assert [n.op_type for n in model.graph.node] == ["If"]
    assert [g.name for g in subgraphs(model.graph.node[0])] == ["else", "then"]  # copied whole


def test_constant_and_weight_tensors():
    floats, ints = _array("f", [1.0, 2.0]), _array("i", [1, 2], np.int64)
    constant = helper.make_node("Constant", [], ["a"], value=floats)
    assert constant_tensor(constant) is constant.attribute[0].t and weight_tensor(constant).name == "f"
    assert weight_tensor(helper.make_node("Constant", [], ["a"], value=ints)) is None  # not float32: no weight
    assert constant_tensor(helper.make_node("Constant", [], ["a"], value_float=1.0)) is None
    fill = helper.make_node("ConstantOfShape", ["shape"], ["z"], value=_array("v", [0.0]))
    assert weight_tensor(fill).name == "v"
    assert weight_tensor(helper.make_node("ConstantOfShape", ["shape"], ["z"])) is None  # fills float zeros: no tensor
    assert weight_tensor(helper.make_node("Constant", [], ["a"], value=floats, domain="my.custom")) is None
    assert weight_tensor(helper.make_node("Identity", ["a"], ["b"])) is None


def test_dims_and_opsets():
    info = helper.make_tensor_value_info("x", F, [2, "batch", None, 5])
    info.type.tensor_type.shape.dim[2].dim_value = -1  # as Paddle exports write a dynamic dimension
    assert dims(info) == [2, None, None, 5]
    model = helper.make_model(helper.make_graph([], "g", [], []), opset_imports=[
        helper.make_opsetid("ai.onnx", 17), helper.make_opsetid("com.microsoft", 1)])
    assert opsets(model) == {"": 17, "com.microsoft": 1}


def _mixed() -> onnx.ModelProto:
    """A model with one op of each kind the view tells apart."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["mm"], name="mm"),
        helper.make_node("Add", ["mm", "b"], ["add"], name="add"),
        helper.make_node("ReduceSum", ["add", "axes"], ["red"], name="red"),
        helper.make_node("Shape", ["add"], ["shp"], name="shp"),
        helper.make_node("Cast", ["add"], ["c64"], name="c64", to=I64),
        helper.make_node("Cast", ["c64"], ["cf"], name="cf", to=F),
        helper.make_node("Constant", [], ["k"], name="k", value=_array("kv", [2.0] * 8)),
        helper.make_node("Mul", ["cf", "k"], ["mul"], name="mul"),
        helper.make_node("Foo", ["mul"], ["foo"], name="foo", domain="my.custom"),
        helper.make_node("Resize", ["foo", "", "scales"], ["big"], name="resize", mode="nearest"),
    ]
    outputs = [helper.make_tensor_value_info(name, elem, None)
               for name, elem in (("red", F), ("shp", I64), ("mul", F), ("big", F))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [2, 8])], outputs,
                              [_array("W", np.full((8, 8), -3.0)), _array("b", np.ones(8)),
                               _array("axes", [1], np.int64), _array("scales", [1.0, 2.0])],
                              value_info=[helper.make_tensor_value_info("foo", F, [2, 8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my.custom", 1)])
    return onnx.shape_inference.infer_shapes(model)


def test_build_view_categories_reasons_and_planned_inputs():
    view, refs, types = build_view(_mixed(), CPU, lambda t: float(np.abs(numpy_helper.to_array(t)).max()))
    nodes = {n.name: n for n in view.nodes}
    assert list(nodes) == ["mm", "add", "red", "shp", "c64", "cf", "mul", "foo", "resize"]  # Constant: a weight
    assert view.weights == {"W": 3.0, "b": 1.0, "k": 2.0, "scales": 2.0}  # float32 only: axes is int64
    assert view.outputs == ["red", "mul", "big"]
    assert types["c64"] == I64 and types["shp"] == I64
    expected = {
        "mm": (Category.LOW, ["x", "W"], [0, 1]),
        "add": (Category.FOLLOW, ["mm", "b"], [0, 1]),
        "red": (Category.FP32, ["add"], [0]),  # axes is an int64 input: never planned
        "shp": (Category.KEEP, [], []),  # reads any float type as it is
        "c64": (Category.KEEP, [], []),
        "cf": (Category.KEEP, [], []),  # no float input: makes fp32 at run time
        "mul": (Category.FOLLOW, ["cf", "k"], [0, 1]),
        "foo": (Category.FP32, ["mul"], [0]),
        "resize": (Category.FP32, ["foo"], [0]),
    }
    for name, (category, inputs, planned) in expected.items():
        assert (nodes[name].category, nodes[name].inputs, refs[name].planned) == (category, inputs, planned), name
    assert refs["resize"].kept_fp32 == [2]  # its scales are fed as the model wrote them, never cast
    assert nodes["c64"].reason == "explicit cast to int64 in the model; kept"
    assert nodes["cf"].reason == "creates fp32 values at run time; kept as they are"
    assert nodes["red"].facts == frozenset({"reduction"}) and "reduction" in nodes["red"].reason
    assert nodes["foo"].op == "my.custom.Foo" and nodes["foo"].unknown
    assert nodes["foo"].reason == CUSTOM_REASON.format(op="Foo", domain="my.custom")
    assert refs["foo"].evidence["custom_op"] is True
    assert refs["mm"].node.op_type == "MatMul"


def test_build_view_without_absmax_and_with_a_value_reader():
    read = []
    view, _, _ = build_view(_mixed(), CPU, None, lambda t: read.append(t.name) or numpy_helper.to_array(t))
    assert view.weights == {"W": 0.0, "b": 0.0, "k": 0.0, "scales": 0.0}
    np.testing.assert_array_equal(view.weight_values("k"), np.full(8, 2.0, np.float32))
    assert read == ["kv"]  # the Constant node's tensor, read on demand


def test_an_output_shape_inference_cannot_type_is_kept_fp32():
    graph = helper.make_graph([helper.make_node("Foo", ["x"], ["f"], name="foo", domain="my.custom"),
                               helper.make_node("Relu", ["x"], ["r"], name="relu")], "g",
                              [helper.make_tensor_value_info("x", F, [2])],
                              [helper.make_tensor_value_info("r", F, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my.custom", 1)])
    view, refs, _ = build_view(onnx.shape_inference.infer_shapes(model), CPU, None)
    foo = view.nodes[0]
    assert foo.category is Category.FP32 and foo.reason == "onnx shape inference could not type its outputs; kept fp32"
    assert foo.outputs == [] and refs["foo"].planned == [0]


def test_an_initializer_listed_as_a_graph_input_is_not_a_weight():
    """An old IR version lists initializers among the inputs: a caller may feed them, so they are inputs."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", F, [2, 2]), helper.make_tensor_value_info("W", F, [2, 2])],
        [helper.make_tensor_value_info("y", F, [2, 2])],
        [_array("W", np.eye(2))],
    )
    view, _, _ = build_view(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), CPU, None)
    assert view.weights == {} and view.nodes[0].inputs == ["x", "W"]


def test_build_view_puts_body_nodes_before_their_owner_and_body_constants_among_weights():
    model = _branching()
    name_nodes(model)
    view, refs, _ = build_view(onnx.shape_inference.infer_shapes(model), CPU, lambda t: 7.0)
    assert [n.name for n in view.nodes] == ["dup", "Relu_amp1", "dup_amp1", "if", "Sigmoid_amp1"]
    assert view.weights == {"W": 7.0, "k": 7.0}
    owner = view.nodes[3]
    assert owner.category is Category.KEEP and owner.reason.startswith("control flow")
    assert refs["dup_amp1"].planned == [0, 1] and view.nodes[2].inputs == ["t0", "k"]


@pytest.mark.parametrize("training, category", [(False, Category.FOLLOW), (True, Category.FP32)])
def test_batch_normalisation_in_training_form_is_viewed_fp32(training, category):
    inputs = ["x", "s", "bias", "mean", "var"]
    outputs = ["y", "running_mean", "running_var"] if training else ["y"]
    node = helper.make_node(
        "BatchNormalization", inputs, outputs, name="bn", **({"training_mode": 1} if training else {})
    )
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", F, [2, 3, 4])],
                              [helper.make_tensor_value_info("y", F, [2, 3, 4])],
                              [_array(n, np.ones(3)) for n in inputs[1:]])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    view, _, _ = build_view(onnx.shape_inference.infer_shapes(model), CPU, None)
    assert view.nodes[0].category is category
