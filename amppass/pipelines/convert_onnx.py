"""``amppass.convert_onnx``: load, check, analyse, paint, rewrite and re-type an ONNX model, in named stages
(:func:`convert_onnx_streamed` lists them).

Models are read as untrusted files (:mod:`amppass.onnx.io.read_model`): structure and tensors are checked
(:mod:`amppass.onnx.io.validate`) and external data is read only from inside the model's folder
(:mod:`amppass.onnx.io.external_data`). Saving is ``amppass.save`` (:mod:`amppass.pipelines.save`).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import onnx
from onnx import TensorProto

from ..analysis import overrides, precedence
from ..analysis.options import PlanOptions, RewriteOptions
from ..analysis.painting import paint
from ..analysis.plan import Precision, PrecisionPlan
from ..analysis.record import META_KEY, check_reconversion, summary, with_evidence
from ..analysis.view import GraphView
from ..dtypes import Fp8Format, fp8_format
from ..errors import InputError, first_line
from ..files import Staged
from ..onnx import policy
from ..onnx.calibrate import Fp32Model, calibrated_plan
from ..onnx.fp8 import FP8_OPSET, Fp8Rewrite
from ..onnx.io import save as saving
from ..onnx.io import validate
from ..onnx.io.read_model import Loaded, load
from ..onnx.io.weight_store import WeightStore, tensors
from ..onnx.macs import node_macs, operands, value_shapes
from ..onnx.normalize import bypass_weight_identities, initializers_out_of_inputs
from ..onnx.policy import is_heavy
from ..onnx.rewrite import RewriteStats, rewrite
from ..onnx.view import NodeRef, build_view, clear_value_info, name_nodes, opsets
from ..reporting import stored_record
from ..targets import onnxruntime_facts
from ..targets.target import ONNX_TARGETS, Target, onnx_target

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
        dtype: "fp16", "bf16", "auto" (fp16: what every ONNX target runs fastest) or "fp8": the fp16 plan with
            the matrix products (MatMul, Gemm, Conv) the output error allows in e4m3, as
            QuantizeLinear/DequantizeLinear pairs with FLOAT8E4M3FN (opset 19 or later: an older model's opset is
            raised to 19 and the summary says so; :mod:`amppass.onnx.fp8`). fp8 needs ``calibration`` (the
            activations' scales are static, from the ranges observed); ``tolerance`` defaults to
            :data:`FP8_TOLERANCE` there.
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
    fp8 = fp8_format(dtype)
    if fp8 is not None:
        tolerance = fp8_tolerance(calibration, tolerance)
    options = OnnxPlanOptions(keep_io_types=keep_io_types, keep_fp32=keep_fp32, force_low=force_low,
                              low_weight_tables=low_weight_tables, calibration=calibration, tolerance=tolerance,
                              progress=progress)
    return convert_onnx_streamed(model, _target(target, "fp16" if fp8 else dtype), options, fp8).materialized()


FP8_TOLERANCE = 2e-2  # an fp8 plan's output tolerance where the caller gives none


def fp8_tolerance(calibration: object, tolerance: float | None) -> float:
    """The tolerance an fp8 conversion plans with: ``tolerance``, or :data:`FP8_TOLERANCE`; InputError without
    ``calibration``, which the activations' static scales come from."""
    if calibration is None:
        raise InputError("dtype='fp8' needs calibration=[{input name: array, ...}, ...]: the scales of the "
                         "activations an fp8 product reads are static, set from the ranges calibration observes; "
                         "pass a few representative feeds (or use dtype='fp16')")
    return FP8_TOLERANCE if tolerance is None else tolerance


class OnnxPlanOptions(PlanOptions):
    """The :class:`~amppass.analysis.options.PlanOptions` of an ONNX conversion, checked once where it starts
    (:func:`convert_onnx`, the command line). Calibration data is feed dicts, and the messages show that form;
    ``plan_for`` and ``costs`` steer the torch pipeline's speed measurements, which an ONNX plan does not make."""

    CALIBRATION_FORM = "[{input name: array, ...}, ...]"


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


