"""``amppass.export_onnx``: torch model -> ONNX (dynamo exporter, TorchScript fallback) -> mixed precision."""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import tempfile
from typing import Any, Collection, Mapping

import numpy as np
import onnx
import torch
from torch.utils import _pytree as pytree

from ..errors import CaptureError, InputError, first_line
from ..files import check_writable
from ..fx.capture.copies import private_copy
from ..fx.capture.export import capturing, size_one_dynamic
from ..fx.capture.guards import plain_inputs
from ..fx.capture.quiet import quiet_torch
from ..onnx.io.save import save
from ..onnx.rename import rename_outputs
from .convert_onnx import convert_onnx, note
from .export_shapes import (
    attempts,
    axes,
    batch_and_sequence,
    cannot_vary,
    fixed_dims,
    input_names,
    named_leaves,
    unshared,
    without,
)
from .onnx_ops import translations

log = logging.getLogger(__name__)


def export_onnx(
    torch_model: torch.nn.Module,
    example_inputs: Any = None,
    path: str | os.PathLike | None = None,
    dtype: str = "fp16",
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    dynamic_shapes: Any = "auto",
    output_names: list[str] | None = None,
    **convert_kwargs: Any,
) -> onnx.ModelProto:
    """Export ``torch_model`` to ONNX, convert it with :func:`convert_onnx` and save it atomically at ``path``.

    ``example_inputs`` are forward's positional inputs (a tuple, or one tensor); ``example_kwargs`` its keyword
    inputs, as :func:`amppass.convert` takes them: a tokenizer's output (a ``BatchEncoding`` or a dict), e.g.
    ``export_onnx(model, "model.onnx", example_kwargs=tokenizer(texts, return_tensors="pt"))`` (the path may come
    second when only ``example_kwargs`` are given). Keyword inputs are passed to forward() in its parameters'
    order, so the file's inputs are named as forward names them (``input_ids``, ``attention_mask``,
    ``token_type_ids``).

    The model itself is never exported: each exporter traces a private copy (its own module objects, the
    model's tensors), so what the model's code stores on itself while traced (ultralytics' Detect head caches
    its anchors) never reaches the caller's model.

    The model is exported in eval mode (its own training flags are restored afterwards), without autograd,
    and with torch's exporter quiet (its log lines and warnings; ``AMPPASS_DEBUG=1`` shows them, see
    :mod:`amppass.fx.capture.quiet`). The dynamo exporter (``torch.onnx.export(dynamo=True)``) is tried first; if it
    fails, the
    TorchScript exporter (``dynamo=False``), with a warning: where it raises, and where the file it wrote is not
    valid (``onnx.checker`` refuses it, or onnxruntime cannot load it). ``dynamic_shapes`` is what torch.export takes;
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
    if path is None and isinstance(example_inputs, (str, os.PathLike)):  # export_onnx(model, path, example_kwargs=)
        example_inputs, path = None, example_inputs
    if path is None:
        raise InputError("export_onnx needs the path to write the ONNX file to: export_onnx(model, example_inputs, "
                         "'model.onnx'), or export_onnx(model, 'model.onnx', example_kwargs=inputs)")
    _check_output_names(output_names)
    check_writable(path)
    args = forward_inputs(torch_model, example_inputs, example_kwargs)
    with capturing(torch_model, train=False):  # an inference export: dropout off, BN running stats
        outputs = _outputs(private_copy(torch_model), args)  # a copy: what forward stores on the model stays there
        fp32 = export_fp32(torch_model, args, dynamic_shapes=dynamic_shapes)
        _name_outputs(fp32, output_names, outputs, type(torch_model).__name__)
        _say_if_the_export_differs(fp32, torch_model, args, outputs=outputs)
    fixed = [entry.value for entry in fp32.metadata_props if entry.key == FIXED_KEY]
    del fp32.metadata_props[:]  # the summary convert_onnx stores is the file's only metadata of amppass's
    converted = convert_onnx(fp32, dtype, **convert_kwargs)
    if fixed:
        note(converted, "fixed_dims", json.loads(fixed[0]))  # the report says which sizes the file takes
    save(converted, path)
    return converted


FIXED_KEY = "amppass_fixed_dims"  # metadata_props entry: the dimensions the export fixed at the example's size
EXPORT_TOLERANCE = 1e-4  # relative L2: a float32 export differs from torch by its kernels' rounding, far below this


def forward_inputs(model: torch.nn.Module, example_inputs: Any, example_kwargs: Any) -> tuple:
    """The example as forward()'s positional inputs: ``example_inputs`` (a tuple, or one value), then each of
    ``example_kwargs`` at its parameter's position in forward's order, the parameters between at their defaults,
    so the exporters name each input as forward names it. Mappings torch's pytree does not know (a tokenizer's
    ``BatchEncoding``) are taken as dicts, and a transformers model's ``None`` inputs and ``return_dict`` are left
    out, as :func:`amppass.convert` takes them."""
    from ..serving.dropin import transformers_call

    example_inputs, example_kwargs = plain_inputs(example_inputs), plain_inputs(example_kwargs)
    if isinstance(example_inputs, dict):
        raise InputError("export_onnx's example_inputs is a dict; pass keyword inputs (a tokenizer's output) as "
                         "example_kwargs=inputs, or example_inputs=(inputs,) for a forward() that takes the dict "
                         "itself as its first argument")
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise InputError(f"export_onnx's example_kwargs must be a dict of keyword inputs, got "
                         f"{type(example_kwargs).__name__}; e.g. example_kwargs=tokenizer(texts, return_tensors='pt')")
    if example_inputs is None and not example_kwargs:
        raise InputError("export_onnx needs example inputs to trace the model with: example_inputs (a tuple of "
                         "forward's positional inputs) or example_kwargs (a dict of its keyword inputs)")
    args = () if example_inputs is None else example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    kwargs = transformers_call(model, example_kwargs) or {}
    if not kwargs:
        return args
    name = type(model).__name__
    try:
        parameters = [p for p in inspect.signature(model.forward).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][len(args):]
    except (TypeError, ValueError) as err:
        raise InputError(f"export_onnx cannot read {name}.forward's parameters ({err}), so it cannot place "
                         "example_kwargs: pass them in example_inputs, in forward's order") from None
    names = [p.name for p in parameters]
    stray = [key for key in kwargs if key not in names]
    if stray:
        raise InputError(f"export_onnx passes example_kwargs to {name}.forward by position, and {stray[0]!r} is not "
                         f"one of its positional parameters after the {len(args)} positional example input(s) "
                         f"({', '.join(names) or 'there are none'}): a keyword-only parameter or one forward's "
                         "**kwargs takes cannot be placed; pass only the inputs forward names, or leave that one out")
    last = max(names.index(key) for key in kwargs)
    given = [kwargs.get(p.name, p.default) for p in parameters[:last + 1]]
    missing = [p.name for p, value in zip(parameters, given, strict=False) if value is inspect.Parameter.empty]
    if missing:
        raise InputError(f"export_onnx: {name}.forward's parameter {missing[0]!r} has no default and is not in "
                         "example_kwargs: pass it too")
    return args + tuple(given)


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
        clash = [name for name, old in zip(output_names, have, strict=False) if name in inputs and name != old]
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
    leaves = named_leaves(input_names(torch_model, args), args)
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
        outputs = _outputs(private_copy(torch_model), args)
    want = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)]
    if len(want) != len(got):  # the exporter flattened a cache its own way: the first output still pairs
        got, want = got[:1], want[:1]
    worst, where = 0.0, 0
    for index, (value, reference) in enumerate(zip(got, want, strict=False)):
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
    from ..serving.artifact import Artifact, record_of

    found = record_of(model)
    if found is None and META_KEY in getattr(model, "meta", {}):  # a wrapper of one (torch.compile's)
        found = Artifact(model, model.meta[META_KEY])
    if found is not None:
        raise InputError(found.export_refusal())  # each kind says what to pass instead


def export_fp32(torch_model: torch.nn.Module, example_inputs: Any, opset: int | None = None,
                dynamic_shapes: Any = "auto") -> onnx.ModelProto:
    """The float32 ONNX export of ``torch_model``: dynamo exporter first, TorchScript exporter second.

    Exported under ``torch.no_grad()``: with autograd on, the dynamo exporter fails on some models (T5)
    that it exports without it. ``dynamic_shapes`` as in :func:`export_onnx`. Each export traces a fresh private
    copy of the model (:func:`~amppass.fx.capture.copies.private_copy`), so what one attempt leaves on the module
    it traced (fake tensors a forward cached on itself) reaches neither the next attempt nor the model. A file
    ``onnx.checker`` refuses or onnxruntime cannot load (:func:`_session`) counts as that exporter failing.
    """
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    names = input_names(torch_model, args)
    shapes = batch_and_sequence(names, args) if dynamic_shapes == "auto" else dynamic_shapes
    errors = []
    with tempfile.TemporaryDirectory(prefix="amppass-export-") as folder, torch.no_grad():
        target = os.path.join(folder, "model.onnx")
        kwargs = {"opset_version": opset} if opset is not None else {}

        def export(dynamo: bool, attempt: Any, size_one: bool) -> Any:
            """Write ``target`` with the dynamic shapes ``attempt``; returns those used: with dynamo, a symbol for
            each dimension where the model's code refuses shared ones."""
            if not dynamo:
                with quiet_torch():
                    torch.onnx.export(private_copy(torch_model), args, target, dynamo=False, verbose=False,
                                      input_names=list(named_leaves(names, args)), dynamic_axes=axes(names, attempt),
                                      **kwargs)
                return attempt
            try:
                with size_one_dynamic(size_one), quiet_torch():
                    torch.onnx.export(private_copy(torch_model), args, target, dynamo=True, verbose=False,
                                      dynamic_shapes=attempt, custom_translation_table=translations(), **kwargs)
                return attempt
            except Exception as err:  # a shared Dim the model's code refuses: each dimension its own
                if unshared(attempt) == attempt:
                    raise
                log.info("the export with shared batch/sequence dimensions failed (%s); exporting with a symbol "
                         "for each", _why(err))
            return export(dynamo, unshared(attempt), size_one)

        def exported(dynamo: bool, size_one: bool = False) -> onnx.ModelProto:
            """Export with ``shapes``; where the file does not run at another size on some of the dimensions it
            declares dynamic (:func:`cannot_vary`), again with those fixed, then with fewer kinds of dimension
            (:func:`attempts`), the last with none."""
            tried, attempt = [], shapes
            while True:
                tried.append(attempt)
                attempt = export(dynamo, attempt, size_one)
                session = _session(target)
                stuck = cannot_vary(session, names, args, attempt) if dynamic_shapes == "auto" else set()
                if not stuck:
                    break
                log.info("the exported model does not run at another size on %s; exported again with those fixed",
                         sorted(stuck))
                attempt = next(c for c in (without(attempt, stuck), *attempts(shapes)) if c not in tried)
            model = onnx.load(target)
            fixed = fixed_dims(names, args, shapes, model) if dynamic_shapes == "auto" else []
            if fixed:
                log.warning("%s: the exported model does not run at another %s; fixed at the example's size in the "
                            "file", type(torch_model).__name__, ", ".join(fixed))
                model.metadata_props.add(key=FIXED_KEY, value=json.dumps(fixed))
            return model

        for size_one in ((True, False) if shapes is not None else (False,)):
            try:
                return exported(dynamo=True, size_one=size_one)
            except Exception as err:  # noqa: BLE001 - the exporter fails on any op; tried again, then the other exporter
                log.info("torch.onnx.export(dynamo=True, size-1 dims dynamic: %s) failed: %s", size_one, err)
                errors.append(f"dynamo=True: {_why(err)}")
        try:
            model = exported(dynamo=False)
        except Exception as err:  # noqa: BLE001 - the exporter fails on any op: both reported together below
            log.info("torch.onnx.export(dynamo=False) failed: %s", err)
            errors.append(f"dynamo=False: {_why(err)}")
        else:
            log.warning("%s: the dynamo ONNX exporter failed (%s); exported with the TorchScript exporter instead%s",
                        type(torch_model).__name__, errors[-1].split(": ", 1)[-1][:300], _install_hint(errors))
            return model
    raise CaptureError(f"{type(torch_model).__name__} could not be exported to ONNX by either exporter ("
                       + "; ".join(errors) + ")" + (_install_hint(errors)
                                                    or "; try amppass.convert for a torch.fx graph instead"))


