"""``amppass.convert_onnx``: load, check, analyse, paint, rewrite and re-type an ONNX model.

Models are read as untrusted files: structure and tensors are checked (:mod:`amppass.onnx.io.validate`) and
external data is read only from inside the model's folder (:mod:`amppass.onnx.io.external_data`). Saving is
:func:`amppass.onnx.io.save.save`, re-exported here.
"""

from __future__ import annotations

import json
import logging
import math
import os
import zipfile
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np
import onnx
from onnx import TensorProto

from ..analysis import overrides
from ..analysis.calibration import check_tolerance
from ..analysis.painting import paint
from ..analysis.plan import Precision, PrecisionPlan
from ..analysis.record import META_KEY, check_reconversion, summary
from ..errors import InputError, first_line
from ..files import Staged
from ..onnx import policy
from ..onnx.calibrate import Fp32Model, calibrated_plan
from ..onnx.io import lazy_read, validate
from ..onnx.io import save as saving
from ..onnx.io.weight_store import WeightStore, tensors
from ..onnx.macs import is_heavy, node_macs, operands, value_shapes
from ..onnx.rewrite import RewriteStats, rewrite
from ..onnx.simplify import bypass_weight_identities, initializers_out_of_inputs
from ..onnx.view import build_view, clear_value_info, name_nodes, opsets
from ..report import meta
from ..targets import onnxruntime_facts
from ..targets.target import ONNX_TARGETS, Target, onnx_target

save = saving.save
log = logging.getLogger(__name__)

IR_WITH_NODE_METADATA = 10  # NodeProto.metadata_props arrived with IR version 10
BF16_OPSET = 22  # ONNX allows bf16 in Conv, ConvTranspose, pooling, RNNs and ~40 more ops from opset 22


def convert_onnx(
    model: str | os.PathLike | onnx.ModelProto,
    dtype: str = "fp16",
    *,
    target: str = "cpu",
    keep_io_types: bool = True,
    keep_fp32: Iterable[str] = (),
    force_low: Iterable[str] = (),
    low_weight_tables: bool = False,
    calibration: Iterable[Mapping[str, np.ndarray]] | None = None,
    tolerance: float | None = None,
    progress: bool = False,
) -> onnx.ModelProto:
    """Return a mixed-precision copy of an ONNX model that the installed onnxruntime loads.

    Args:
        model: a path to a .onnx file (external data beside it is read) or an ``onnx.ModelProto``,
            which is never changed.
        dtype: "fp16", "bf16" or "auto" (fp16: what every ONNX target runs fastest).
        target: where the converted model will run: "cpu" (onnxruntime's CPU provider, the default),
            "cuda" (its CUDA provider) or "tensorrt". The target decides which ops have low-precision
            kernels (the installed onnxruntime's registry for "cpu"; packaged kernel tables for the others)
            and how the tolerance search judges error: by running the candidate in onnxruntime for "cpu",
            on the fp16-storage simulation for targets this machine cannot run (:mod:`amppass.targets`).
        keep_io_types: keep float32 graph outputs float32 (inputs always keep their type).
        keep_fp32: op types ("Softmax") or regular expressions over node names to keep in fp32.
        force_low: op types or node-name regexes to run in low precision regardless of the policy.
        low_weight_tables: store tables read by weight-only ops (embedding Gathers) in low precision even
            when they feed fp32 work.
        calibration: an iterable of feeds (dicts of input name -> numpy array); the fp32 model runs on each
            in onnxruntime and the range rules decide from what its values reach (see
            :mod:`amppass.onnx.calibrate`).
        tolerance: the largest relative error ``||out - out_fp32|| / ||out_fp32||`` allowed on any floating
            output over the calibration feeds; the most sensitive nodes move back to fp32 until it is met.
            Needs ``calibration``.
        progress: show a progress bar on stderr while calibrating.

    Each node's decision is stored in its ``metadata_props["amppass"]`` and the summary in the model's;
    ``amppass.report`` reads them back.
    """
    return convert_skeleton(model, dtype, target=target, keep_io_types=keep_io_types, keep_fp32=keep_fp32, force_low=force_low,
                            low_weight_tables=low_weight_tables, calibration=calibration, tolerance=tolerance,
                            progress=progress).materialized()