def convert_onnx_streamed(model: str | os.PathLike | onnx.ModelProto | Loaded, target: Target,
                          options: OnnxPlanOptions, fp8: Fp8Format | None = None) -> Converted:
    """:func:`convert_onnx` without writing the payloads into the result: what the CLI saves from, streaming
    each tensor from the store, so a conversion and its save hold no second copy of the model.

    The stages, in order, each a function below that says what it takes and gives:

    1. :func:`read_checked`: the model read and checked, as the private skeleton the stages work on (a model amppass
       converted before comes back as it is, or is refused);
    2. :func:`at_loadable_opset`: the opset the plan is made at, refused where the runtime cannot load it;
    3. :func:`normalize_graph`: nodes named, initializers out of the inputs, weight Identities bypassed;
    4. :func:`infer_types`: value types inferred, refused where the target runs none of the heavy ops low;
    5. :func:`neutral_view`: the neutral view the analysis plans on;
    6. :func:`plan_precision`: user overrides and quantized sections, calibration when given, painting;
    7. :func:`add_evidence`: what the report shows beside each decision;
    8. :func:`rewrite_and_retype`: casts and low weights written in, types re-inferred, IR version capped;
    9. :func:`record`: the summary stored in the model for ``amppass.report``.

    ``fp8`` (:func:`amppass.dtypes.fp8_format` of the caller's dtype) plans fp16 with products in that format
    (:mod:`amppass.onnx.fp8`): stage 2 raises the opset to :data:`~amppass.onnx.fp8.FP8_OPSET`, stage 6 chooses
    the products, stage 8 writes their Q/DQ pairs and stage 9 records them.
    """
    work = read_checked(model, target, options)
    work.fp8 = fp8
    previous = converted_dtype(work.model)
    if previous is not None:
        return _unchanged(work, previous)
    at_loadable_opset(work)
    normalize_graph(work)
    infer_types(work)
    viewed = neutral_view(work)
    plan, calibration_info = plan_precision(work, viewed)
    plan = add_evidence(work, viewed, plan)
    stats = rewrite_and_retype(work, viewed, plan)
    record(work, viewed, plan, stats, calibration_info)
    return Converted(work.model, work.store)


@dataclass
class ConversionState:
    """What one conversion carries from stage to stage: the model the stages work on (the private skeleton, then
    its typed and finally its rewritten form), the store holding its payloads, and how messages name it."""

    model: onnx.ModelProto
    store: WeightStore
    where: str
    target: Target
    options: OnnxPlanOptions
    fp8: Fp8Format | None = None  # the format of the fp8 products of an fp8 plan
    upgraded_from: int | None = None  # the opset the model imported, where :func:`at_loadable_opset` upgraded it
    upgraded_to: int | None = None
    bytes_before: int = 0  # weight bytes before the rewrite, for the summary


@dataclass(frozen=True)
class NeutralView:
    """The neutral view of the typed model, where each view node lives in it, and its value types."""

    view: GraphView
    refs: dict[str, NodeRef]
    types: dict[str, int]


def read_checked(model: str | os.PathLike | onnx.ModelProto | Loaded, target: Target,
                 options: OnnxPlanOptions) -> ConversionState:
    """Stage 1, read and check: ``model`` (a path, a proto, or what :func:`load` read) gives the
    :class:`ConversionState` of a
    conversion, whose model is a private skeleton (its payloads in a weight store), single assignment and graph
    order checked (an out-of-order graph sorted) and ``dim_value: -1`` made dynamic."""
    loaded = model if isinstance(model, Loaded) else load(model)
    store = WeightStore(loaded.base_dir, loaded.where, owns_source=loaded.owned)
    skeleton = store.skeleton(loaded.model)  # the private copy the conversion works on; payloads stay in the store
    validate.check_order(skeleton, loaded.where)
    validate.dynamic_negative_dims(skeleton)
    return ConversionState(skeleton, store, loaded.where, target, options)


