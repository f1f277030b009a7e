"""``amppass.export_onnx``: torch model -> ONNX (dynamo exporter, TorchScript fallback) -> mixed precision."""

from __future__ import annotations

import inspect
import logging
import os
import tempfile
from typing import Any

import onnx
import torch
from torch.export import Dim

from ..errors import CaptureError, InputError
from ..files import check_writable
from ..fx.capture import capturing, size_one_dynamic
from .convert import convert_onnx, save

log = logging.getLogger(__name__)


def export_onnx(
    torch_model: torch.nn.Module,
    example_inputs: Any,
    path: str | os.PathLike,
    dtype: str = "fp16",
    *,
    dynamic_shapes: Any = "auto",
    **convert_kwargs: Any,
) -> onnx.ModelProto:
    """Export ``torch_model`` to ONNX, convert it with :func:`convert_onnx` and save it atomically at ``path``.

    The model is exported in eval mode (its own training flags are restored afterwards) and without
    autograd. The dynamo exporter (``torch.onnx.export(dynamo=True)``) is tried first; if it fails, the
    TorchScript exporter (``dynamo=False``), with a warning. ``dynamic_shapes`` is what torch.export takes;
    by default (``"auto"``) the batch dimension of every input and the sequence dimension (dim 1 of integer
    rank-2 inputs and of rank-3 inputs) stay dynamic where the model allows it, a batch of 1 included;
    ``None`` fixes every dimension to the example's. ``convert_kwargs`` go to :func:`convert_onnx`. Returns the converted model.
    """
    if not isinstance(torch_model, torch.nn.Module):
        raise InputError(f"export_onnx takes a torch.nn.Module, got {type(torch_model).__name__}; for an ONNX "
                         "model already on disk use amppass.convert_onnx")
    check_writable(path)
    with capturing(torch_model, train=False):  # an inference export: dropout off, BN running stats
        fp32 = export_fp32(torch_model, example_inputs, dynamic_shapes=dynamic_shapes)
    converted = convert_onnx(fp32, dtype, **convert_kwargs)
    save(converted, path)
    return converted


def export_fp32(torch_model: torch.nn.Module, example_inputs: Any, opset: int | None = None,
                dynamic_shapes: Any = "auto") -> onnx.ModelProto:
    """The float32 ONNX export of ``torch_model``: dynamo exporter first, TorchScript exporter second.

    Exported under ``torch.no_grad()``: with autograd on, the dynamo exporter fails on some models (T5)
    that it exports without it. ``dynamic_shapes`` as in :func:`export_onnx`.
    """
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    names = _input_names(torch_model, args)
    shapes = _batch_and_sequence(names, args) if dynamic_shapes == "auto" else dynamic_shapes
    errors = []
    with tempfile.TemporaryDirectory(prefix="amppass-export-") as folder, torch.no_grad():
        target = os.path.join(folder, "model.onnx")
        kwargs = {"opset_version": opset} if opset is not None else {}
        for size_one in ((True, False) if shapes is not None else (False,)):
            try:
                with size_one_dynamic(size_one):
                    torch.onnx.export(torch_model, args, target, dynamo=True, verbose=False,
                                      dynamic_shapes=shapes, **kwargs)
                return onnx.load(target)
            except Exception as err:  # the exporter can fail on any op; tried again, then the other exporter
                log.info("torch.onnx.export(dynamo=True, size-1 dims dynamic: %s) failed: %s", size_one, err)
                errors.append(f"dynamo=True: {type(err).__name__}: {str(err)[:300]}")
        try:
            torch.onnx.export(torch_model, args, target, dynamo=False, verbose=False, input_names=names,
                              dynamic_axes=_axes(names, shapes), **kwargs)
        except Exception as err:  # both failed: reported together below
            log.info("torch.onnx.export(dynamo=False) failed: %s", err)
            errors.append(f"dynamo=False: {type(err).__name__}: {str(err)[:300]}")
        else:
            log.warning("%s: the dynamo ONNX exporter failed (%s); exported with the TorchScript exporter instead",
                        type(torch_model).__name__, errors[-1].split(": ", 1)[-1][:200])
            return onnx.load(target)
    raise CaptureError(f"{type(torch_model).__name__} could not be exported to ONNX by either exporter ("
                       + "; ".join(errors) + "); try amppass.convert for a torch.fx graph instead")


def _input_names(model: torch.nn.Module, args: tuple) -> list[str]:
    """forward()'s names for the positional example inputs (``input_<i>`` past them or for ``*args``)."""
    try:
        parameters = [p for p in inspect.signature(model.forward).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        parameters = []
    return [parameters[i].name if i < len(parameters) else f"input_{i}" for i in range(len(args))]


def _batch_and_sequence(names: list[str], args: tuple) -> dict[str, Any] | None:
    """Dim.AUTO on dim 0 of every tensor input, and on dim 1 of sequences: integer inputs of rank 2 (token
    ids, masks) and inputs of rank 3 (a rank-2 float input's dim 1 is its features)."""
    shapes: dict[str, Any] = {}
    for name, value in zip(names, args):
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            shapes[name] = None
            continue
        sequence = value.dim() == 3 or (value.dim() == 2 and not value.is_floating_point())
        shapes[name] = {0: Dim.AUTO, **({1: Dim.AUTO} if sequence else {})}
    return shapes if any(shapes.values()) else None


def _axes(names: list[str], shapes: Any) -> dict[str, dict[int, str]] | None:
    """The TorchScript exporter's dynamic_axes for the same dimensions."""
    if not isinstance(shapes, dict):
        return None
    return {name: {dim: f"{name}_{dim}" for dim in spec} for name, spec in shapes.items()
            if name in names and isinstance(spec, dict) and spec}
