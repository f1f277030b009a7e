"""The ONNX pipeline's options and stages (amppass.pipelines.convert_onnx): the options are one frozen value checked
where the conversion starts, and the stages give what ``convert_onnx`` gives."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto

import amppass
from amppass.pipelines.convert_onnx import BF16_OPSET, OnnxPlanOptions, convert_onnx_streamed, upgrades_for_bf16
from amppass.targets import onnx_target, onnxruntime_facts
from tests.helpers.small_models import matmul_model


def test_options_are_checked_where_the_conversion_starts(tmp_path):
    missing = str(tmp_path / "missing.onnx")
    with pytest.raises(amppass.InputError, match=r"keep_fp32: '\(' is not a valid regular expression"):
        amppass.convert_onnx(missing, keep_fp32=["("])  # refused before the (missing) file is read
    with pytest.raises(amppass.InputError, match=r"pass calibration=\[\{input name: array, \.\.\.\}, \.\.\.\] as well"):
        amppass.convert_onnx(missing, tolerance=1e-3)
    with pytest.raises(amppass.InputError, match="keep_io_types=0 must be True or False"):
        amppass.convert_onnx(matmul_model(), keep_io_types=0)


def test_the_options_travel_as_one_frozen_value():
    options = OnnxPlanOptions(keep_fp32="Softmax", force_low=iter(["mm"]))
    assert options.keep_fp32 == ("Softmax",) and options.force_low == ("mm",)  # one string is one pattern
    with pytest.raises(AttributeError):
        options.keep_io_types = False  # type: ignore[misc]
    assert type(options.replace(progress=True)) is OnnxPlanOptions


def test_the_stages_give_what_convert_onnx_gives():
    model = matmul_model()
    converted = convert_onnx_streamed(model, onnx_target("cpu", "fp16"), OnnxPlanOptions(keep_fp32=["mm2"]))
    direct = amppass.convert_onnx(model, "fp16", keep_fp32=["mm2"])
    assert converted.materialized().SerializeToString() == direct.SerializeToString()
    onnx.checker.check_model(direct, full_check=True)
    precisions = {row.name: row.precision for row in amppass.report(direct).rows}
    assert precisions["mm"] == "fp16" and precisions["mm2"] == "fp32"


def test_a_bf16_plan_for_a_gpu_is_made_at_the_bf16_opset_where_the_runtime_loads_it():
    loads = onnxruntime_facts.max_opset() >= BF16_OPSET
    assert upgrades_for_bf16(TensorProto.BFLOAT16, "cuda", 17) is loads
    assert not upgrades_for_bf16(TensorProto.BFLOAT16, "cpu", 17)  # the CPU provider gains no bf16 kernel there
    assert not upgrades_for_bf16(TensorProto.BFLOAT16, "cuda", 12)  # below opset 13 bf16 has no Cast: refused
    assert not upgrades_for_bf16(TensorProto.FLOAT16, "cuda", 17)
    assert not upgrades_for_bf16(TensorProto.BFLOAT16, "cuda", BF16_OPSET)
