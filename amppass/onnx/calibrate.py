"""Calibration for the ONNX front end, run through onnxruntime (CPUExecutionProvider): its half of the template
of :mod:`amppass.analysis.calibration`.

:func:`calibrated_plan` is where ``amppass.convert_onnx(..., calibration=...)`` plans from calibration feeds:
:func:`calibrate` runs the template's data pass with :class:`OnnxRunner`, then
:func:`~amppass.analysis.calibration.plan_from_calibration` applies the range rules, user overrides, painting
and, with a tolerance, the search, whose runs are :class:`OnnxTrials`'.

Data pass: the fp32 model (the conversion's typed skeleton, not yet rewritten) gets extra graph outputs for
every tracked fp32 value of its main graph and goes into one session; its weights reach onnxruntime as
arrays from the conversion's :class:`~amppass.onnx.io.weight_store.WeightStore`, never serialised (so models with
external data or over protobuf's 2 GB work too). Each batch runs once and every value is folded into streaming
:class:`~amppass.analysis.stats.CalibrationStats` before the next batch runs, so memory is one batch's
values whatever the number of batches. Values defined inside If/Loop/Scan bodies cannot be graph outputs:
they are not observed, counted in the metadata (``calibration_unobserved``) and logged. Graph inputs are
read from the feeds themselves.

Local error (for the tolerance search's ranking): ONE replay model holds a copy of every LOW or FOLLOW node
of the main graph. A copy reads the values the data pass recorded on the first batch (fed as graph
inputs; weights and Constant nodes copied), with the inputs the plan would cast rounded to the low dtype
(Cast to low and back), computes in fp32 and rounds its outputs likewise; its local error is
``relative_error(replayed, recorded)``. One session and one run measure every node, and they run on the
CPU provider even where it has no fp16 kernel for an op, as a GPU kernel with fp32 accumulation computes.
Where the target is that CPU provider (its tolerance trials run there), a node it has no low-precision
kernel for is replayed as the provider runs it: it casts around the node's fp32 kernel and removes the
cast pairs this leaves between such nodes, so of that node only the weights are stored low; its copy
rounds its weights alone. A node that reads values its replayed producers store low also gets a reference
copy, computed in fp32 on those same rounded values: against it, the replay gives the error the node adds
itself (a reshape adds none), which the search ranks by; the local error, against the fp32 model, is what
the report shows. A node whose inputs were not recorded (an untyped value) is not replayed and ranks last.
The same run records the L2 norm of every observed value, from which the search estimates
how far each node's error travels (:mod:`amppass.analysis.propagation`).

Tolerance: each trial (:class:`OnnxTrials`) rewrites a copy of the fp32 model by the trial plan (the
conversion's own rewrite) and runs it on the kept feeds as the target computes it, from the fp32 values the
data pass kept where its first nodes are the fp32 model's (:mod:`amppass.onnx.trial_runs`); the template takes
the largest relative error of any floating output against the fp32 outputs of the data pass. For the CPU
target the trial runs as it is in onnxruntime's CPU provider, with its default graph optimisations: what the
user will run. For targets this machine cannot run (CUDA, TensorRT) the trial is first turned into its fp32
simulation (:mod:`amppass.onnx.simulate`: fp16 storage of every low value, read from the trial model's own
types).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import onnx
from onnx import external_data_helper, helper

from ..analysis.calibration import (
    Calibration,
    Perturbation,
    Trials,
    check_tolerance,
    plan_from_calibration,
    record,
    relative_error,
)
from ..analysis.plan import Category, Decision, PrecisionPlan
from ..analysis.stats import CalibrationStats
from ..analysis.view import GraphView
from ..dtypes import Fp8Format
from ..errors import CalibrationError, first_line
from ..targets import onnxruntime_facts
from ..targets.target import Target
from . import fp8 as fp8_products
from .io.weight_store import WeightStore, tensors
from .rewrite import all_names, unique_name
from .simulate import rounding, simulate
from .trial_runs import Checkpoints
from .view import FLOAT, NodeRef, all_nodes, subgraphs
from .view import dims as value_dims

log = logging.getLogger(__name__)

_FIX = ("pass calibration=[{input name: numpy array, ...}, ...]: one dict per batch with an array for every "
        "model input, typed and shaped like that input")
# element types whose store payload is the numpy array onnxruntime expects (bf16 payloads are raw uint16)
_INJECT = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE})
Apply = Callable[[onnx.ModelProto, PrecisionPlan], Any]
Feed = dict[str, np.ndarray]  # a batch: input name -> array


@dataclass
class Fp32Model:
    """The typed fp32 model a conversion works on (a skeleton of :mod:`amppass.onnx.io.weight_store`), before any
    rewrite, with what :func:`amppass.onnx.view.build_view` found in it."""

    model: onnx.ModelProto
    view: GraphView
    refs: Mapping[str, NodeRef]
    types: Mapping[str, int]
    store: WeightStore


@dataclass
class OnnxCalibration(Calibration[Feed]):
    """What one pass over the calibration feeds recorded, with what is the ONNX front end's own."""

    unobserved: list[str] = field(default_factory=list)  # fp32 values onnxruntime cannot return
    output_names: list[str] = field(default_factory=list)  # the floating graph outputs compared
    checkpoints: Checkpoints | None = None  # fp32 values kept for the tolerance search's runs