def at_loadable_opset(work: ConversionState) -> None:
    """Stage 2: ``work.model`` at the opset the plan is made at: upgraded to :data:`BF16_OPSET` for a bf16 plan on
    a GPU target (:func:`upgrades_for_bf16`), and to :data:`~amppass.onnx.fp8.FP8_OPSET` for an fp8 plan of an
    older model, setting ``work.upgraded_from``; InputError for a bf16 plan below opset 13, an fp8 plan whose
    model cannot be raised to opset 19, or an opset the installed onnxruntime does not load."""
    low = work.target.low
    opset = opsets(work.model).get("", 1)
    wanted = BF16_OPSET if upgrades_for_bf16(low.onnx, work.target.name, opset) else \
        FP8_OPSET if work.fp8 is not None and opset < FP8_OPSET else None
    if wanted is not None:
        work.model, work.upgraded_from, work.upgraded_to = _upgraded(work.model, wanted), opset, wanted
        opset = opsets(work.model).get("", 1)
    if work.fp8 is not None and opset < FP8_OPSET:
        raise InputError(f"dtype='fp8' needs opset {FP8_OPSET} or later (QuantizeLinear with FLOAT8E4M3FN); "
                         f"{work.where} imports opset {opset} and onnx's version converter could not raise it: "
                         f"re-export it with opset_version={FP8_OPSET} or later")
    if low.onnx == TensorProto.BFLOAT16 and opset < 13:
        raise InputError(f"bf16 needs opset 13 or later for Cast; this model imports opset {opset}. "
                         "Re-export it with a newer opset or use dtype='fp16'")
    if opset > onnxruntime_facts.max_opset():
        raise InputError(f"the model imports opset {opset} but the installed onnxruntime loads at most "
                         f"{onnxruntime_facts.max_opset()}; re-export with opset <= {onnxruntime_facts.max_opset()}")


def normalize_graph(work: ConversionState) -> None:
    """Stage 3, on ``work.model`` in place: every node named uniquely, initializers an old IR version lists among
    the inputs taken out of them, and Identity nodes between a weight and its readers bypassed."""
    name_nodes(work.model)
    initializers_out_of_inputs(work.model)
    bypass_weight_identities(work.model)


def infer_types(work: ConversionState) -> None:
    """Stage 4: ``work.model`` with its value types inferred (strictly: shapes that contradict each other are an
    InputError), and ``work.bytes_before`` counted. InputError where the target's runtime runs none of the model's
    heavy ops in the low dtype (:func:`missing_low_kernels`)."""
    work.bytes_before = weight_bytes(work.model)
    work.model = _infer(work.model, strict=True)
    target, low = work.target, work.target.low
    missing = missing_low_kernels(work.model, target.name, low.name)
    if missing is not None:  # the command line refuses the same request (amppass.cli), in its flags' words
        ops, able = missing
        fix = " or ".join(f"target={name!r}" for name in able)
        raise InputError(
            f"dtype={low.name!r} with target={target.name!r}: {target.runtime} has no {low.name} kernel for "
            f"{', '.join(ops)}, so the converted model would run all of them in fp32, with nothing in {low.name}; "
            + (f"pass {fix} to convert for where the model runs, or " if able else "")
            + f"convert with dtype={'fp16' if low.name == 'bf16' else 'bf16'!r}")


def neutral_view(work: ConversionState) -> NeutralView:
    """Stage 5: the neutral view of the typed ``work.model`` for the target (weights' largest magnitudes read from
    the store where the low dtype's range is narrow), with each view node's place in the model and the value
    types."""
    store, low = work.store, work.target.low
    return NeutralView(*build_view(work.model, work.target, None if low.wide_range else store.absmax, store.array))


