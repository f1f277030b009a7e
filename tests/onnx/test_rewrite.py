"""amppass.onnx.rewrite on hand-made plans: one Cast per (value, dtype) in the graph that defines the value, weights
converted in place or copied beside their fp32 original and clamped where fp16 cannot hold them, a model's Cast to
fp32 retargeted, pinned outputs produced low and cast back, each decision stored on its node; the result valid
and close to fp32 in onnxruntime."""

from __future__ import annotations

import json
import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from amppass.analysis.options import RewriteOptions
from amppass.analysis.plan import Category, Decision, Precision, PrecisionPlan, Source
from amppass.analysis.record import META_KEY
from amppass.dtypes import BF16, FP16, LowType
from amppass.onnx.io.weight_store import WeightStore
from amppass.onnx.rewrite import all_names, rewrite, unique_name
from amppass.onnx.view import all_nodes, build_view, clear_value_info, name_nodes, subgraphs
from amppass.targets import onnx_target
from tests.helpers.onnx_graphs import assert_close, meta, session

F, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
RNG = np.random.default_rng(0)


def _weight(name, *shape, scale=0.3):
    """The same values on every call for one name, so each model builder gives the same model every time."""
    values = np.random.default_rng(sum(map(ord, name))).standard_normal(shape) * scale
    return numpy_helper.from_array(values.astype(np.float32), name)


def _model(nodes, outputs, initializers, inputs=(("x", F, [2, 8]),)):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(name, F, [2, 8]) for name in outputs], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _mixed():
    """x feeds two low MatMuls and an fp32 one; W is read low and fp32, W2 low only; a low Cast to fp32 of the
    first product feeds a Relu; three outputs."""
    return _model([helper.make_node("MatMul", ["x", "W"], ["a"], name="mm1"),
                   helper.make_node("MatMul", ["x", "W2"], ["b"], name="mm2"),
                   helper.make_node("MatMul", ["x", "W"], ["z"], name="mmf"),
                   helper.make_node("Add", ["a", "b"], ["y"], name="add"),
                   helper.make_node("Cast", ["a"], ["c"], name="cast", to=F),
                   helper.make_node("Relu", ["c"], ["r"], name="relu")],
                  ["y", "z", "r"], [_weight("W", 8, 8), _weight("W2", 8, 8)])


def _rewritten(model, fp32=(), keep_io_types=True, low: LowType = FP16):
    """``model`` rewritten with every node low but ``fp32`` (KEEP nodes kept), as the ONNX pipeline calls the
    rewrite: on a skeleton of it, named and typed; returns the materialized model and the stats."""
    store = WeightStore()
    work = store.skeleton(model)
    name_nodes(work)
    work = onnx.shape_inference.infer_shapes(work)
    view, refs, types = build_view(work, onnx_target("cpu", low), store.absmax, store.array)
    plan = PrecisionPlan()
    for node in view.nodes:
        precision = Precision.KEEP if node.category is Category.KEEP else (
            Precision.FP32 if node.name in fp32 else Precision.LOW)
        plan[node.name] = Decision(precision, f"planned {precision.value} by the test", Source.OVERRIDE,
                                   {"macs": 128}, rule="force-low")
    stats = rewrite(work, plan, refs, types, set(view.weights), store, low,
                    RewriteOptions(keep_io_types=keep_io_types))
    clear_value_info(work.graph)
    store.materialize(work)
    return work, stats


def _check(converted):
    onnx.checker.check_model(onnx.shape_inference.infer_shapes(converted), full_check=True)


def _producer(model, value):
    return next(n for n in all_nodes(model.graph) if value in n.output)


def _initializers(model):
    return {t.name: t for t in model.graph.initializer}


def test_one_cast_per_value_and_dtype_shared_by_its_readers():
    converted, stats = _rewritten(_mixed(), fp32={"mmf"})
    _check(converted)
    nodes = {n.name: n for n in converted.graph.node}
    assert list(nodes["mm1"].input) == ["x__to_fp16", "W__fp16"] and list(nodes["mm2"].input) == ["x__to_fp16", "W2"]
    assert list(nodes["mmf"].input) == ["x", "W"]  # fp32 reads the originals: no cast where both agree
    casts = [n for n in converted.graph.node if n.op_type == "Cast" and meta(n).get("cast")]
    assert [(list(c.input), list(c.output)) for c in casts] == [
        (["x"], ["x__to_fp16"]), (["y__fp16"], ["y"]), (["r__fp16"], ["r"])]
    assert stats.casts == 3
    first_reader = [n.name for n in converted.graph.node].index("mm1")
    assert [n.name for n in converted.graph.node].index("x_to_fp16") < first_reader  # right before its first reader