def calibrated_plan(
    fp32: Fp32Model,
    calibration: Iterable[Mapping[str, Any]],
    target: Target,
    given: Mapping[str, Decision],
    *,
    apply: Apply,
    tolerance: float | None = None,
    progress: bool = False,
    low_weight_tables: bool = False,
    fp8: Fp8Format | None = None,
) -> tuple[PrecisionPlan, dict[str, Any]]:
    """The plan from calibration feeds and the metadata to record about it.

    ``fp32.model`` is left as it was; ``apply(copy, plan)`` rewrites a copy of it in place the way the
    conversion does, for the tolerance search's trial runs, judged as ``target`` computes (module docstring).
    With ``fp8`` (and a tolerance), matrix products of the plan go fp8 where the output error allows
    (:func:`amppass.onnx.fp8.choose`, whose trials ``apply`` writes the Q/DQ pairs of); the metadata's ``fp8``
    says what it chose.
    """
    check_tolerance(tolerance)
    low = target.low
    data = calibrate(fp32, calibration, replay=low.onnx if tolerance is not None else None,
                     keep=tolerance is not None, progress=progress, casts_around=target.judge == "runtime")
    trials = OnnxTrials(fp32, data, target, apply)
    plan, info = plan_from_calibration(fp32.view, data, low, given, trials=trials,
                                       tolerance=tolerance, low_weight_tables=low_weight_tables, progress=progress)
    if fp8 is not None and tolerance is not None:
        found, excluded = fp8_products.candidates(fp32.model, plan, data.stats, fp32.store, fp8, low)
        plan, chosen = fp8_products.choose(found, excluded, plan, trials, tolerance, fp8, low, target.runtime)
        info["fp8"] = fp8_products.record(plan, fp32.model, data.kept[0], fp8, low, chosen)
        if info["fp8"]["products"]["fp8"]:  # the converted model's error is the fp8 plan's, judged on no held-out
            info.update(achieved_error=info["fp8"]["output_error"], held_out_error=None,  # batch: by its bound
                        tolerance_met=info.get("tolerance_met", True) and info["fp8"]["tolerance_met"])
    if data.unobserved:
        info["calibration_unobserved"] = len(data.unobserved)
    if tolerance is not None:
        info["error_judged_by"] = target.runtime if target.judge == "runtime" else "fp16-storage simulation"
    return plan, info


def calibrate(
    fp32: Fp32Model,
    calibration: Iterable[Mapping[str, Any]],
    *,
    replay: int | None = None,
    keep: bool = False,
    progress: bool = False,
    casts_around: bool = False,
) -> OnnxCalibration:
    """Run ``fp32.model`` on every feed and record per-value statistics (module docstring).

    ``replay`` (TensorProto.FLOAT16 or BFLOAT16) also measures each LOW or FOLLOW node's local error on the
    first feed; ``casts_around`` replays the nodes onnxruntime's CPU provider runs through fp32 kernels as it
    computes them (module docstring); ``keep`` keeps the feeds and their fp32 outputs for the tolerance search.
    """
    runner = OnnxRunner(fp32, replay, keep, casts_around)
    result = record(runner, calibration, keep=keep, progress=progress)
    log.info("calibrated on %d batches in %.2fs (%d values observed)", result.batches, result.seconds,
             len(runner.observed))
    return result