@dataclass
class Converted:
    """A converted model whose tensor payloads are still held by its weight store."""

    model: onnx.ModelProto  # a skeleton (:mod:`amppass.onnx.io.weight_store`): metadata complete, payloads in ``store``
    store: WeightStore

    def materialized(self) -> onnx.ModelProto:
        """The model with every payload written in: a self-contained proto (the skeleton itself)."""
        self.store.materialize(self.model)
        return self.model

    def stage(self, staged: Staged, path: str, external_data: bool | None = None) -> None:
        """Add the model to ``staged`` as ``path``, streamed from the store (:func:`amppass.onnx.io.save.stage`)."""
        saving.stage(staged, self.model, self.store, path, external_data)


@dataclass(frozen=True)
class Loaded:
    """A model read for conversion: the proto (large payloads not copied), the folder its external data lives
    in (None for a proto given in memory), and how messages name it."""

    model: onnx.ModelProto
    base_dir: str | None
    where: str
    owned: bool = False  # read from a file by amppass: a conversion may take its tensors' bytes


def load(model: str | os.PathLike | onnx.ModelProto, check: bool = False) -> Loaded:
    """Read ``model`` (a path or a proto, which is only read) for :func:`convert_skeleton`, refusing what is
    not an ONNX model. ``check`` also runs ``onnx.checker`` on a stand-in of it that holds no weights
    (:func:`amppass.onnx.io.validate.check_with_onnx`): the command line's promise that a file is a valid model,
    without loading or copying the model a second time."""
    source, base_dir, where = _load(model)
    owned = source is not model
    if check:
        skeleton = WeightStore(base_dir, where).skeleton(source)
        validate.check_order(skeleton, where)
        validate.check_with_onnx(skeleton, where)
    return Loaded(source, base_dir, where, owned)


