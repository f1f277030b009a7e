"""``amppass.export_onnx``: torch model -> ONNX (dynamo exporter, TorchScript fallback) -> mixed precision."""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import tempfile
from typing import Any, Callable, Collection, Mapping

import numpy as np
import onnx
import torch
from torch.export import Dim
from torch.utils import _pytree as pytree

from ..errors import CaptureError, InputError, first_line
from ..files import check_writable
from ..fx.capture.export import capturing, size_one_dynamic
from ..fx.capture.quiet import quiet_torch
from ..onnx.io.save import save
from ..onnx.rename import rename_outputs
from .convert_onnx import convert_onnx, note
from .onnx_ops import translations

log = logging.getLogger(__name__)


def export_onnx(
    torch_model: torch.nn.Module,
    example_inputs: Any,
    path: str | os.PathLike,
    dtype: str = "fp16",
    *,
    dynamic_shapes: Any = "auto",
    output_names: list[str] | None = None,
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
    ``None`` fixes every dimension to the example's. Inputs whose dim 0 has the example's batch size (that of the
    first tensor input) share one symbol, ``batch``, and the token inputs of a transformers model (``input_ids``,
    ``attention_mask``, ``token_type_ids``, ``position_ids``) of one length share ``sequence``, where the model
    allows it (otherwise each keeps its own symbol).

    The file's outputs are named as the model declares them (:func:`declared_output_names`): a tensor output
    ``output``, a tuple's ``output_0``, ``output_1``, ...; the fields of a dict, a namedtuple or a transformers
    ``ModelOutput`` by their keys (``last_hidden_state``, ``pooler_output``), nested ones joined by dots
    (``past_key_values.0.key``). ``output_names`` names them instead: one distinct string per output of the
    exported file, in the order of the model's flattened outputs. ``convert_kwargs`` go to :func:`convert_onnx`.
    Returns the converted model.
    """
    if not isinstance(torch_model, torch.nn.Module):
        raise InputError(f"export_onnx takes a torch.nn.Module, got {type(torch_model).__name__}; for an ONNX "
                         "model already on disk use amppass.convert_onnx")
    _refuse_converted(torch_model)
    _check_output_names(output_names)
    check_writable(path)
    with capturing(torch_model, train=False):  # an inference export: dropout off, BN running stats
        fp32 = export_fp32(torch_model, example_inputs, dynamic_shapes=dynamic_shapes)
        outputs = _outputs(torch_model, example_inputs)
        _name_outputs(fp32, output_names, outputs, type(torch_model).__name__)
        _say_if_the_export_differs(fp32, torch_model, example_inputs, outputs=outputs)
    fixed = [entry.value for entry in fp32.metadata_props if entry.key == FIXED_KEY]
    del fp32.metadata_props[:]  # the summary convert_onnx stores is the file's only metadata of amppass's
    converted = convert_onnx(fp32, dtype, **convert_kwargs)
    if fixed:
        note(converted, "fixed_dims", json.loads(fixed[0]))  # the report says which sizes the file takes
    save(converted, path)
    return converted


FIXED_KEY = "amppass_fixed_dims"  # metadata_props entry: the dimensions the export fixed at the example's size
EXPORT_TOLERANCE = 1e-4  # relative L2: a float32 export differs from torch by its kernels' rounding, far below this


def _outputs(torch_model: torch.nn.Module, example_inputs: Any) -> Any:
    """The model's outputs on the example, as it returns them (a ModelOutput, a dict, a tuple, a tensor)."""
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    with torch.no_grad():
        return torch_model(*args)


def _check_output_names(output_names: Any) -> None:
    """Refuse ``output_names`` that cannot name ONNX outputs: not a list of strings, an empty name, a repeat. The
    count is checked against the exported file (:func:`_name_outputs`)."""
    if output_names is None:
        return
    fix = ("pass one distinct string per output of the model, in the order of its flattened outputs (e.g. "
           "output_names=['last_hidden_state', 'pooler_output']), or leave output_names out to name them as the "
           "model declares them")
    if isinstance(output_names, str) or not isinstance(output_names, (list, tuple)):
        raise InputError(f"export_onnx's output_names must be a list of strings, got "
                         f"{type(output_names).__name__} {output_names!r:.80}; {fix}")
    bad = [name for name in output_names if not isinstance(name, str) or not name]
    if bad:
        raise InputError(f"export_onnx's output_names holds {bad[0]!r:.80}, which is not a non-empty string; {fix}")
    repeated = sorted({name for name in output_names if output_names.count(name) > 1})
    if repeated:
        raise InputError(f"export_onnx's output_names names {repeated[0]!r} more than once: each ONNX output needs "
                         f"a name of its own; {fix}")


def declared_output_names(outputs: Any, inputs: Collection[str] = ()) -> list[str]:
    """The names of the tensors in ``outputs``, in the order exporters flatten them (torch's pytree):
    ``output`` for a tensor; ``output_<i>`` for the items of a tuple or list; a dict's, namedtuple's or
    ``ModelOutput``'s key for its fields; nested keys and positions joined by dots (``past_key_values.0.key``,
    ``output_1.boxes``). A name that is one of ``inputs`` (the file's input names: a value has one name) gets
    ``_output``; a name that would repeat (keys that are themselves dotted) gets ``_1``, ``_2``, ..."""
    names: list[str] = []
    for path, leaf in pytree.tree_flatten_with_path(outputs)[0]:
        if not isinstance(leaf, torch.Tensor):
            continue
        parts = [_key(entry) for entry in path]
        if not parts:
            name = "output"
        elif isinstance(path[0], pytree.SequenceKey):
            name = ".".join([f"output_{parts[0]}", *parts[1:]])
        else:
            name = ".".join(parts)
        name = f"{name}_output" if name in inputs else name
        base, n = name, 0
        while name in names or name in inputs:
            n += 1
            name = f"{base}_{n}"
        names.append(name)
    return names


def _key(entry: Any) -> str:
    """One step of a pytree path as a name: a key, a field, a position."""
    if isinstance(entry, pytree.MappingKey):
        return str(entry.key)
    if isinstance(entry, pytree.SequenceKey):
        return str(entry.idx)
    if isinstance(entry, pytree.GetAttrKey):
        return entry.name
    return str(entry).strip(".[]'\"")


def _name_outputs(fp32: onnx.ModelProto, output_names: list[str] | None, outputs: Any, model_name: str) -> None:
    """Name the exported file's outputs ``output_names``, or as the model declares them. Where the file has
    another count of outputs than the model returns tensors (a cache the exporter flattened its own way), the
    declared names cannot be paired and the exporter's are kept, with a warning; given names of the wrong count
    are refused."""
    have = [out.name for out in fp32.graph.output]
    inputs = {i.name for i in fp32.graph.input}
    if output_names is not None:
        if len(output_names) != len(have):
            shown = have if len(have) <= 8 else [*have[:8], "..."]
            raise InputError(f"export_onnx's output_names gives {_count(len(output_names), 'name')}, but the "
                             f"exported {model_name} has {_count(len(have), 'output')} (named by the exporter: "
                             f"{', '.join(shown)}): pass {_count(len(have), 'name')}, in the order of the model's "
                             "flattened outputs")
        clash = [name for name, old in zip(output_names, have) if name in inputs and name != old]
        if clash:
            raise InputError(f"export_onnx's output_names gives {clash[0]!r}, the name of an input of the exported "
                             f"{model_name}; an ONNX value has one name: choose another output name")
        names = list(output_names)
    else:
        names = declared_output_names(outputs, inputs)
        if len(names) != len(have):
            log.warning("%s returns %d tensors but its ONNX export has %d outputs, so they cannot be paired: the "
                        "file keeps the exporter's output names %s; name them with export_onnx(..., "
                        "output_names=[...])", model_name, len(names), len(have), have)
            return
    rename_outputs(fp32, names)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _say_if_the_export_differs(fp32: onnx.ModelProto, torch_model: torch.nn.Module, example_inputs: Any,
                               outputs: Any = None) -> float | None:
    """Run the float32 export in onnxruntime on the example beside the PyTorch model, and warn where an output
    differs by more than :data:`EXPORT_TOLERANCE`: that error is the exporter's, before any conversion, and the
    converted model carries it. Where the export has another count of outputs (a cache flattened its own way)
    only the first output is compared. ``outputs`` are the model's on the example where the caller has them.
    Returns the worst error (None where onnxruntime cannot run it on the example's inputs)."""
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
    if outputs is None:
        outputs = _outputs(torch_model, args)
    want = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)]
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
    from ..analysis.record import META_KEY
    from ..serving.artifact import Kind, record_of

    name = type(model).__name__
    found = record_of(model)
    kind = found.kind if found is not None else None
    if kind is Kind.TRAIN:
        raise InputError(f"export_onnx exports a float32 model and converts it; this {name} was converted by amppass "
                         "in train mode: load what it learned into the original model (original.load_state_dict("
                         "model.state_dict()): the keys are the original's) and pass the original")
    if kind is Kind.PARTS:
        raise InputError(f"export_onnx exports a float32 model and converts it; this {name} was converted by parts "
                         "by amppass: pass the original float32 model, which export_onnx exports with the "
                         "TorchScript exporter where the dynamo exporter cannot take it whole")
    if found is not None or META_KEY in getattr(model, "meta", {}):  # the latter: a wrapper of one (torch.compile's)
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

        def dynamo_export(attempt: Any, size_one: bool) -> None:
            with size_one_dynamic(size_one), quiet_torch():
                torch.onnx.export(torch_model, args, target, dynamo=True, verbose=False, dynamic_shapes=attempt,
                                  custom_translation_table=translations(), **kwargs)

        def exported(dynamo: bool, size_one: bool = False) -> onnx.ModelProto:
            """Export with ``shapes``; again with fewer dynamic dimensions where the file does not run at another
            size on those it declares (:func:`_attempts`)."""
            for attempt in _attempts(shapes) if dynamic_shapes == "auto" else (shapes,):
                if dynamo:
                    try:
                        dynamo_export(attempt, size_one)
                    except Exception as err:  # a shared Dim the model's code refuses: each dimension its own
                        if _unshared(attempt) == attempt:
                            raise
                        log.info("the export with shared batch/sequence dimensions failed (%s); exporting "
                                 "with a symbol for each", _why(err))
                        attempt = _unshared(attempt)
                        dynamo_export(attempt, size_one)
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


TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")  # transformers' names


def _batch_and_sequence(names: list[str], args: tuple) -> dict[str, Any] | None:
    """Dim.AUTO on dim 0 of every tensor input, on dim 1 of sequences (integer inputs of rank 2: token ids,
    masks; inputs of rank 3: a rank-2 float input's dim 1 is its features), and on every dimension but the
    channels (dim 1) of inputs of rank 4 and more: channels-first images and volumes, whose spatial sizes a
    convolutional model takes at any size. The dynamo exporter keeps a Dim.AUTO dimension symbolic in the ONNX
    model even where the model fixes it (channels read by a convolution): naming channels would promise a
    size the model cannot take.

    Dimensions that are one size for the model's caller share a named Dim (:func:`_shared`): Dim.AUTO gives each
    its own symbol unless the model's code ties them, and a mask only broadcast against the ids does not."""
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
    if not any(shapes.values()):
        return None
    return _shared(shapes, dict(zip(names, args)))


def _shared(shapes: dict[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """``shapes`` with one named Dim for each group of two or more dimensions that are the same size in the example
    and mean the same: ``batch`` for dim 0 of the inputs whose dim 0 is the first tensor input's; ``sequence`` for
    dim 1 of the token inputs (:data:`TOKEN_INPUTS`) of the same length. A lone dimension keeps Dim.AUTO."""
    dynamic = {name: spec for name, spec in shapes.items() if spec}
    if not dynamic:
        return shapes
    batch = values[next(iter(dynamic))].shape[0]
    groups = {
        "batch": [(name, 0) for name, spec in dynamic.items() if 0 in spec and values[name].shape[0] == batch],
        "sequence": [(name, 1) for name, spec in dynamic.items() if name in TOKEN_INPUTS and 1 in spec],
    }
    if groups["sequence"]:
        length = values[groups["sequence"][0][0]].shape[1]
        groups["sequence"] = [(name, 1) for name, _ in groups["sequence"] if values[name].shape[1] == length]
    shared = {name: dict(spec) if spec else spec for name, spec in shapes.items()}
    for symbol, members in groups.items():
        if len(members) > 1:
            dim = Dim(symbol)
            for name, index in members:
                shared[name][index] = dim
    return shared


def _unshared(shapes: Any) -> Any:
    """``shapes`` with every named Dim back to Dim.AUTO: for a model whose export refuses to tie them."""
    if not isinstance(shapes, dict):
        return shapes
    return {name: {d: Dim.AUTO for d in spec} if isinstance(spec, dict) else spec for name, spec in shapes.items()}


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
    """The TorchScript exporter's dynamic_axes for the same dimensions: a shared Dim's name (``batch``), or
    ``<input>_<dim>``."""
    if not isinstance(shapes, dict):
        return None
    return {name: {dim: getattr(spec[dim], "__name__", None) or f"{name}_{dim}" for dim in spec}
            for name, spec in shapes.items() if name in names and isinstance(spec, dict) and spec}