class OnnxRunner:
    """The data pass's ONNX half (:class:`~amppass.analysis.calibration.Runner`): one onnxruntime session of the
    fp32 model with every observed value, the replayed nodes' inputs and the checkpoints' values added as
    outputs (module docstring)."""

    def __init__(self, fp32: Fp32Model, replay: int | None, keep: bool, casts_around: bool):
        model, view, types, store = fp32.model, fp32.view, fp32.types, fp32.store
        graph = model.graph
        self.fp32, self.replay, self.casts_around = fp32, replay, casts_around
        self.inputs = {i.name for i in graph.input}
        defined = {v for node in graph.node for v in node.output if v}
        tracked = [v for v in dict.fromkeys(v for n in view.nodes for v in n.inputs + n.outputs)
                   if v not in view.weights]
        self.data = OnnxCalibration(CalibrationStats())
        self.data.unobserved = [v for v in tracked if v not in self.inputs and (v not in defined or v not in types)]
        if self.data.unobserved:
            log.info("calibration: %d fp32 values are not observed (inside If/Loop/Scan bodies or untyped), e.g. %s",
                     len(self.data.unobserved), self.data.unobserved[:3])
        self.observed = [v for v in tracked if v not in self.data.unobserved]
        self.candidates = _candidates(model, view, types) if replay is not None else {}
        if keep:
            self.data.checkpoints = Checkpoints(model, (n.name for n in view.nodes if n.category in (
                Category.LOW, Category.FOLLOW)), types)
        kept_values = self.data.checkpoints.wanted() if self.data.checkpoints is not None else []
        recorded = list(dict.fromkeys(v for v in self.observed + [v for vs in self.candidates.values() for v in vs]
                                      + kept_values if v not in self.inputs))
        self.outputs = [o.name for o in graph.output]
        extra = [helper.make_tensor_value_info(v, types[v], None) for v in recorded if v not in self.outputs]
        try:
            self.session = _session(model, store, extra)
        except Exception as err:
            raise CalibrationError(f"{store.where}: onnxruntime cannot load the float32 model to calibrate it "
                                   f"({first_line(err)}); check that the model runs in onnxruntime") from err
        self.first_names = list(dict.fromkeys(self.outputs + recorded))  # batch 0 also returns the replay's inputs
        self.names = list(dict.fromkeys(self.outputs + [v for v in self.observed + kept_values
                                                        if v not in self.inputs]))
        self.first: dict[str, np.ndarray] = {}  # batch 0's values, which the replay reads

    def batches(self, calibration: Iterable[Mapping[str, Any]]) -> Iterator[tuple[int, Feed]]:
        """The validated feeds (:func:`feeds`)."""
        return feeds(self.fp32.model, calibration)

    def run(self, index: int, feed: Feed, kept: int | None) -> list[np.ndarray] | None:
        """Feed ``index`` through the session, every observed value folded into the statistics (and their
        norms on the replayed feed 0), the checkpoints' values kept under ``kept``; the floating outputs of a
        kept feed."""
        data, replayed = self.data, index == 0 and self.replay is not None
        wanted = self.first_names if replayed else self.names
        try:
            values = dict(zip(wanted, self.session.run(wanted, feed), strict=False))
        except Exception as err:
            raise CalibrationError(f"calibration batch {index}: the fp32 model failed on it in onnxruntime "
                                   f"({first_line(err)}); {_FIX}") from err
        values.update(feed)
        for value in self.observed:
            data.stats.update(value, values[value])
        if replayed:
            self.first = values
            data.norms = {v: _norm(values[v]) for v in self.observed if np.issubdtype(values[v].dtype, np.floating)}
        data.stats.batches += 1
        if kept is None:
            return None
        data.output_names = [o for o in self.outputs if np.issubdtype(values[o].dtype, np.floating)]
        data.checkpoints.record(kept, values)
        return [values[o] for o in data.output_names]

    def finish(self) -> None:
        """The local errors, replayed on feed 0's recorded values (module docstring)."""
        if self.replay is not None:
            self.data.local_error, self.data.added_error = local_errors(
                self.fp32.model, self.fp32.refs, self.fp32.store, self.candidates, self.first, self.replay,
                self.casts_around)


