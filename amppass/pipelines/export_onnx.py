"""``amppass.export_onnx``: torch model -> ONNX (dynamo exporter, TorchScript fallback) -> mixed precision."""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import tempfile
from typing import Any, Callable, Mapping

import numpy as np
import onnx
import torch
from torch.export import Dim
from torch.utils import _pytree as pytree

from ..errors import CaptureError, InputError, first_line
from ..files import check_writable
from ..fx.capture.export import capturing, size_one_dynamic
from ..fx.capture.quiet import quiet_torch
from .convert_onnx import convert_onnx, note, save
from .onnx_ops import translations

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

    The model is exported in eval mode (its own training flags are restored afterwards), without autograd,
    and with torch's exporter quiet (its log lines and warnings; ``AMPPASS_DEBUG=1`` shows them, see
    :mod:`amppass.fx.capture.quiet`). The dynamo exporter (``torch.onnx.export(dynamo=True)``) is tried first; if it fails, the
    TorchScript exporter (``dynamo=False``), with a warning. ``dynamic_shapes`` is what torch.export takes;
    by default (``"auto"``) the batch dimension of every input, the sequence dimension (dim 1 of integer
    rank-2 inputs and of rank-3 inputs) and the spatial dimensions of channels-first images and volumes
    (dims 2 and up of rank-4 and rank-5 inputs) stay dynamic where the model allows it, a batch of 1 included;
    ``None`` fixes every dimension to the example's. ``convert_kwargs`` go to :func:`convert_onnx`. Returns the converted model.
    """
    if not isinstance(torch_model, torch.nn.Module):
        raise InputError(f"export_onnx takes a torch.nn.Module, got {type(torch_model).__name__}; for an ONNX "
                         "model already on disk use amppass.convert_onnx")
    _refuse_converted(torch_model)
    check_writable(path)
    with capturing(torch_model, train=False):  # an inference export: dropout off, BN running stats
        fp32 = export_fp32(torch_model, example_inputs, dynamic_shapes=dynamic_shapes)
        _say_if_the_export_differs(fp32, torch_model, example_inputs)
    fixed = [entry.value for entry in fp32.metadata_props if entry.key == FIXED_KEY]
    del fp32.metadata_props[:]  # the summary convert_onnx stores is the file's only metadata of amppass's
    converted = convert_onnx(fp32, dtype, **convert_kwargs)
    if fixed:
        note(converted, "fixed_dims", json.loads(fixed[0]))  # the report says which sizes the file takes
    save(converted, path)
    return converted


FIXED_KEY = "amppass_fixed_dims"  # metadata_props entry: the dimensions the export fixed at the example's size
EXPORT_TOLERANCE = 1e-4  # relative L2: a float32 export differs from torch by its kernels' rounding, far below this


def _say_if_the_export_differs(fp32: onnx.ModelProto, torch_model: torch.nn.Module, example_inputs: Any) -> float | None:
    """Run the float32 export in onnxruntime on the example beside the PyTorch model, and warn where an output
    differs by more than :data:`EXPORT_TOLERANCE`: that error is the exporter's, before any conversion, and the
    converted model carries it. Where the export has another count of outputs (a cache flattened its own way)
    only the first output is compared. Returns the worst error (None where onnxruntime cannot run it on the
    example's inputs)."""
    import onnxruntime as ort

    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    leaves = _named_leaves(_input_names(torch_model, args), args)
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        session = ort.InferenceSession(fp32.SerializeToString(), options, providers=["CPUExecutionProvider"])
        feeds = {i.name: leaves[i.name].detach().cpu().numpy() for i in session.get_inputs()}
        got = session.run(None, feeds)
    except Exception as err:  # noqa: BLE001 - onnxruntime's own types: then there is nothing to compare
        log.info("the float32 export was not compared with the model on the example: %s", first_line(err, 200))
        return None
    with torch.no_grad():
        want = [t for t in pytree.tree_leaves(torch_model(*args)) if isinstance(t, torch.Tensor)]
    if len(want) != len(got):  # the exporter flattened a cache its own way: the first output still pairs
        got, want = got[:1], want[:1]
    worst, where = 0.0, 0
    for index, (value, reference) in enumerate(zip(got, want)):
        if not reference.is_floating_point() or tuple(value.shape) != tuple(reference.shape):
            continue
        reference = reference.detach().double().cpu()
        error = float((torch.from_numpy(np.asarray(value)).double() - reference).norm() / (reference.norm() or 1.0))
        if not error <= worst:  # NaN counts as the worst
            worst, where = error, index
    if not worst <= EXPORT_TOLERANCE:
        log.warning("%s: the float32 ONNX export differs from the PyTorch model on the example by %.3g (relative, "
                    "output %d) before any conversion: that is the export's error (torch's exporter and the op "
                    "translations it was given), and the converted model carries it; check the export "
                    "(torch.onnx.export) or convert the model with amppass.convert", type(torch_model).__name__,
                    worst, where)
    return worst


def _refuse_converted(model: torch.nn.Module) -> None:
    """export_onnx exports a float32 model and converts the ONNX graph: a module amppass already converted
    would be exported with its casts and low weights, which shape inference then rejects."""
    from ..serving.dropin import DropIn
    from ..serving.kept import KeptFp32
    from ..serving.parts import parts_of
    from ..analysis.record import META_KEY
    from ..serving.train_eval import TrainEvalGraphs

    name = type(model).__name__
    if isinstance(model, TrainEvalGraphs):
        raise InputError(f"export_onnx exports a float32 model and converts it; this {name} was converted by amppass "
                         "in train mode: load what it learned into the original model (original.load_state_dict("
                         "model.state_dict()): the keys are the original's) and pass the original")
    if parts_of(model) is not None:
        raise InputError(f"export_onnx exports a float32 model and converts it; this {name} was converted by parts "
                         "by amppass: pass the original float32 model, which export_onnx exports with the "
                         "TorchScript exporter where the dynamo exporter cannot take it whole")
    if isinstance(model, (DropIn, KeptFp32)) or META_KEY in getattr(model, "meta", {}):
        raise InputError(f"export_onnx exports a float32 model and converts it; this {name} was already converted by "
                         "amppass: pass the original float32 model (amppass.export_onnx(model, example_inputs, path))")


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
            """Export with ``shapes``; again with fewer dynamic dimensions where the file does not run at another
            size on those it declares (:func:`_attempts`)."""
            for attempt in _attempts(shapes) if dynamic_shapes == "auto" else (shapes,):
                if dynamo:
                    with size_one_dynamic(size_one), quiet_torch():
                        torch.onnx.export(torch_model, args, target, dynamo=True, verbose=False,
                                          dynamic_shapes=attempt, custom_translation_table=translations(),
                                          **kwargs)
                else:
                    with quiet_torch():
                        torch.onnx.export(torch_model, args, target, dynamo=False, verbose=False,
                                          input_names=list(_named_leaves(names, args)),
                                          dynamic_axes=_axes(names, attempt), **kwargs)
                if dynamic_shapes != "auto" or _runs_at_another_size(target, names, args, attempt):
                    break
            model = onnx.load(target)
            fixed = _fixed_dims(names, args, shapes, attempt) if dynamic_shapes == "auto" else []
            if fixed:
                log.warning("%s: the exported model does not run at another %s; fixed at the example's size in the "
                            "file", type(torch_model).__name__, ", ".join(fixed))
                model.metadata_props.add(key=FIXED_KEY, value=json.dumps(fixed))
            return model

        for size_one in ((True, False) if shapes is not None else (False,)):
            try:
                return exported(dynamo=True, size_one=size_one)
            except Exception as err:  # the exporter can fail on any op; tried again, then the other exporter
                log.info("torch.onnx.export(dynamo=True, size-1 dims dynamic: %s) failed: %s", size_one, err)
                errors.append(f"dynamo=True: {_why(err)}")
        try:
            model = exported(dynamo=False)
        except Exception as err:  # both failed: reported together below
            log.info("torch.onnx.export(dynamo=False) failed: %s", err)
            errors.append(f"dynamo=False: {_why(err)}")
        else:
            log.warning("%s: the dynamo ONNX exporter failed (%s); exported with the TorchScript exporter instead",
                        type(torch_model).__name__, errors[-1].split(": ", 1)[-1][:200])
            return model
    raise CaptureError(f"{type(torch_model).__name__} could not be exported to ONNX by either exporter ("
                       + "; ".join(errors) + "); try amppass.convert for a torch.fx graph instead")


_ESCAPES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # the colours torch's exporter writes into its messages


def _why(err: BaseException) -> str:
    """Why an exporter failed, in one line: the innermost cause's type and first line, without terminal colours
    (the dynamo exporter wraps the real error in a page of "step 1/3 ... next steps" advice)."""
    cause = err
    while cause.__cause__ is not None and cause.__cause__ is not cause:
        cause = cause.__cause__
    return f"{type(cause).__name__}: {_ESCAPES.sub('', first_line(cause, 300))}"


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


def _dynamic(shapes: Any) -> dict[str, list[int]]:
    """The dimensions ``shapes`` makes dynamic, by input name."""
    if not isinstance(shapes, dict):
        return {}
    return {name: sorted(spec) for name, spec in shapes.items() if isinstance(spec, dict) and spec}


def _keeping(shapes: Any, keep: Callable[[int, int], bool]) -> Any:
    """``shapes`` with the dynamic dimensions ``keep(dim, rank-guess)`` refuses fixed (None where none is left)."""
    if not isinstance(shapes, dict):
        return shapes
    kept = {name: {d: v for d, v in spec.items() if keep(d, max(spec) + 1)} if isinstance(spec, dict) else spec
            for name, spec in shapes.items()}
    return kept if any(kept.values()) else None


def _attempts(shapes: Any) -> list[Any]:
    """The dynamic shapes to export with, most dynamic first: every dimension :func:`_batch_and_sequence` names;
    without the spatial ones (dims 2 and up); the batch alone; none. The first whose file runs at other sizes
    (:func:`_runs_at_another_size`) is kept."""
    found: list[Any] = []
    for attempt in (shapes, _keeping(shapes, lambda d, rank: d < 2), _keeping(shapes, lambda d, rank: d == 0), None):
        if attempt not in found:
            found.append(attempt)
    return found


def _fixed_dims(names: list[str], args: tuple, wanted: Any, got: Any) -> list[str]:
    """The dimensions asked dynamic in ``wanted`` that the export ``got`` fixed: "input_values dim 1 (16000)"."""
    asked, kept = _dynamic(wanted), _dynamic(got)
    values = dict(zip(names, args))
    return [f"{name} dim {dim} ({values[name].shape[dim]})" for name, dims in asked.items() for dim in dims
            if dim not in kept.get(name, ()) and isinstance(values.get(name), torch.Tensor)]


def _runs_at_another_size(path: str, names: list[str], args: tuple, shapes: Any) -> bool:
    """Whether the exported float32 model runs in onnxruntime with the dimensions it declares dynamic grown by
    :func:`_grown`, all together and by kind (:func:`_growths`; True when it declares none). The dynamo exporter defers the model's own size checks to run
    time, so a net whose Linear reads a flattened feature map exports with free image sizes it cannot take, and
    a reshape the model computes from the example's batch (LeViT, SD3, Flux) exports a dynamic batch that only
    runs at the example's.

    onnxruntime's inputs are fed by name (:func:`_named_leaves`): the exporters drop None arguments and the
    dynamo exporter bakes Python numbers in, so position in ``args`` is not position in the model's inputs."""
    dynamic = _dynamic(shapes)
    if not dynamic:
        return True
    import onnxruntime as ort

    leaves = _named_leaves(names, args)
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        unknown = [info.name for info in session.get_inputs() if info.name not in leaves]
        if unknown:
            log.info("the exported model's inputs %s are none of the example's arguments %s, so its dynamic "
                     "dimensions cannot be tried at another size; they are fixed", unknown, list(leaves))
            return False
        for which in _growths(dynamic):
            feeds = {}
            for info in session.get_inputs():
                array = leaves[info.name].detach().cpu().numpy()
                grown = [d for d in dynamic.get(info.name, ()) if which(d)]
                if grown:
                    array = np.resize(array, [_grown(n) if d in grown else n for d, n in enumerate(array.shape)])
                feeds[info.name] = array
            session.run(None, feeds)
    except Exception as err:  # noqa: BLE001 - onnxruntime's own types: the size is not one the model takes
        log.info("the exported model does not run at sizes other than its example's on %s (%s); fewer are left "
                 "dynamic", dynamic, first_line(err))
        return False
    return True


def _growths(dynamic: Mapping[str, list[int]]) -> list[Callable[[int], bool]]:
    """Which dynamic dimensions each run grows: all of them; then, where both kinds are dynamic, the batch
    alone and the others alone. A size the export baked in from the example can hide behind growing every
    dimension at once: timm's Swin ran at batch 4 and 192x192 from an example of 2x128x128, but not at batch 2
    and 192x192."""
    dims = {d for found in dynamic.values() for d in found}
    runs: list[Callable[[int], bool]] = [lambda d: True]
    if 0 in dims and len(dims) > 1:
        runs += [lambda d: d == 0, lambda d: d != 0]
    return runs


def _grown(size: int) -> int:
    """A size other than ``size`` that a model takes if it takes sizes other than the example's.

    ``size`` plus its largest power-of-two divisor, kept within [1, 64] and at least 32 past 16: the sum keeps
    every power-of-two divisor of ``size`` up to 64, so an encoder-decoder that needs sizes divisible by its total
    stride (32 for five stride-2 stages: ResNet, U-Net, ConvNeXt; 64 for six) runs, and at least 32 more pixels
    change the final feature map of a net with stride up to 32 even where the stages round down, so a Linear
    head reading it fails as it should. A batch or a short sequence (16 or less) grows by its largest
    power-of-two divisor: a batch of 1 becomes 2, of 2 becomes 4. Doubling does all of this too, but costs four
    times the example's pixels (eight for a volume); this costs at most 1.3x an image of 224 or more."""
    step = size & -size if size else 1
    return size + (min(step, 64) if size <= 16 else min(max(step, 32), 64))


def _named_leaves(names: list[str], args: tuple) -> dict[str, torch.Tensor]:
    """The example's tensors as the exported model names them: a tensor argument by its forward() name, the
    tensors of a list/tuple argument as ``<name>_<i>`` (the dynamo exporter's names). Neither exporter makes
    None an input; the dynamo exporter bakes Python numbers in as constants (the TorchScript exporter may make
    them inputs, which then match no name here)."""
    named: dict[str, torch.Tensor] = {}
    for name, value in zip(names, args):
        if isinstance(value, torch.Tensor):
            named[name] = value
        else:
            tensors = [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]
            named.update((f"{name}_{i}", tensor) for i, tensor in enumerate(tensors))
    return named


def _axes(names: list[str], shapes: Any) -> dict[str, dict[int, str]] | None:
    """The TorchScript exporter's dynamic_axes for the same dimensions."""
    if not isinstance(shapes, dict):
        return None
    return {name: {dim: f"{name}_{dim}" for dim in spec} for name, spec in shapes.items()
            if name in names and isinstance(spec, dict) and spec}