def convert_skeleton(
    model: str | os.PathLike | onnx.ModelProto | Loaded,
    dtype: str = "fp16",
    *,
    target: str = "cpu",
    keep_io_types: bool = True,
    keep_fp32: Iterable[str] = (),
    force_low: Iterable[str] = (),
    low_weight_tables: bool = False,
    calibration: Iterable[Mapping[str, np.ndarray]] | None = None,
    tolerance: float | None = None,
    progress: bool = False,
) -> Converted:
    """:func:`convert_onnx` without writing the payloads into the result: what the CLI saves from, streaming
    each tensor from the store, so a conversion and its save hold no second copy of the model.

    Calibration decisions, when they exist, enter as ``given`` below.
    """
    check_tolerance(tolerance, calibration, example="[{input name: array, ...}, ...]")
    plan_target = _target(target, dtype)
    low = plan_target.low
    loaded = model if isinstance(model, Loaded) else load(model)
    source, base_dir, where = loaded.model, loaded.base_dir, loaded.where
    store = WeightStore(base_dir, where, owns_source=loaded.owned)
    work = store.skeleton(source)  # the private copy the conversion works on; payloads stay in the store
    validate.check_order(work, where)
    validate.dynamic_negative_dims(work)
    previous = converted_dtype(work)
    if previous is not None:
        return _unchanged(work, store, previous, low.name, where)
    versions = opsets(work)
    upgraded_from = None
    if low.onnx == TensorProto.BFLOAT16 and plan_target.name != "cpu" and \
            13 <= versions.get("", 1) < BF16_OPSET <= onnxruntime_facts.max_opset():
        work, upgraded_from = _upgraded(work, BF16_OPSET), versions.get("", 1)
        versions = opsets(work)
    if low.onnx == TensorProto.BFLOAT16 and versions.get("", 1) < 13:
        raise InputError(f"bf16 needs opset 13 or later for Cast; this model imports opset {versions.get('', 1)}. "
                         "Re-export it with a newer opset or use dtype='fp16'")
    if versions.get("", 1) > onnxruntime_facts.max_opset():
        raise InputError(f"the model imports opset {versions[''] } but the installed onnxruntime loads at most "
                         f"{onnxruntime_facts.max_opset()}; re-export with opset <= {onnxruntime_facts.max_opset()}")
    name_nodes(work)
    initializers_out_of_inputs(work)
    bypass_weight_identities(work)
    bytes_before = weight_bytes(work)
    typed = _infer(work, strict=True)
    missing = missing_low_kernels(typed, plan_target.name, low.name)
    if missing is not None:  # the command line refuses the same request (amppass.cli), in its flags' words
        ops, able = missing
        fix = " or ".join(f"target={name!r}" for name in able)
        raise InputError(
            f"dtype={low.name!r} with target={plan_target.name!r}: {plan_target.runtime} has no {low.name} kernel for "
            f"{', '.join(ops)}, so the converted model would run all of them in fp32, with nothing in {low.name}; "
            + (f"pass {fix} to convert for where the model runs, or " if able else "")
            + f"convert with dtype={'fp16' if low.name == 'bf16' else 'bf16'!r}")

    view, refs, types = build_view(typed, plan_target, None if low.wide_range else store.absmax, store.array)
    given = {**policy.quantized_nodes(typed.graph), **overrides.resolve(view, keep_fp32, force_low, low)}

    def apply(target: onnx.ModelProto, chosen: PrecisionPlan) -> RewriteStats:
        """Rewrite ``target`` (``typed``, or a copy for a tolerance trial) by ``chosen``, loadable as it is."""
        done = rewrite(target, chosen, refs, types, set(view.weights), store, low, keep_io_types)
        clear_value_info(target.graph)
        target.ir_version = min(max(target.ir_version, IR_WITH_NODE_METADATA), onnxruntime_facts.max_ir_version())
        return done

    calibration_info: dict[str, Any] = {"calibrated": False}
    if calibration is None:
        plan = paint(view, low, given, low_weight_tables=low_weight_tables)
    else:
        plan, calibration_info = calibrated_plan(
            Fp32Model(typed, view, refs, types, store), calibration, plan_target, given, apply=apply,
            tolerance=tolerance, progress=progress, low_weight_tables=low_weight_tables)
    shapes = value_shapes(typed, {v for ref in refs.values() if is_heavy(ref.node) for v in operands(ref.node)})
    for node in view.nodes:
        if node.name not in plan:
            continue
        plan[node.name].evidence.update(refs[node.name].evidence)
        if node.unknown:
            plan[node.name].evidence["unknown"] = True
        macs = node_macs(refs[node.name].node, shapes)  # before the rewrite puts casts between the shapes
        if macs is not None:
            plan[node.name].evidence["macs"] = macs
    stats = apply(typed, plan)
    result = _infer(typed)
    store.release(result)
    info = {
        **summary("onnx", low.name, plan_target.describe(), "inference", keep_io_types, stats, bytes_before,
                  weight_bytes(result)),
        "clamped": stats.clamped,
        **({"opset_upgraded": [upgraded_from, BF16_OPSET]} if upgraded_from is not None else {}),
        **calibration_info,
    }
    _set_model_meta(result, info)
    _warn_if_little_runs_low(plan, refs, plan_target)
    log.info("converted ONNX model to %s for %s: %d nodes planned, %d casts", low, plan_target.name, len(plan),
             stats.casts)
    return Converted(result, store)


HEAVY_OPS = ("MatMul", "Gemm", "Conv", "ConvTranspose", "Attention", "LSTM", "GRU", "RNN", "Einsum")