class OnnxTrials(Trials[Feed]):
    """The tolerance search's runs: a copy of the fp32 model rewritten by the trial plan, run as ``target``
    computes it (module docstring) on the kept feeds."""

    data: OnnxCalibration

    def __init__(self, fp32: Fp32Model, data: OnnxCalibration, target: Target, apply: Apply):
        super().__init__(data)
        self.fp32, self.target, self.apply = fp32, target, apply

    def checkpoints(self) -> list[Checkpoints]:
        """The main graph's checkpoints (:mod:`amppass.onnx.trial_runs`)."""
        return [self.data.checkpoints] if self.data.checkpoints is not None else []

    def run(self, plan: PrecisionPlan, decisions: Mapping[str, Decision],
            batches: Sequence[int]) -> Iterator[tuple[int, list[np.ndarray] | None]]:
        """The trial model, or its part from the checkpoint a group of feeds resumes from, in one session per
        group (its fp16-storage simulation where this machine does not run the target)."""
        trial = _TrialRun(self, plan)
        starts: dict[int | None, list[int]] = {}  # checkpoint position (None: the whole trial) -> feeds
        for batch in batches:
            starts.setdefault(trial.start(batch), []).append(batch)
        for start, group in starts.items():
            yield from zip(group, trial.outputs(start, group), strict=False)

    def judge(self, plan: PrecisionPlan, decisions: Mapping[str, Decision]) -> Callable[[int], float]:
        """:meth:`errors` of one batch at a time, from one trial model, each session (one per checkpoint a batch
        resumes from) built at its first batch and kept for the next."""
        trial = _TrialRun(self, plan)
        return lambda batch: self.batch_error(batch, trial.outputs(trial.start(batch), [batch])[0])

    def noisy(self, feed: Feed) -> bool:
        """Whether an array of ``feed`` gets noise (:func:`_noisy`)."""
        return any(_noisy(v) for v in feed.values())

    def perturb(self, feed: Feed, how: Perturbation) -> Feed:
        """``feed`` with each noisy array perturbed by ``how``."""
        return {name: how.apply(v) if _noisy(v) else v for name, v in feed.items()}

    def references(self, feeds: list[Feed]) -> list[list[np.ndarray]]:
        """The fp32 model's floating outputs on ``feeds``, in one session."""
        session = _session(self.fp32.model, self.fp32.store)
        return [session.run(self.data.output_names, feed) for feed in feeds]


def _noisy(value: np.ndarray) -> bool:
    """Whether a perturbed copy adds noise to ``value``: a floating array of more than one element."""
    return value.dtype.kind == "f" and value.size > 1


class _TrialRun:
    """One trial of :class:`OnnxTrials`: the fp32 model rewritten by its plan, and a session per checkpoint it
    resumes from (None: the whole trial), each built at its first run."""

    def __init__(self, trials: OnnxTrials, plan: PrecisionPlan):
        self.trials, self.model = trials, onnx.ModelProto()
        self.model.CopyFrom(trials.fp32.model)
        trials.apply(self.model, plan)
        kept = trials.data.checkpoints
        self.cut = kept.trial_cut(self.model) if kept is not None else None
        self.sessions: dict[int | None, Callable[[list[Feed]], list[list[np.ndarray] | None]]] = {}

    def start(self, batch: int) -> int | None:
        """The checkpoint position ``batch`` resumes from (None: the whole trial runs)."""
        kept = self.trials.data.checkpoints
        return kept.resume(batch, self.cut) if kept is not None else None

    def outputs(self, start: int | None, group: list[int]) -> list[list[np.ndarray] | None]:
        """The floating outputs on the feeds ``group``, all resuming from ``start``."""
        trials, kept = self.trials, self.trials.data.checkpoints
        if start not in self.sessions:
            model = self.model if start is None or kept is None else kept.suffix(self.model, start)
            runtime = trials.target.judge == "runtime"
            self.sessions[start] = trial_session(model if runtime else simulate(model, trials.fp32.store),
                                                 trials.fp32.store, trials.data.output_names, optimized=runtime)
        if kept is not None:
            kept.count(start or 0, len(self.model.graph.node), len(group))
        return self.sessions[start]([{**trials.data.kept[b], **(kept.values[b][start] if start is not None and
                                                                kept is not None else {})} for b in group])