def test_weights_read_low_only_are_converted_in_place_and_shared_ones_copied():
    original = _initializers(_mixed())
    converted, stats = _rewritten(_mixed(), fp32={"mmf"})
    weights = _initializers(converted)
    assert {name: t.data_type for name, t in weights.items()} == {"W": F, "W2": F16, "W__fp16": F16}
    assert (stats.weights_converted, stats.weight_copies, stats.clamped) == (1, 1, {})
    np.testing.assert_array_equal(numpy_helper.to_array(weights["W"]), numpy_helper.to_array(original["W"]))
    for name, source in (("W2", "W2"), ("W__fp16", "W")):
        np.testing.assert_array_equal(numpy_helper.to_array(weights[name]),
                                      numpy_helper.to_array(original[source]).astype(np.float16))


def test_a_models_cast_to_fp32_that_runs_low_is_retargeted():
    converted, _ = _rewritten(_mixed(), fp32={"mmf"})
    cast = next(n for n in converted.graph.node if n.name == "cast")
    assert helper.get_attribute_value(cast.attribute[0]) == F16 and list(cast.input) == ["a"]
    kept, _ = _rewritten(_mixed(), fp32={"mmf", "cast"})
    cast = next(n for n in kept.graph.node if n.name == "cast")
    assert helper.get_attribute_value(cast.attribute[0]) == F


def test_outputs_keep_fp32_under_their_names_with_keep_io_types():
    converted, _ = _rewritten(_mixed(), fp32={"mmf"})
    assert [(o.name, o.type.tensor_type.elem_type) for o in converted.graph.output] == [("y", F), ("z", F), ("r", F)]
    assert _producer(converted, "y").op_type == "Cast" and list(_producer(converted, "y").input) == ["y__fp16"]
    assert converted.graph.input[0].type.tensor_type.elem_type == F  # inputs are never changed


def test_outputs_become_low_without_keep_io_types():
    converted, stats = _rewritten(_mixed(), fp32={"mmf"}, keep_io_types=False)
    _check(converted)
    assert [(o.name, o.type.tensor_type.elem_type) for o in converted.graph.output] == [
        ("y", F16),
        ("z", F),
        ("r", F16),
    ]
    assert _producer(converted, "y").name == "add" and stats.casts == 1  # x only


def test_every_planned_node_and_added_cast_says_what_it_is():
    converted, _ = _rewritten(_mixed(), fp32={"mmf"})
    nodes = {n.name: n for n in converted.graph.node}
    assert meta(nodes["mm1"]) == {"precision": "low", "reason": "planned low by the test", "source": "override",
                                  "evidence": {"macs": 128}, "rule": "force-low", "op": "MatMul",
                                  "casts_in": ["x__to_fp16", "W__fp16"]}
    assert meta(nodes["mmf"])["precision"] == "fp32" and meta(nodes["mmf"])["casts_in"] == []
    assert meta(nodes["x_to_fp16"]) == {"cast": True, "of": "x", "to": "fp16"}
    assert all(len([p for p in n.metadata_props if p.key == META_KEY]) == 1 for n in converted.graph.node)
    json.loads(nodes["mm1"].metadata_props[0].value)


def test_the_rewritten_model_runs_close_to_fp32():
    model = _mixed()
    converted, _ = _rewritten(model, fp32={"mmf"})
    x = {"x": RNG.standard_normal((2, 8)).astype(np.float32)}
    want, got = session(model).run(None, x), session(converted).run(None, x)
    assert [g.dtype for g in got] == [np.float32] * 3
    np.testing.assert_array_equal(got[1], want[1])  # the fp32 MatMul reads the fp32 originals
    assert_close(want, got, 1e-2, "rewritten model")


def test_fp16_weights_beyond_its_range_are_clamped_and_listed(caplog):
    big = numpy_helper.from_array(np.array([[1e5, -7e4], [1.0, 2.0]], np.float32), "B")
    model = _model([helper.make_node("MatMul", ["x", "B"], ["y"], name="mm")], ["y"], [big],
                   inputs=(("x", F, [2, 2]),))
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 2
    with caplog.at_level(logging.WARNING, logger="amppass.onnx.rewrite"):
        converted, stats = _rewritten(model)
    assert stats.clamped == {"B": 2}
    assert "weight 'B': 2 values beyond fp16's range clamped to +-65504" in caplog.text
    np.testing.assert_array_equal(numpy_helper.to_array(_initializers(converted)["B"]),
                                  np.array([[65504, -65504], [1, 2]], np.float16))


