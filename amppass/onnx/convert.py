"""Deprecated, removed in amppass 0.2.0: ``amppass.onnx.convert.convert_onnx`` and ``amppass.onnx.convert.save`` are
:func:`amppass.convert_onnx` and :func:`amppass.save` (which takes an ``onnx.ModelProto``); reading them here warns."""

from ..deprecation import moved

__getattr__ = moved(__name__, "0.2.0", convert_onnx="amppass", save="amppass")