def trial_session(model: onnx.ModelProto, store: WeightStore, names: list[str],
                  optimized: bool = False) -> Callable[[list[Feed]], list[list[np.ndarray] | None]]:
    """``model``'s floating outputs ``names`` on feeds, from one session (each None when onnxruntime cannot run
    it); ``optimized`` runs it with onnxruntime's default graph optimisations, as a user's session would."""
    try:
        session = _session(model, store, optimized=optimized)
    except Exception as err:  # noqa: BLE001 - a trial onnxruntime rejects is a failed trial, not a crash
        return functools.partial(_not_run, err)  # err is unbound after the except block: bind it now

    def run(feeds: list[Feed]) -> list[list[np.ndarray] | None]:
        try:
            return [session.run(names, feed) for feed in feeds]
        except Exception as err:  # noqa: BLE001 - as above
            return _not_run(err, feeds)

    return run


def _not_run(err: Exception, feeds: list[Feed]) -> list[list[np.ndarray] | None]:
    """No outputs for ``feeds`` of a trial onnxruntime did not run, said in a warning."""
    log.warning("tolerance search: a trial model did not run in onnxruntime (%s)", first_line(err))
    return [None] * len(feeds)


def feeds(model: onnx.ModelProto, calibration: Iterable[Mapping[str, Any]]) -> Iterator[tuple[int, dict]]:
    """Validated feeds ``(index, {input name: array})``; CalibrationError names the batch, input and fix."""
    if calibration is None or isinstance(calibration, (Mapping, str, bytes, np.ndarray)) or not hasattr(
            calibration, "__iter__"):
        hint = " (a single feed dict: wrap it in a list)" if isinstance(calibration, Mapping) else ""
        raise CalibrationError(f"calibration must be an iterable of feed dicts, got "
                               f"{type(calibration).__name__}{hint}; {_FIX}")
    initializers = {t.name for t in model.graph.initializer}
    declared = {i.name: i for i in model.graph.input}
    required = [n for n in declared if n not in initializers]
    index = -1
    for index, feed in enumerate(calibration):
        where = f"calibration batch {index}"
        if not isinstance(feed, Mapping):
            raise CalibrationError(f"{where}: expected a dict of input name -> numpy array, got "
                                   f"{type(feed).__name__}; {_FIX}")
        missing = [n for n in required if n not in feed]
        extra = sorted(str(n) for n in feed if n not in declared)
        if missing or extra:
            problem = f"no array for input(s) {missing}" if missing else f"{extra} are not inputs of the model"
            raise CalibrationError(f"{where}: {problem}; the model's inputs are {required}; {_FIX}")
        yield index, {name: _checked(where, declared[name], value) for name, value in feed.items()}
    if index < 0:
        raise CalibrationError(f"calibration is empty: it yielded no feeds; {_FIX}")


def _checked(where: str, info: onnx.ValueInfoProto, value: Any) -> np.ndarray:
    """``value`` as a numpy array, checked against the graph input ``info``: dtype, rank, fixed sizes, finite."""
    where = f"{where}, input {info.name!r}"
    array = value if isinstance(value, np.ndarray) else np.asarray(value)
    tensor = info.type.tensor_type
    if not info.type.HasField("tensor_type"):
        return array
    wanted = helper.tensor_dtype_to_np_dtype(tensor.elem_type)
    if array.dtype != wanted:
        raise CalibrationError(f"{where}: dtype {array.dtype}, but the model's input is {wanted}; convert it "
                               f"with .astype(np.{wanted.name})")
    if tensor.HasField("shape"):
        dims = value_dims(info)
        if array.ndim != len(dims) or any(d is not None and d != s for d, s in zip(dims, array.shape, strict=False)):
            shown = ["?" if d is None else d for d in dims]
            raise CalibrationError(f"{where}: shape {array.shape} does not fit the model's input shape {shown} "
                                   "(? is any size); pass batches shaped like the model's input")
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        kind = "NaN" if np.isnan(array).any() else "inf"
        raise CalibrationError(f"{where}: holds {kind}; calibration data must be finite: drop or clean that "
                               "batch (e.g. np.nan_to_num) before passing it")
    return array


def _norm(values: np.ndarray) -> float:
    """L2 norm, summed in float64 (a float32 sum of squares overflows past 1.8e19)."""
    return float(np.linalg.norm(values.reshape(-1).astype(np.float64)))


# -- local error -------------------------------------------------------------------------------------

def _candidates(model: onnx.ModelProto, view: GraphView, types: Mapping[str, int]) -> dict[str, list[str]]:
    """LOW/FOLLOW nodes of the main graph that can be replayed -> the run-time values they read."""
    graph = model.graph
    nodes = {n.name: n for n in graph.node}
    fixed = {t.name for t in graph.initializer} | {n.output[0] for n in graph.node if n.op_type == "Constant"}
    result = {}
    for op in view.nodes:
        node = nodes.get(op.name)
        if op.category not in (Category.LOW, Category.FOLLOW) or not op.outputs or node is None:
            continue
        read = [v for v in node.input if v and v not in fixed]
        if any(True for _ in subgraphs(node)) or any(v not in types for v in read):
            continue
        result[op.name] = read
    return result


