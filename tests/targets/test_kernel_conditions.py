"""Kernel conditions (amppass/targets/data/onnxruntime_cpu_conditions.json): attribute values for which
onnxruntime's CPU provider registers a low-precision kernel and refuses it at run time. Every entry is checked
against the installed onnxruntime, and the default plan keeps such a node fp32."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import amppass
from amppass.targets import onnx_target
from amppass.targets.onnx_kernel_tables import load_conditions
from tests.helpers.onnx_graphs import meta, session
from tests.helpers.paths import ROOT

DATA = ROOT / "amppass" / "targets" / "data" / "onnxruntime_cpu_conditions.json"
TYPES = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16, "float": TensorProto.FLOAT}
RNG = np.random.default_rng(0)


def _scatter(op: str, reduction: str, elem_type: int, opset: int):
    """fp32 data and updates cast to ``elem_type``, scattered with ``reduction``, cast back: one kernel runs
    in ``elem_type`` whatever numpy can feed."""
    indices = [[0], [2]] if op == "ScatterND" else [[0, 1], [2, 0]]
    updates = [2, 2] if op == "ScatterND" else [2, 2]
    nodes = [
        helper.make_node("Cast", ["data"], ["d"], to=elem_type),
        helper.make_node("Cast", ["updates"], ["u"], to=elem_type),
        helper.make_node(op, ["d", "idx", "u"], ["s"], reduction=reduction),
        helper.make_node("Cast", ["s"], ["y"], to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(nodes, "scatter", [
        helper.make_tensor_value_info("data", TensorProto.FLOAT, [3, 2]),
        helper.make_tensor_value_info("updates", TensorProto.FLOAT, updates)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])],
        [numpy_helper.from_array(np.array(indices, np.int64), "idx")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model, {"data": RNG.random((3, 2), np.float32), "updates": RNG.random(updates, np.float32)}


def _runs(model, feeds) -> bool:
    runner = session(model)  # the registry has the kernel: the model always loads
    try:
        runner.run(None, feeds)
    except Exception as err:  # noqa: BLE001 - onnxruntime's RUNTIME_EXCEPTION
        assert "not supported" in str(err), err
        return False
    return True


ENTRIES = [(c["op"], c["since"], value, name) for c in json.loads(DATA.read_text())["conditions"]
           for value in c["values"] for name in c["types"]]


@pytest.mark.parametrize("op, since, reduction, type_name", ENTRIES)
def test_every_condition_is_what_the_installed_onnxruntime_does(op, since, reduction, type_name):
    opset = max(since, 18)
    assert not _runs(*_scatter(op, reduction, TYPES[type_name], opset)), "the entry is stale: it runs now"
    assert _runs(*_scatter(op, reduction, TensorProto.FLOAT, opset)), "fp32 runs"
    assert _runs(*_scatter(op, "none", TYPES[type_name], opset)), "without the attribute the kernel runs"


def test_the_conditions_stop_where_the_kernels_run():
    """ScatterElements' fp16 max and min run on the CPU provider (only bf16 fails): no entry blocks them."""
    for reduction in ("max", "min"):
        assert _runs(*_scatter("ScatterElements", reduction, TensorProto.FLOAT16, 18))
    conditions = load_conditions("onnxruntime-cpu")
    assert not conditions.refusal("", "ScatterElements", 18, TensorProto.FLOAT16, (("reduction", "max"),))
    assert conditions.refusal("", "ScatterElements", 18, TensorProto.BFLOAT16, (("reduction", "max"),))
    assert not conditions.refusal("", "ScatterND", 18, TensorProto.FLOAT16, (("reduction", "none"),))
    assert not conditions.refusal("", "ScatterND", 15, TensorProto.FLOAT16, (("reduction", "add"),))
    assert onnx_target("cuda", "fp16").conditions.attributes("", "ScatterND") == frozenset()


def _matmul_scatter(reduction: str):
    """MatMul -> ScatterND(reduction) with updates from a MatMul too: the default plan runs both MatMuls fp16,
    and the scatter follows them where it can."""
    w = numpy_helper.from_array(RNG.standard_normal((8, 8)).astype(np.float32), "w")
    idx = numpy_helper.from_array(np.array([[0], [2], [0]], np.int64), "idx")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("MatMul", ["z", "w"], ["u"], name="mm_updates"),
             helper.make_node("ScatterND", ["h", "idx", "u"], ["y"], name="scatter", reduction=reduction)]
    graph = helper.make_graph(nodes, "g", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8]),
        helper.make_tensor_value_info("z", TensorProto.FLOAT, [3, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], [w, idx])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model, {"x": RNG.standard_normal((4, 8)).astype(np.float32),
                   "z": RNG.standard_normal((3, 8)).astype(np.float32)}


@pytest.mark.parametrize("reduction", ["add", "mul", "max", "min"])
def test_default_plan_keeps_a_reducing_scatter_fp32_where_the_cpu_refuses_fp16(reduction):
    model, feeds = _matmul_scatter(reduction)
    converted = amppass.convert_onnx(model)
    got = session(converted).run(None, feeds)[0]  # main: RUNTIME_EXCEPTION ... MLFloat16 ... ScatterND
    want = session(model).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
    rows = {r.name: r for r in amppass.report(converted).rows}
    assert rows["mm"].precision == "fp16"
    assert rows["scatter"].precision == "fp32"
    assert f"reduction={reduction!r}" in rows["scatter"].reason and "scatter_nd.cc" in rows["scatter"].reason


def test_a_plain_scatter_still_follows_its_fp16_input():
    model, feeds = _matmul_scatter("none")
    converted = amppass.convert_onnx(model)
    assert {r.name: r.precision for r in amppass.report(converted).rows}["scatter"] == "fp16"
    session(converted).run(None, feeds)


def test_force_low_on_a_refused_scatter_keeps_it_fp32_and_says_why(caplog):
    model, feeds = _matmul_scatter("add")
    with caplog.at_level(logging.WARNING):
        converted = amppass.convert_onnx(model, force_low=["ScatterND"])
    session(converted).run(None, feeds)
    node = next(n for n in converted.graph.node if n.name == "scatter")
    assert meta(node)["precision"] == "fp32" and "user asked for fp16" in meta(node)["reason"]
    assert "reduction='add'" in caplog.text
