"""Reasons are true for the target the plan is made for (a CPU ONNX plan explained MatMul as "Tensor Core work",
which a CPU has none of). The policy tables say MATRIX_WORK once per row; :func:`amppass.analysis.policy.for_target`
names what does that work on each target."""

from __future__ import annotations

import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import amppass
from amppass.analysis.policy import MATRIX_WORK, for_target
from amppass.fx.view import policy as fx_policy
from amppass.onnx import policy as onnx_policy


def _onnx_model():
    import numpy as np

    w = numpy_helper.from_array(np.full((8, 8), 0.1, np.float32), "w")
    cw = numpy_helper.from_array(np.full((4, 2, 1, 1), 0.1, np.float32), "cw")
    f = TensorProto.FLOAT
    return helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
         helper.make_node("Conv", ["img", "cw"], ["z"], name="conv")], "g",
        [helper.make_tensor_value_info("x", f, [2, 8]), helper.make_tensor_value_info("img", f, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("y", f, [2, 8]), helper.make_tensor_value_info("z", f, [1, 4, 4, 4])],
        [w, cw]), opset_imports=[helper.make_opsetid("", 17)])


def _texts(report) -> str:
    """Everything a user reads of a report: summary, every reason, the HTML page."""
    return "\n".join([report.summary(), *(row.reason for row in report.rows), report.to_html()])


def test_a_cpu_onnx_plan_never_says_tensor_core():
    report = amppass.report(amppass.convert_onnx(_onnx_model(), "fp16"))
    rows = {row.name: row for row in report.rows}
    assert "CPU's fp16 matrix instructions" in rows["mm"].reason and "AMX" in rows["mm"].reason
    assert "Tensor Core" not in _texts(report) and MATRIX_WORK not in _texts(report)


@pytest.mark.parametrize("target, dtype", [("cuda", "fp16"), ("cuda", "bf16"), ("tensorrt", "fp16")])
def test_a_gpu_onnx_plan_says_tensor_core(target, dtype):
    report = amppass.report(amppass.convert_onnx(_onnx_model(), dtype, target=target))
    rows = {row.name: row for row in report.rows}
    assert rows["mm"].reason.startswith("matrix multiply: Tensor Core work")
    assert rows["conv"].reason.startswith("convolution: Tensor Core work")
    assert "CPU" not in rows["mm"].reason and MATRIX_WORK not in _texts(report)


def test_fx_plans_name_the_target_s_matrix_units():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    x = torch.randn(2, 16)
    cpu = amppass.report(amppass.convert(model, (x,), "bf16", target="cpu", plan_for="coverage"))
    assert "Tensor Core" not in _texts(cpu) and MATRIX_WORK not in _texts(cpu)
    assert any("CPU's bf16 matrix instructions" in row.reason for row in cpu.rows)
    cuda = amppass.report(amppass.convert(model, (x,), "bf16", target="cuda", plan_for="coverage"))
    assert any(row.reason.startswith("matrix multiply: Tensor Core work") for row in cuda.rows)
    assert MATRIX_WORK not in _texts(cuda)


def test_every_table_reason_reads_right_on_every_target():
    rows = [*fx_policy.POLICY, *fx_policy.TRAINING, *onnx_policy.POLICY, *onnx_policy.TRAINING]
    matrix = [row for row in rows if MATRIX_WORK in row.reason]
    assert len(matrix) >= 5  # matrix products and convolutions of both tables
    for row in rows:
        for target in ("cpu", "cuda", "tensorrt"):
            for low in ("fp16", "bf16"):
                text = for_target(row.reason, target, low)
                assert MATRIX_WORK not in text and "<" not in text
                assert ("Tensor Core" in text) == (target != "cpu" and row in matrix), (target, text)
