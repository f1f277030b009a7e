"""``amppass.export_onnx``: torch model -> ONNX (dynamo exporter, TorchScript fallback) -> mixed precision."""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

import onnx
import torch

from ..errors import CaptureError, InputError
from ..files import check_writable
from ..fx.capture import CAPTURE_LOCK, module_mode
from .convert import convert_onnx, save

log = logging.getLogger(__name__)


def export_onnx(
    torch_model: torch.nn.Module,
    example_inputs: Any,
    path: str | os.PathLike,
    dtype: str = "fp16",
    **convert_kwargs: Any,
) -> onnx.ModelProto:
    """Export ``torch_model`` to ONNX, convert it with :func:`convert_onnx` and save it atomically at ``path``.

    The model is exported in eval mode (its own training flags are restored afterwards). The dynamo
    exporter (``torch.onnx.export(dynamo=True)``) is tried first; if it fails, the TorchScript exporter
    (``dynamo=False``). ``convert_kwargs`` go to :func:`convert_onnx`. Returns the converted model.
    """
    if not isinstance(torch_model, torch.nn.Module):
        raise InputError(f"export_onnx takes a torch.nn.Module, got {type(torch_model).__name__}; for an ONNX "
                         "model already on disk use amppass.convert_onnx")
    check_writable(path)
    with CAPTURE_LOCK, module_mode(torch_model, train=False):  # an inference export: dropout off, BN running stats
        fp32 = export_fp32(torch_model, example_inputs)
    converted = convert_onnx(fp32, dtype, **convert_kwargs)
    save(converted, path)
    return converted


def export_fp32(torch_model: torch.nn.Module, example_inputs: Any, opset: int | None = None) -> onnx.ModelProto:
    """The float32 ONNX export of ``torch_model``: dynamo exporter first, TorchScript exporter second."""
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    errors = []
    with tempfile.TemporaryDirectory(prefix="amppass-export-") as folder:
        target = os.path.join(folder, "model.onnx")
        for dynamo in (True, False):
            try:
                kwargs = {"opset_version": opset} if opset is not None else {}
                torch.onnx.export(torch_model, args, target, dynamo=dynamo, verbose=False, **kwargs)
                return onnx.load(target)
            except Exception as err:  # either exporter can fail on any op; try the other one
                log.info("torch.onnx.export(dynamo=%s) failed: %s", dynamo, err)
                errors.append(f"dynamo={dynamo}: {type(err).__name__}: {str(err)[:300]}")
    raise CaptureError(f"{type(torch_model).__name__} could not be exported to ONNX by either exporter ("
                       + "; ".join(errors) + "); try amppass.convert for a torch.fx graph instead")