def local_errors(model: onnx.ModelProto, refs: Mapping[str, NodeRef], store: WeightStore,
                 candidates: Mapping[str, list[str]], recorded: Mapping[str, np.ndarray], low: int,
                 casts_around: bool = False) -> tuple[dict[str, float], dict[str, float]]:
    """Each candidate's relative output error replayed with low-precision inputs, weights and outputs (only
    weights for the nodes onnxruntime's CPU provider casts around, with ``casts_around``), and the part of it
    the node adds itself: against its fp32 result on the inputs its replayed producers round."""
    if not candidates:
        return {}, {}
    replay, pairs = _replay_model(model, refs, candidates, recorded, low, casts_around)
    wanted = list(dict.fromkeys(v for outs in pairs.values() for r, _, ref in outs for v in (r, ref) if v))
    feed = {i.name: recorded[i.name] for i in replay.graph.input}
    try:
        got = dict(zip(wanted, _session(replay, store).run(wanted, feed), strict=False))
    except Exception as err:  # noqa: BLE001 - the ranking then falls back to graph order
        log.warning("local errors could not be measured in onnxruntime (%s); the tolerance search ranks "
                    "nodes in graph order", first_line(err))
        return {}, {}
    local = {node: max(relative_error(got[r], recorded[o]) for r, o, _ in outs) for node, outs in pairs.items()}
    added = {node: max(relative_error(got[r], got[ref] if ref else recorded[o]) for r, o, ref in outs)
             for node, outs in pairs.items()}
    return local, added


def _replay_model(model: onnx.ModelProto, refs: Mapping[str, NodeRef], candidates: Mapping[str, list[str]],
                  recorded: Mapping[str, np.ndarray], low: int,
                  casts_around: bool = False) -> tuple[onnx.ModelProto, dict[str, list]]:
    """The replay model (module docstring) and node -> [(replayed output, recorded output, reference output
    or "")]: a node that reads values its replayed producers round also gets a reference copy, computed in
    fp32 on those rounded values and its exact weights and other inputs, for the error it adds itself."""
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    constants = {n.output[0]: n for n in graph.node if n.op_type == "Constant"}
    taken = all_names(model)
    nodes: list[onnx.NodeProto] = []
    fed: dict[str, None] = {}
    used: dict[str, onnx.TensorProto] = {}
    rounded: dict[str, str] = {}
    copied: set[str] = set()
    pairs: dict[str, list[tuple[str, str]]] = {}

    def round_trip(value: str) -> str:
        """``value`` cast to the low dtype and back: what a low-precision kernel reads or stores."""
        if value not in rounded:
            rounded[value] = unique_name(taken, f"{value}__replay_rounded")
            nodes.extend(rounding(value, rounded[value], low, taken))
        return rounded[value]

    # nodes the CPU provider runs through an fp32 kernel: only their weights are stored low
    fp32_kernel = {name for name in candidates if casts_around and "onnxruntime_cpu" in refs[name].evidence}
    # values a replayed producer stores low: in the plan with every candidate low, their rounding is theirs
    stored_low = {v for name in candidates if name not in fp32_kernel for v in refs[name].node.output if v}
    for name in candidates:
        node = refs[name].node
        around = name in fp32_kernel
        twin = onnx.NodeProto()
        twin.CopyFrom(node)
        del twin.metadata_props[:]
        twin.name = unique_name(taken, f"{name}__replay")
        reference = None
        inherited = [i for i in refs[name].planned if node.input[i] in stored_low] if not around else []
        if inherited:
            reference = onnx.NodeProto()
            reference.CopyFrom(twin)
            reference.name = unique_name(taken, f"{name}__replay_ref")
        for i, value in enumerate(node.input):
            if not value:
                continue
            if value in constants and value not in copied:
                nodes.append(constants[value])
                copied.add(value)
            elif value in initializers:
                used[value] = initializers[value]
            elif value not in constants:
                fed[value] = None
            if i in refs[name].planned and (not around or value in initializers or value in constants):
                twin.input[i] = round_trip(value)
            if reference is not None and i in inherited:
                reference.input[i] = round_trip(value)
        outs = []
        for j, value in enumerate(node.output):
            if value:
                twin.output[j] = unique_name(taken, f"{value}__replay_out")
                if reference is not None:
                    reference.output[j] = unique_name(taken, f"{value}__replay_ref")
                if value in recorded and np.issubdtype(recorded[value].dtype, np.floating):
                    outs.append((twin.output[j], value, reference.output[j] if reference is not None else ""))
        nodes.append(twin)
        if reference is not None:
            nodes.append(reference)
        pairs[name] = [(out if around else round_trip(out), value, ref) for out, value, ref in outs]
    replay_graph = helper.make_graph(
        nodes, "amppass_replay",
        [helper.make_tensor_value_info(v, helper.np_dtype_to_tensor_dtype(recorded[v].dtype), recorded[v].shape)
         for v in fed],
        [helper.make_tensor_value_info(v, FLOAT, None) for outs in pairs.values() for r, _, ref in outs
         for v in (r, ref) if v],
        list(used.values()),
    )
    replay = helper.make_model(replay_graph, opset_imports=list(model.opset_import), functions=list(model.functions))
    replay.ir_version = min(model.ir_version, onnxruntime_facts.max_ir_version())
    return replay, {k: v for k, v in pairs.items() if v}