def _install_hint(errors: list[str]) -> str:
    """Where the dynamo exporter failed for want of onnxscript (an install with --no-deps, or one pip changed
    after): how to install it. amppass requires it (pyproject.toml), so ``pip install amppass`` brings it."""
    if not any("No module named 'onnxscript" in error for error in errors):
        return ""
    return ("; the dynamo exporter needs onnxscript, a dependency of amppass that this environment lacks: "
            "pip install 'onnxscript>=0.6,<0.8', then export again")


def _session(path: str) -> Any:
    """An onnxruntime session of the exported file at ``path``, once ``onnx.checker`` has passed it. A file either
    refuses (torch's dynamo exporter wrote a Squeeze onnxruntime cannot load for an LSTM speech model, without
    raising) is the exporter's failure: a RuntimeError saying which refused it and why."""
    import onnxruntime as ort

    try:
        onnx.checker.check_model(path)
    except Exception as err:  # noqa: BLE001 - onnx's checker raises its own ValidationError and others
        raise RuntimeError(f"the exported file is not valid ONNX (onnx.checker: {first_line(err, 300)})") from None
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    except Exception as err:  # noqa: BLE001 - onnxruntime's own types
        raise RuntimeError(f"onnxruntime cannot load the exported file ({first_line(err, 300)})") from None


_ESCAPES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # the colours torch's exporter writes into its messages


def _why(err: BaseException) -> str:
    """Why an exporter failed, in one line: the innermost cause's type and first line, without terminal colours
    (the dynamo exporter wraps the real error in a page of "step 1/3 ... next steps" advice)."""
    cause = err
    while cause.__cause__ is not None and cause.__cause__ is not cause:
        cause = cause.__cause__
    return f"{type(cause).__name__}: {_ESCAPES.sub('', first_line(cause, 300))}"