def test_bf16_weights_hold_the_whole_range():
    big = numpy_helper.from_array(np.array([[1e5, 3.0], [1.0, 2.0]], np.float32), "B")
    model = _model([helper.make_node("MatMul", ["x", "B"], ["y"], name="mm")], ["y"], [big],
                   inputs=(("x", F, [2, 2]),))
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 2
    converted, stats = _rewritten(model, low=BF16)
    _check(converted)
    weight = _initializers(converted)["B"]
    assert weight.data_type == TensorProto.BFLOAT16 and stats.clamped == {}
    assert [n.op_type for n in converted.graph.node] == ["Cast", "MatMul", "Cast"]


def _branching():
    """o = x @ W; h = If(c, then: x @ W, else: Relu(x)); y = h + o: the bodies read x and W from outside."""
    then = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["t"], name="body_mm")], "then", [],
                             [helper.make_tensor_value_info("t", F, [2, 8])])
    otherwise = helper.make_graph([helper.make_node("Relu", ["x"], ["e"], name="body_relu")], "else", [],
                                  [helper.make_tensor_value_info("e", F, [2, 8])])
    return _model([helper.make_node("MatMul", ["x", "W"], ["o"], name="mm"),
                   helper.make_node("If", ["c"], ["h"], name="if", then_branch=then, else_branch=otherwise),
                   helper.make_node("Add", ["h", "o"], ["y"], name="add")],
                  ["y"], [_weight("W", 8, 8)], inputs=(("x", F, [2, 8]), ("c", TensorProto.BOOL, [])))


def test_bodies_share_the_outer_cast_and_return_fp32():
    converted, stats = _rewritten(_branching())
    _check(converted)
    main = [n.op_type for n in converted.graph.node]
    assert main.count("Cast") == 3  # x to fp16, the If's result to fp16 for the add, y back to fp32
    assert "x__to_fp16" in [v for n in converted.graph.node for v in n.output]
    bodies = {g.name: g for g in subgraphs(next(n for n in converted.graph.node if n.op_type == "If"))}
    for name, body in bodies.items():
        reader = body.node[0]
        assert reader.input[0] == "x__to_fp16", name  # the outer cast, not one of its own
        assert [n.op_type for n in body.node] == [reader.op_type, "Cast"], name  # produced low, cast back
        assert (
            body.output[0].type.tensor_type.elem_type == F and _producer(converted, body.output[0].name) is body.node[1]
        )
    assert _initializers(converted)["W"].data_type == F16 and stats.weights_converted == 1  # read low everywhere
    x = RNG.standard_normal((2, 8)).astype(np.float32)
    for c in (True, False):
        feeds = {"x": x, "c": np.array(c)}
        assert_close(session(_branching()).run(None, feeds), session(converted).run(None, feeds), 1e-2, f"c={c}")


def test_all_names_and_unique_name():
    model = _branching()
    names = all_names(model)
    assert {"x", "c", "W", "mm", "o", "if", "h", "body_mm", "t", "body_relu", "e", "add", "y"} <= names
    assert unique_name(names, "fresh") == "fresh" and "fresh" in names
    assert unique_name(names, "x") == "x_1" and unique_name(names, "x") == "x_2"


@pytest.mark.parametrize("fp32", [set(), {"mm1", "mm2", "mmf", "add", "cast", "relu"}], ids=["all-low", "all-fp32"])
def test_a_plan_with_nothing_to_change_adds_nothing(fp32):
    """All fp32: the model as it was (but the decisions stored); all low but the outputs: no cast between nodes."""
    converted, stats = _rewritten(_mixed(), fp32=fp32)
    _check(converted)
    if fp32:
        assert stats.casts == 0 and stats.weights_converted == stats.weight_copies == 0
        assert [n.name for n in converted.graph.node] == ["mm1", "mm2", "mmf", "add", "cast", "relu"]
    else:
        assert stats.weight_copies == 0 and stats.weights_converted == 2
        assert stats.casts == 1 + 3  # x in; y, z and r back to fp32
