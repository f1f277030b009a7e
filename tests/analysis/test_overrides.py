"""keep_fp32 / force_low patterns that match nothing: an op the model lacks warns, a node pattern fails."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import amppass
from amppass.analysis.overrides import names_an_op
from models import build

LOGGER = "amppass.analysis.overrides"


def _matmul_gelu() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"), helper.make_node("Gelu", ["m"], ["y"], name="act")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 9
    return model


@pytest.mark.parametrize("pattern, is_op", [
    ("softmax", True), ("Softmax", True), ("aten.softmax", True), ("LayerNormalization", True),
    ("scaled_dot_product_attention", True), ("linear_99", False), ("encoder_.*", False), ("/enc/MatMul", False),
    ("name", False),  # an attribute of torch.ops.aten, not an op
])
def test_what_counts_as_an_op_name(pattern, is_op):
    assert names_an_op(pattern) is is_op


def test_readme_keep_fp32_example_on_the_bundled_bert_warns_with_its_ops(caplog):
    """The bundled BERT runs attention as one fused op: keep_fp32=['softmax'] has nothing to keep."""
    case = build("bert", "small")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        fast = amppass.convert(
            case.model, case.example_inputs, dtype="bf16", keep_fp32=["softmax"], plan_for="coverage"
        )
    (warning,) = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert "keep_fp32=['softmax']" in warning and "no softmax op" in warning
    assert "aten.scaled_dot_product_attention" in warning and "aten.linear" in warning
    report = amppass.report(fast)
    assert not any(row.source == "override" for row in report.rows)
    assert any(row.op == "aten.linear" and row.precision == "bf16" for row in report.rows)


def test_onnx_op_the_model_lacks_warns_and_converts(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        converted = amppass.convert_onnx(_matmul_gelu(), "fp16", keep_fp32=["Softmax"],
                                         force_low=["LayerNormalization"])
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(messages) == 2 and all("its ops: Gelu, MatMul" in m for m in messages)
    assert "nothing is kept in fp32" in messages[0] and "nothing is forced to fp16" in messages[1]
    rows = {row.name: row.precision for row in amppass.report(converted).rows}
    assert rows == {"mm": "fp16", "act": "fp16"}


@pytest.mark.parametrize("pattern", ["linear_99", "encoder_.*"])
def test_fx_node_pattern_matching_nothing_is_an_error_that_lists_the_ops(pattern):
    case = build("mlp", "small")
    with pytest.raises(amppass.InputError) as error:
        amppass.convert(case.model, case.example_inputs, dtype="fp16", keep_fp32=[pattern], plan_for="coverage")
    message = str(error.value)
    assert f"{pattern!r} matches no node name" in message and "aten.linear" in message and "aten.gelu" in message
    assert "e.g. 'softmax'" not in message  # the old message suggested what the user had just passed


def test_onnx_node_pattern_matching_nothing_is_an_error():
    with pytest.raises(amppass.InputError, match=r"'/enc/.\*' matches no node name.*Gelu, MatMul.*such as 'mm'"):
        amppass.convert_onnx(_matmul_gelu(), "fp16", keep_fp32=["/enc/.*"])
