"""Kept so ``amppass.onnx.convert.save`` still imports: the ONNX conversion pipeline lives in
:mod:`amppass.pipelines.convert_onnx`."""

from ..pipelines.convert_onnx import convert_onnx, save  # noqa: F401
