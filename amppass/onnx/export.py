"""``amppass.export_onnx``: torch model -> ONNX (dynamo exporter, TorchScript fallback) -> mixed precision."""

from __future__ import annotations

import inspect
import logging
import os
import tempfile
from typing import Any

import numpy as np
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
    by default (``"auto"``) the batch dimension of every input, the sequence dimension (dim 1 of integer
    rank-2 inputs and of rank-3 inputs) and the spatial dimensions of channels-first images and volumes
    (dims 2 and up of rank-4 and rank-5 inputs) stay dynamic where the model allows it, a batch of 1 included;
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

        def exported(dynamo: bool, size_one: bool = False) -> onnx.ModelProto:
            """Export with ``shapes``; again without the spatial ones where the model does not take them."""
            for attempt in (shapes, _without_spatial(shapes)):
                if dynamo:
                    with size_one_dynamic(size_one):
                        torch.onnx.export(torch_model, args, target, dynamo=True, verbose=False,
                                          dynamic_shapes=attempt, **kwargs)
                else:
                    torch.onnx.export(torch_model, args, target, dynamo=False, verbose=False, input_names=names,
                                      dynamic_axes=_axes(names, attempt), **kwargs)
                if dynamic_shapes != "auto" or _runs_at_twice_the_size(target, args, attempt):
                    break
            return onnx.load(target)

        for size_one in ((True, False) if shapes is not None else (False,)):
            try:
                return exported(dynamo=True, size_one=size_one)
            except Exception as err:  # the exporter can fail on any op; tried again, then the other exporter
                log.info("torch.onnx.export(dynamo=True, size-1 dims dynamic: %s) failed: %s", size_one, err)
                errors.append(f"dynamo=True: {type(err).__name__}: {str(err)[:300]}")
        try:
            model = exported(dynamo=False)
        except Exception as err:  # both failed: reported together below
            log.info("torch.onnx.export(dynamo=False) failed: %s", err)
            errors.append(f"dynamo=False: {type(err).__name__}: {str(err)[:300]}")
        else:
            log.warning("%s: the dynamo ONNX exporter failed (%s); exported with the TorchScript exporter instead",
                        type(torch_model).__name__, errors[-1].split(": ", 1)[-1][:200])
            return model
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
    """Dim.AUTO on dim 0 of every tensor input, on dim 1 of sequences (integer inputs of rank 2: token ids,
    masks; inputs of rank 3: a rank-2 float input's dim 1 is its features), and on every dimension but the
    channels (dim 1) of inputs of rank 4 and more: channels-first images and volumes, whose spatial sizes a
    convolutional model takes at any size. The dynamo exporter keeps a Dim.AUTO dimension symbolic in the ONNX
    model even where the model fixes it (channels read by a convolution): naming channels would promise a
    size the model cannot take."""
    shapes: dict[str, Any] = {}
    for name, value in zip(names, args):
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            shapes[name] = None
            continue
        if value.dim() >= 4:
            dynamic = [0, *range(2, value.dim())]
        else:
            dynamic = [0, 1] if value.dim() == 3 or (value.dim() == 2 and not value.is_floating_point()) else [0]
        shapes[name] = {dim: Dim.AUTO for dim in dynamic}
    return shapes if any(shapes.values()) else None


def _spatial(shapes: Any) -> dict[str, list[int]]:
    """The spatial dimensions (2 and up of rank >= 4 inputs) ``shapes`` makes dynamic, by input name."""
    if not isinstance(shapes, dict):
        return {}
    return {name: [d for d in spec if d >= 2] for name, spec in shapes.items() if isinstance(spec, dict)
            and any(d >= 2 for d in spec)}


def _without_spatial(shapes: Any) -> Any:
    """``shapes`` with the spatial dimensions fixed."""
    spatial = _spatial(shapes)
    if not spatial:
        return shapes
    return {name: {d: v for d, v in spec.items() if d not in spatial.get(name, ())} if spec else spec
            for name, spec in shapes.items()}


def _runs_at_twice_the_size(path: str, args: tuple, shapes: Any) -> bool:
    """Whether the exported float32 model runs in onnxruntime with its dynamic spatial dimensions doubled
    (True when it has none). The dynamo exporter defers the model's own size checks to run time, so a net
    whose Linear reads a flattened feature map exports with free image sizes it cannot take; doubling keeps
    the divisibility an encoder-decoder needs."""
    spatial = _spatial(shapes)
    if not spatial:
        return True
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        feeds = {}
        for info, (name, value) in zip(session.get_inputs(), zip(shapes, args)):
            array = value.detach().cpu().numpy()
            if name in spatial:
                size = [n * 2 if d in spatial[name] else n for d, n in enumerate(array.shape)]
                array = np.resize(array, size)
            feeds[info.name] = array
        session.run(None, feeds)
    except Exception as err:  # noqa: BLE001 - onnxruntime's own types: the size is not one the model takes
        log.info("the exported model does not run at twice its example's spatial size (%s); those dimensions "
                 "are fixed", str(err).splitlines()[0] if str(err) else type(err).__name__)
        return False
    return True


def _axes(names: list[str], shapes: Any) -> dict[str, dict[int, str]] | None:
    """The TorchScript exporter's dynamic_axes for the same dimensions."""
    if not isinstance(shapes, dict):
        return None
    return {name: {dim: f"{name}_{dim}" for dim in spec} for name, spec in shapes.items()
            if name in names and isinstance(spec, dict) and spec}