def plan_precision(work: ConversionState, viewed: NeutralView) -> tuple[PrecisionPlan, dict[str, Any]]:
    """Stage 6: the precision plan of ``viewed`` and what to record about calibration. The user's overrides over the
    quantized (QDQ) sections (:func:`amppass.analysis.precedence.pinned`), then the range rules and the tolerance
    search where calibration data is given (the search's trials rewritten by :func:`rewriter`), then painting."""
    options, low = work.options, work.target.low
    carried = policy.quantized_nodes(work.model.graph)
    pinned = precedence.pinned(user=overrides.resolve(viewed.view, options.keep_fp32, options.force_low, low),
                               carried=carried)
    if options.calibration is None:
        return paint(viewed.view, low, pinned, low_weight_tables=options.low_weight_tables), {"calibrated": False}
    return calibrated_plan(
        Fp32Model(work.model, viewed.view, viewed.refs, viewed.types, work.store), options.calibration, work.target,
        pinned, apply=rewriter(work, viewed), tolerance=options.tolerance, progress=options.progress,
        low_weight_tables=options.low_weight_tables, fp8=work.fp8)


def add_evidence(work: ConversionState, viewed: NeutralView, plan: PrecisionPlan) -> PrecisionPlan:
    """Stage 7: ``plan`` as the model stores it, each planned node's decision with what the report shows beside it
    (:func:`amppass.analysis.record.with_evidence`): the policy's facts, whether its op is unknown, and its
    multiply-accumulates (counted on the typed model, before the rewrite puts casts between the shapes)."""
    refs = viewed.refs
    shapes = value_shapes(work.model, {v for ref in refs.values() if is_heavy(ref.node) for v in operands(ref.node)})
    planned = [node.name for node in viewed.view.nodes if node.name in plan]
    return with_evidence(plan, viewed.view, {name: node_macs(refs[name].node, shapes) for name in planned},
                         facts={name: refs[name].evidence for name in planned})


def rewrite_and_retype(work: ConversionState, viewed: NeutralView, plan: PrecisionPlan) -> RewriteStats:
    """Stage 8: ``work.model`` rewritten by ``plan`` (:func:`rewriter`), then typed again, a new proto; the store
    drops the payloads no tensor reads any more. Gives what the rewrite did."""
    stats = rewriter(work, viewed)(work.model, plan)
    work.model = _infer(work.model)
    work.store.release(work.model)
    return stats


def rewriter(work: ConversionState, viewed: NeutralView) -> Callable[[onnx.ModelProto, PrecisionPlan], RewriteStats]:
    """The rewrite of a conversion as a function of (model, plan): it rewrites the model (the typed ``work.model``,
    or a copy for a tolerance trial) in place by the plan, loadable as it is: casts on edges, weights stored low,
    stale value types cleared, the IR version raised to hold node metadata and capped to what onnxruntime reads."""
    low, options = work.target.low, RewriteOptions(keep_io_types=work.options.keep_io_types)
    fp8 = Fp8Rewrite(work.store, work.fp8, low) if work.fp8 is not None else None

    def apply(target: onnx.ModelProto, plan: PrecisionPlan) -> RewriteStats:
        if fp8 is not None:
            fp8.weights(target, plan)
        done = rewrite(target, plan, viewed.refs, viewed.types, set(viewed.view.weights), work.store, low, options)
        if fp8 is not None:
            fp8.insert(target, plan)
        clear_value_info(target.graph)
        target.ir_version = min(max(target.ir_version, IR_WITH_NODE_METADATA), onnxruntime_facts.max_ir_version())
        return done

    return apply


def record(work: ConversionState, viewed: NeutralView, plan: PrecisionPlan, stats: RewriteStats,
           calibration_info: dict[str, Any]) -> None:
    """Stage 9: the conversion's summary stored in ``work.model`` (what ``amppass.report`` reads back with each
    node's decision); a warning where the target's missing kernels keep every heavy op fp32."""
    target, low = work.target, work.target.low
    info = {
        **summary("onnx", low.name, target.describe(), "inference", work.options.keep_io_types, stats,
                  work.bytes_before, weight_bytes(work.model)),
        "clamped": stats.clamped,
        **({"opset_upgraded": [work.upgraded_from, work.upgraded_to]} if work.upgraded_from is not None else {}),
        **calibration_info,
    }
    _set_model_meta(work.model, info)
    _warn_if_little_runs_low(plan, viewed.refs, target)
    log.info("converted ONNX model to %s for %s: %d nodes planned, %d casts", low, target.name, len(plan),
             stats.casts)