def missing_low_kernels(model: onnx.ModelProto, target: str, dtype: str) -> tuple[list[str], list[str]] | None:
    """Where ``target``'s runtime has a ``dtype`` kernel for none of ``model``'s heavy ops (MatMul, Conv, ...) that
    read float32 (a value whose type the model does not declare counts as float32):
    those ops, and the other targets that run one of them in ``dtype``. A conversion would keep them all fp32
    and write a model with nothing in ``dtype`` (onnxruntime's CPU provider has no bf16 MatMul, Gemm or Conv).
    None where the target runs one of them, or the model has none."""
    graph = model.graph
    declared = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info, *graph.output)}
    declared.update({t.name: t.data_type for t in graph.initializer})
    # an op whose inputs are all declared in another type (an fp16 model) has nothing to convert
    ops = sorted({n.op_type for n in graph.node if n.domain in ("", "ai.onnx") and n.op_type in HEAVY_OPS
                  and any(declared.get(v, TensorProto.FLOAT) == TensorProto.FLOAT for v in n.input if v)})
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if not ops or opset is None:
        return None
    elem = onnx_target(target, dtype).low.onnx

    def runs(name: str) -> bool:
        kernels = onnx_target(name, dtype).kernels
        at = opset  # a bf16 conversion for a GPU target upgrades the model to BF16_OPSET (convert_skeleton)
        if elem == TensorProto.BFLOAT16 and name != "cpu" and 13 <= opset < BF16_OPSET <= onnxruntime_facts.max_opset():
            at = BF16_OPSET
        return any(kernels.status("", op, at, elem) != "none" for op in ops)

    if runs(target):
        return None
    return ops, [name for name in ONNX_TARGETS if name != target and runs(name)]


def weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the floating-point initializers and Constant tensors of ``model``, subgraphs included."""
    sizes = {TensorProto.FLOAT: 4, TensorProto.FLOAT16: 2, TensorProto.BFLOAT16: 2, TensorProto.DOUBLE: 8}
    total = 0
    for tensor in tensors(model.graph):
        if tensor.data_type in sizes:
            total += math.prod(tensor.dims) * sizes[tensor.data_type]
    return total


def _target(target: object, dtype: object) -> Target:
    try:
        return onnx_target(target, dtype)
    except TypeError:  # an unhashable argument
        raise InputError(f"convert_onnx(target={target!r}, dtype={dtype!r}): pass the target and dtype as "
                         "strings, e.g. target='cuda', dtype='fp16'") from None


def _upgraded(work: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """``work`` at ``opset`` (onnx's version converter), so bf16 plans for GPU targets can run Conv, pooling
    and RNNs low: their ONNX schemas allow bf16 from opset 22 only. ``work`` as it is where that fails."""
    try:
        upgraded = onnx.version_converter.convert_version(work, opset)
    except Exception as err:  # noqa: BLE001 - an op the converter has no adapter for: plan at the model's opset
        log.info("kept opset %s: onnx's version converter could not upgrade the model to %d (%s)",
                 opsets(work).get("", 1), opset, first_line(err))
        return work
    log.info("upgraded the model from opset %s to %d so bf16 Conv, pooling and RNNs can run low",
             opsets(work).get("", 1), opset)
    return upgraded


def _warn_if_little_runs_low(plan: PrecisionPlan, refs: Mapping[str, Any], target: Target) -> None:
    """Say so when the target's missing kernels keep every heavy op fp32: such a plan converts nothing worth
    having (onnxruntime's CPU provider has no bf16 MatMul, Gemm or Conv)."""
    heavy = [name for name in plan if is_heavy(refs[name].node)]
    if heavy and not any(plan[name].precision is Precision.LOW for name in heavy):
        blocked = next((plan[name] for name in heavy if plan[name].evidence.get("no_low_kernel")), None)
        if blocked is not None:
            log.warning("no matrix product or convolution runs in %s on %s: %s; use dtype='fp16' or another "
                        "target", target.low, target.runtime, blocked.reason)


def _load(model: str | os.PathLike | onnx.ModelProto) -> tuple[onnx.ModelProto, str | None, str]:
    """``model`` as a proto (the caller's own, to be read only, or the one read from the path without its
    weights: :mod:`amppass.onnx.io.lazy_read`), the folder its external data lives in, and how messages name it.
    Nesting and size are checked here, before anything walks the model recursively."""
    if isinstance(model, onnx.ModelProto):
        where = "the onnx.ModelProto passed to convert_onnx"
        _check_has_graph(model, where)
        validate.check_size(model, where)
        validate.check_nesting(model, where)
        return model, None, where
    if not isinstance(model, (str, os.PathLike)):
        raise InputError(f"convert_onnx takes a path to a .onnx file or an onnx.ModelProto, not {type(model).__name__}")
    path = os.fspath(model)
    if os.path.isdir(path):
        raise InputError(f"{path!r} is a folder, not a file; pass the path of the .onnx model inside it")
    if not os.path.isfile(path):
        raise InputError(f"{path!r} is not a file (no such path); pass the path of an .onnx model")
    hint = " (it is a zip archive: a PyTorch checkpoint? use amppass.convert or amppass.export_onnx for torch models)"
    try:
        loaded = lazy_read.load(path)
    except InputError as err:  # the file is damaged: the message names it, the byte and the fix
        if zipfile.is_zipfile(path):
            raise InputError(f"{err}{hint}") from None
        raise
    except OSError as err:
        raise InputError(f"{path!r} cannot be read ({err.strerror or err}); check the file's permissions") from err
    except Exception as err:  # protobuf's DecodeError and friends
        raise InputError(f"{path!r} could not be read as an ONNX model ({err}); is it an .onnx file?"
                         f"{hint if zipfile.is_zipfile(path) else ''}") from err
    _check_has_graph(loaded, repr(path))
    validate.check_size(loaded, repr(path))  # the count lazy_read.load made, exact: what it parsed whole included
    validate.check_nesting(loaded, repr(path))
    return loaded, os.path.dirname(os.path.abspath(path)), repr(path)  # large tensors: references into the file


def _check_has_graph(model: onnx.ModelProto, where: str) -> None:
    """Refuse an empty message: protobuf parses an empty or foreign file as a ModelProto with no graph."""
    if model.ir_version == 0 or not model.HasField("graph"):
        raise InputError(f"{where} is not an ONNX model (it holds no IR version or graph); pass a model written "
                         "by torch.onnx.export or another ONNX exporter")


def _infer(model: onnx.ModelProto, strict: bool = False) -> onnx.ModelProto:
    """``model`` with value_info re-inferred (a new proto; ``model`` itself is left as it was).

    ``model`` is a skeleton (:mod:`amppass.onnx.io.weight_store`): its large tensors carry no bytes, so the
    serialisation shape inference does is cheap and stays under protobuf's 2 GB limit. ``strict`` refuses
    a model whose shapes contradict each other (a weight that does not fit its MatMul), which would
    otherwise convert into a model the checker rejects.
    """
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=strict)
    except onnx.shape_inference.InferenceError as err:
        raise InputError(f"onnx shape inference rejects the model ({err}); check it with "
                         "onnx.checker.check_model(model, full_check=True) and fix the reported node") from err


def converted_dtype(model: onnx.ModelProto) -> str | None:
    """The low dtype ("fp16"/"bf16") amppass converted ``model`` to, from its metadata; None if it did not,
    "unknown" where the metadata is damaged (read as the report reads it: :func:`amppass.report.meta.parse`)."""
    for entry in model.metadata_props:
        if entry.key == META_KEY:
            try:
                info = meta.parse(entry.value, "metadata_props['amppass']")
            except InputError:
                return "unknown"
            dtype = info.get("dtype") if isinstance(info, dict) else None
            return dtype if isinstance(dtype, str) else "unknown"
    return None


def _unchanged(work: onnx.ModelProto, store: WeightStore, previous: str, wanted: str, where: str) -> Converted:
    """``work`` as it is (an already converted model), when the caller asks for the dtype it already has."""
    check_reconversion(where, previous, wanted, f"convert the original float32 model with dtype='{wanted}'")
    return Converted(work, store)


def note(model: onnx.ModelProto, key: str, value: Any) -> None:
    """Add ``key: value`` to the conversion's summary stored in ``model`` (what :func:`amppass.report` reads)."""
    for entry in model.metadata_props:
        if entry.key == META_KEY:
            _set_model_meta(model, {**meta.parse(entry.value, "metadata_props['amppass']"), key: value})
            return
    _set_model_meta(model, {key: value})


def _set_model_meta(model: onnx.ModelProto, info: dict) -> None:
    for entry in model.metadata_props:
        if entry.key == META_KEY:
            entry.value = json.dumps(info)
            return
    model.metadata_props.add(key=META_KEY, value=json.dumps(info))