# -- onnxruntime -------------------------------------------------------------------------------------

def _session(model: onnx.ModelProto, store: WeightStore, extra_outputs: Iterable[onnx.ValueInfoProto] = (),
             optimized: bool = False):
    """A CPU onnxruntime session of ``model`` with ``extra_outputs`` added, at an IR version it loads;
    ``optimized`` keeps onnxruntime's default graph optimisations (else basic ones only).

    ``model`` is a conversion skeleton (:mod:`amppass.onnx.io.weight_store`): its large main-graph initializers are
    handed to onnxruntime as arrays from ``store`` (no copy into the proto, nothing over protobuf's 2 GB);
    other tensors referencing the store (Constant nodes, bodies, bf16 payloads) are written in while the
    model is serialised. ``model`` is borrowed: everything is put back before this returns.
    """
    import onnxruntime as ort

    onnxruntime_facts.installed_builds()  # two builds in one folder: said once, at first use
    options = ort.SessionOptions()
    options.log_severity_level = 3
    # basic rewrites only (exact ones: constant folding, no-op removal): fusions would halve BERT-base's
    # calibration time to build a session that runs a handful of times
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    graph = model.graph
    main = {t.name for t in graph.initializer}
    # onnxruntime drops initializers no node reads (legal ONNX) before it takes external ones, and refuses
    # an external one it no longer has: hand it only those read somewhere
    read = {v for node in all_nodes(graph) for v in node.input} | {o.name for o in graph.output}
    injected = [t for t in graph.initializer if external_data_helper.uses_external_data(t) and t.data_type in _INJECT
                and t.name in read]
    arrays = [ort.OrtValue.ortvalue_from_numpy(np.asarray(store.array(t))) for t in injected]
    if injected:
        options.add_external_initializers([t.name for t in injected], arrays)
    inlined = [t for t in tensors(graph) if external_data_helper.uses_external_data(t)
               and not (t.name in main and t.data_type in _INJECT and t.name in read)]
    saved = [list(t.external_data) for t in inlined]
    ir_version, outputs = model.ir_version, len(graph.output)
    model.ir_version = min(ir_version, onnxruntime_facts.max_ir_version())
    graph.output.extend(extra_outputs)
    try:
        for tensor in inlined:
            payload = store.array(tensor)
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT
            tensor.raw_data = payload.tobytes()
        # MatmulTransposeFusion (a numerically exact fusion) segfaults onnxruntime 1.31 on a low Transpose
        # read through a Cast by an fp32 MatMul, which a trial plan may hold
        session = ort.InferenceSession(model.SerializeToString(), options, providers=[onnxruntime_facts.PROVIDER],
                                       disabled_optimizers=["MatmulTransposeFusion"] if optimized else None)
    finally:
        for tensor, entries in zip(inlined, saved, strict=False):
            tensor.ClearField("raw_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL
            tensor.external_data.extend(entries)
        model.ir_version = ir_version
        del graph.output[outputs:]
    session.amppass_arrays = arrays  # onnxruntime may read the arrays for as long as the session lives
    return session