def missing_low_kernels(model: onnx.ModelProto, target: str, dtype: str) -> tuple[list[str], list[str]] | None:
    """Where ``target``'s runtime has a ``dtype`` kernel for none of ``model``'s heavy ops (MatMul, Conv, ...:
    :data:`amppass.onnx.policy.HEAVY_OPS`) that read float32 (a value whose type the model does not declare counts as
    float32): those ops, and the other targets that run one of them in ``dtype``. A conversion would keep them all fp32
    and write a model with nothing in ``dtype`` (onnxruntime's CPU provider has no bf16 MatMul, Gemm or Conv).
    None where the target runs one of them, or the model has none."""
    graph = model.graph
    declared = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info, *graph.output)}
    declared.update({t.name: t.data_type for t in graph.initializer})
    # an op whose inputs are all declared in another type (an fp16 model) has nothing to convert
    ops = sorted({n.op_type for n in graph.node if is_heavy(n)
                  and any(declared.get(v, TensorProto.FLOAT) == TensorProto.FLOAT for v in n.input if v)})
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if not ops or opset is None:
        return None
    elem = onnx_target(target, dtype).low.onnx

    def runs(name: str) -> bool:
        kernels = onnx_target(name, dtype).kernels
        at = BF16_OPSET if upgrades_for_bf16(elem, name, opset) else opset  # as the conversion plans
        return any(kernels.status("", op, at, elem) != "none" for op in ops)

    if runs(target):
        return None
    return ops, [name for name in ONNX_TARGETS if name != target and runs(name)]


def upgrades_for_bf16(elem: int, target: str, opset: int) -> bool:
    """Whether a conversion to ``elem`` for ``target`` plans a model importing ``opset`` at :data:`BF16_OPSET`
    (:func:`at_loadable_opset`): a bf16 plan for a GPU target, from opset 13 (bf16 Cast), where the installed
    onnxruntime loads that opset."""
    return (elem == TensorProto.BFLOAT16 and target != "cpu"
            and 13 <= opset < BF16_OPSET <= onnxruntime_facts.max_opset())


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
    """The low dtype ("fp16"/"bf16", "fp8" for an fp8 plan) amppass converted ``model`` to, from its metadata; None
    if it did not, "unknown" where the metadata is damaged (read as the report reads it:
    :func:`amppass.reporting.stored_record.parse`)."""
    for entry in model.metadata_props:
        if entry.key == META_KEY:
            try:
                info = stored_record.parse(entry.value, "metadata_props['amppass']")
            except InputError:
                return "unknown"
            dtype = info.get("dtype") if isinstance(info, dict) else None
            return "unknown" if not isinstance(dtype, str) else "fp8" if isinstance(info.get("fp8"), dict) else dtype
    return None


def _unchanged(work: ConversionState, previous: str) -> Converted:
    """``work.model`` as it is (a model amppass converted to ``previous``), when the caller asks for the dtype it
    already has; InputError otherwise (:func:`amppass.analysis.record.check_reconversion`)."""
    wanted = "fp8" if work.fp8 is not None else work.target.low.name
    check_reconversion(work.where, previous, wanted, f"convert the original float32 model with dtype='{wanted}'")
    return Converted(work.model, work.store)


def note(model: onnx.ModelProto, key: str, value: Any) -> None:
    """Add ``key: value`` to the conversion's summary stored in ``model`` (what :func:`amppass.report` reads)."""
    for entry in model.metadata_props:
        if entry.key == META_KEY:
            _set_model_meta(model, {**stored_record.parse(entry.value, "metadata_props['amppass']"), key: value})
            return
    _set_model_meta(model, {key: value})


def _set_model_meta(model: onnx.ModelProto, info: dict) -> None:
    for entry in model.metadata_props:
        if entry.key == META_KEY:
            entry.value = json.dumps(info)
            return
    model.metadata_props.add(key=META_KEY, value=json.dumps(info))
