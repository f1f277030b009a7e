"""The fp16-storage simulation reads which nodes run low from the converted model's own types, so it judges
models no amppass metadata describes: hand-built mixed graphs and onnxconverter-common's output."""

from __future__ import annotations

import copy

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from amppass.onnx.simulate import low_types, runs_low, simulated
from tests.helpers.onnx_graphs import model_of, session, vinfo

F32, F16, BF16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16
RNG = np.random.default_rng(5)
W = (RNG.standard_normal((16, 16)) * 0.5).astype(np.float16)
C = np.full((16,), 0.1, np.float16)


def half(a: np.ndarray) -> np.ndarray:
    """``a`` stored in fp16 and read back."""
    return a.astype(np.float16).astype(np.float32)


def _mixed_model() -> onnx.ModelProto:
    """A mixed fp16/bf16/fp32 graph as another converter might write it, with no amppass metadata and a
    stale value_info entry that declares the low Relu output fp32."""
    nodes = [
        helper.make_node("Cast", ["x"], ["x16"], name="down", to=F16),
        helper.make_node("MatMul", ["x16", "W16"], ["m"], name="mm"),
        helper.make_node("Relu", ["m"], ["r"], name="act"),
        helper.make_node("Constant", [], ["c"], name="const", value=numpy_helper.from_array(C, "c")),
        helper.make_node("Add", ["r", "c"], ["a"], name="add"),
        helper.make_node("Shape", ["a"], ["s"], name="shape"),  # reads low, writes int64
        helper.make_node("Cast", ["a"], ["a32"], name="up", to=F32),  # reads low, writes fp32 exactly
        helper.make_node("Softmax", ["a32"], ["p"], name="soft", axis=-1),
        helper.make_node("Cast", ["p"], ["pb"], name="to_bf16", to=BF16),
        helper.make_node("Cast", ["pb"], ["y"], name="from_bf16", to=F32),
    ]
    outputs = [vinfo("y", shape=(4, 16)), vinfo("s", TensorProto.INT64, (2,))]
    model = model_of(nodes, [vinfo("x", shape=(4, 16))], outputs, [numpy_helper.from_array(W, "W16")])
    model.graph.value_info.append(vinfo("r", F32, (4, 16)))  # stale: the Relu writes fp16
    return model


def test_generic_rule_classifies_a_hand_built_mixed_model():
    model = _mixed_model()
    before = model.SerializeToString()
    low = low_types(model)
    assert low == {"x16": F16, "W16": F16, "m": F16, "r": F16, "c": F16, "a": F16, "pb": BF16}
    assert {n.name for n in model.graph.node if runs_low(n, low)} == {"down", "mm", "act", "add", "to_bf16"}
    assert model.SerializeToString() == before, "classification only reads the model"

    x = {"x": (RNG.standard_normal((4, 16)) * 3).astype(np.float32)}
    sim = simulated(model)
    assert model.SerializeToString() == before, "simulation only reads the model"
    onnx.checker.check_model(sim, full_check=True)
    sim_low = low_types(sim)
    assert {n.op_type for n in sim.graph.node if runs_low(n, sim_low)} == {"Cast"}, "ops compute in fp32"
    got_y, got_s = session(sim).run(None, x)

    a = half(half(np.maximum(half(half(x["x"]) @ W.astype(np.float32)), 0)) + C.astype(np.float32))
    e = np.exp(a - a.max(-1, keepdims=True))
    p = e / e.sum(-1, keepdims=True)
    expected = p.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(got_s, [4, 16])
    # bf16 has 8 significant bits: an fp32 sum in another order may land on the neighbouring bf16 number
    assert np.allclose(got_y, expected, rtol=2 ** -7, atol=0)
    assert not np.allclose(got_y, p, rtol=2 ** -12, atol=0), "values really are rounded"


def test_low_graph_inputs_are_rounded_on_entry():
    model = model_of([helper.make_node("Relu", ["x"], ["r"], name="act"),
                      helper.make_node("Cast", ["r"], ["y"], name="up", to=F32)],
                     [vinfo("x", F16)], [vinfo("y")])
    sim = simulated(model)
    assert sim.graph.input[0].type.tensor_type.elem_type == F32
    x = np.linspace(-3, 3, 16, dtype=np.float32).reshape(2, 8) + np.float32(1e-4)
    (got,) = session(sim).run(None, {"x": x})
    assert np.array_equal(got, np.maximum(half(x), 0))


def test_onnxconverter_common_output_is_judged_by_its_own_types():
    float16 = pytest.importorskip("onnxconverter_common.float16")
    model = model_of([helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"),
                      helper.make_node("Tanh", ["h"], ["t"], name="act"),
                      helper.make_node("MatMul", ["t", "W2"], ["y"], name="mm2")],
                     [vinfo("x", shape=(4, 16))], [vinfo("y", shape=(4, 16))],
                     [numpy_helper.from_array(RNG.standard_normal((16, 16)).astype(np.float32), n)
                      for n in ("W1", "W2")])
    converted = float16.convert_float_to_float16(copy.deepcopy(model), keep_io_types=True)
    low = low_types(converted)
    assert {n.name for n in converted.graph.node if runs_low(n, low)} >= {"mm1", "act", "mm2"}
    w1, w2 = (half(numpy_helper.to_array(t)) for t in model.graph.initializer)
    x = {"x": (RNG.standard_normal((4, 16)) * 40).astype(np.float32)}
    (got,) = session(simulated(converted)).run(None, x)
    expected = half(half(np.tanh(half(half(x["x"]) @ w1))) @ w2)
    assert np.allclose(got, expected, rtol=2 ** -10, atol=0)
