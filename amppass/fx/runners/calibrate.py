"""Calibration for the FX front end: its half of the template of :mod:`amppass.analysis.calibration`.

:func:`calibrated_plan` is where ``amppass.convert(..., calibration=...)`` plans from calibration data
(through :func:`amppass.pipelines.stages.plan_captured`): :func:`calibrate` runs the template's data pass with
:class:`FxRunner`, then :func:`~amppass.analysis.calibration.plan_from_calibration` applies the range rules,
user overrides, painting and, with a tolerance, the search, whose runs are :class:`FxTrials`'.

:class:`FxRunner` runs the GraphModule (before any rewrite) under a :class:`torch.fx.Interpreter` that folds
each node's output into streaming :class:`~amppass.analysis.stats.CalibrationStats`, keyed by node name
(the :class:`GraphView` value name). Values are freed as soon as their last reader has run, so memory is
one forward pass whatever the number of batches. For the tolerance search it also replays candidate
nodes in low precision on the first batch (their local error), records the norms of the values on that
batch (how errors propagate, :mod:`amppass.analysis.propagation`) and keeps the fp32 values at the checkpoints
(:mod:`amppass.fx.runners.trial_runs`) of the batches the template keeps for the search.

Batches may have any shape the original model takes, as calls of the converted module may
(:mod:`amppass.serving.serving_graph`). A batch the capture's guards reject (an LSTM unrolled over the example's length,
a batch of 1 where export fixed it) runs on a capture of the model for its own shapes, made once per
shape the guards tell apart (at most :data:`~amppass.fx.capture.guards.MAX_PLANS`). What it records is mapped onto
the example's graph by node name and op, as later plans take decisions over: the statistics of the values
both graphs have are folded together, and each trial plan of the tolerance search is painted on that
capture from the same decisions (:class:`FxTrials`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ...analysis.calibration import (
    Calibration,
    Perturbation,
    Trials,
    check_tolerance,
    plan_from_calibration,
    record,
    relative_error,
)
from ...analysis.options import RewriteOptions
from ...analysis.painting import paint
from ...analysis.plan import Category, Decision, PrecisionPlan
from ...analysis.stats import CalibrationStats
from ...analysis.view import GraphView
from ...dtypes import LowType
from ...errors import CalibrationError, CaptureError, first_line
from ..capture.copies import shared_copy
from ..capture.guards import GUARDS_KEY, MAX_PLANS, carried_into
from ..capture.inputs import BATCH_FIX, flatten_inputs, split_batch
from ..rewrite.apply import rewrite
from .trial_runs import Checkpoints

log = logging.getLogger(__name__)


# captures the fp32 model for a batch's (args, kwargs): its graph and view; raises CaptureError, or the
# original model's own error for inputs it rejects
CaptureFp32 = Callable[[tuple, dict], tuple[fx.GraphModule, GraphView]]
Batch = tuple[tuple, dict]  # a batch's (args, kwargs)


@dataclass
class Graph:
    """One fp32 graph calibration runs batches on: the example's capture, or one for other shapes."""

    gm: fx.GraphModule
    view: GraphView
    stats: CalibrationStats = field(default_factory=CalibrationStats)
    checkpoints: Checkpoints | None = None  # fp32 values kept for the tolerance search's runs

    def takes(self, args: tuple, kwargs: dict) -> str | None:
        """None if this graph's guards take the batch, else why not (a symbolic trace takes everything)."""
        guards = self.gm.meta.get(GUARDS_KEY)
        mismatch = guards.mismatch(args, kwargs) if guards is not None else None
        return None if mismatch is None else str(mismatch)


@dataclass
class FxCalibration(Calibration[Batch]):
    """What one pass over the calibration data recorded, with the graphs its batches ran on."""

    graphs: list[Graph] = field(default_factory=list)  # the example's graph first, then other captures
    graph_of: list[int] = field(default_factory=list)  # kept batch -> the graph it ran on


def calibrate(
    gm: fx.GraphModule,
    calibration: Iterable[Any],
    view: GraphView,
    *,
    replay: torch.dtype | None = None,
    keep: bool = False,
    progress: bool = False,
    recapture: CaptureFp32 | None = None,
) -> FxCalibration:
    """Run ``gm`` (fp32, not yet rewritten) on every batch and record per-value statistics.

    ``calibration`` yields input tuples (a lone tensor or a dict of keyword inputs also works).
    ``replay`` (a low dtype) also measures, on the first batch, each LOW or FOLLOW node's relative error
    when run in that dtype. ``keep`` keeps the batches and their fp32 outputs for the tolerance search.
    ``recapture`` captures the model for a batch ``gm``'s guards reject (module docstring); without it such
    a batch is a :class:`CalibrationError`. ``progress`` shows a progress bar on stderr (off by default: the
    library does not print).
    """
    with torch.no_grad():
        result = record(FxRunner(gm, view, replay, recapture), calibration, keep=keep, progress=progress)
    log.info("calibrated on %d batches (%d graph%s) in %.2fs (%d values)", result.batches, len(result.graphs),
             "" if len(result.graphs) == 1 else "s", result.seconds, len(result.stats))
    return result


def calibrated_plan(
    gm: fx.GraphModule,
    view: GraphView,
    calibration: Iterable[Any],
    low: LowType,
    given: Mapping[str, Decision],
    *,
    tolerance: float | None = None,
    progress: bool = False,
    low_weight_tables: bool = False,
    rewrite_options: RewriteOptions | None = None,
    recapture: CaptureFp32 | None = None,
) -> tuple[PrecisionPlan, dict[str, Any]]:
    """The plan from calibration data and what to record about it in ``gm.meta``.

    ``given`` (user overrides) wins over the range rules. With ``tolerance`` the search of
    :mod:`amppass.analysis.tolerance` moves nodes back to fp32; ``rewrite_options`` are passed to each
    trial rewrite so the trials compute what the final model computes. ``recapture`` takes batches of
    shapes ``gm`` does not (:func:`calibrate`).
    """
    check_tolerance(tolerance)
    data = calibrate(gm, calibration, view, replay=low.torch if tolerance is not None else None,
                     keep=tolerance is not None, progress=progress, recapture=recapture)
    trials = FxTrials(data, low, rewrite_options or RewriteOptions(), low_weight_tables)
    return plan_from_calibration(view, data, low, given, trials=trials, tolerance=tolerance,
                                 low_weight_tables=low_weight_tables, progress=progress)


class FxRunner:
    """The data pass's FX half (:class:`~amppass.analysis.calibration.Runner`): each batch through a
    :class:`_Recorder` on the first graph whose guards take it, or on a capture made for it."""

    def __init__(self, gm: fx.GraphModule, view: GraphView, replay: torch.dtype | None,
                 recapture: CaptureFp32 | None):
        graphs = [Graph(gm, view)]
        self.data = FxCalibration(graphs[0].stats, graphs=graphs)
        self.replay, self.recapture = replay, recapture
        self.recorders: dict[int, _Recorder] = {}  # graph -> its interpreter
        self.replayed_on = 0  # the graph batch 0 ran on: local errors and norms were measured there

    def batches(self, calibration: Iterable[Any]) -> Iterator[tuple[int, Batch]]:
        """Batches checked against the example graph's inputs (structure, dtypes, finite values)."""
        gm = self.data.graphs[0].gm
        if calibration is None or isinstance(calibration, (torch.Tensor, dict, str, bytes)) or not hasattr(
            calibration, "__iter__"
        ):
            raise CalibrationError(f"calibration must be an iterable of input tuples, got "
                                   f"{type(calibration).__name__}; {BATCH_FIX}")
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        index = -1
        for index, batch in enumerate(calibration):
            args, kwargs = split_batch(batch)
            flat = flatten_inputs(gm, args, kwargs, index)
            for node, value in zip(placeholders, flat, strict=False):
                _check(node, value, index)
            yield index, (args, kwargs)
        if index < 0:
            raise CalibrationError(f"calibration is empty: it yielded no batches; {BATCH_FIX}")

    def run(self, index: int, batch: Batch, kept: int | None) -> list[torch.Tensor] | None:
        """Batch ``index`` through its graph's interpreter, which folds every tracked value into that graph's
        statistics, replays the candidates low on batch 0 (with a low dtype to replay) and keeps the values at
        its checkpoints on a ``kept`` batch; the floating outputs, cloned, of a kept batch."""
        args, kwargs = batch
        graphs = self.data.graphs
        which = _graph_for(graphs, args, kwargs, index, self.recapture)
        graph = graphs[which]
        if which not in self.recorders:
            self.recorders[which] = _Recorder(graph.gm, graph.stats, _tracked(graph.view))
            if kept is not None:
                graph.checkpoints = self.recorders[which].checkpoints = Checkpoints(graph.gm, _candidates(graph.view))
        recorder = self.recorders[which]
        recorder.batch = kept
        flat = flatten_inputs(graph.gm, args, kwargs, index)
        if self.replay is not None and index == 0:
            recorder.replay = (self.replay, _candidates(graph.view), self.data.local_error)
            recorder.norms, self.replayed_on = self.data.norms, which
        try:
            raw = recorder.run(*flat, enable_io_processing=False)
        except Exception as err:  # a batch the fp32 model rejects is the caller's data
            raise CalibrationError(
                f"calibration batch {index}: the fp32 model failed on it ({first_line(err)}); {BATCH_FIX}"
            ) from err
        recorder.replay, recorder.norms = None, None
        graph.stats.batches += 1
        if kept is None:
            return None
        self.data.graph_of.append(which)
        return [t.clone() for t in _floating(raw)]

    def finish(self) -> None:
        """Fold the other captures' statistics into the example graph's, by the values both have; keep the
        local errors and norms measured on another capture where the example's graph has the same node."""
        data = self.data
        gm = data.graphs[0].gm
        for graph in data.graphs[1:]:
            data.stats.absorb(graph.stats, shared_names(gm, graph.gm))
        if self.replayed_on:
            shared = shared_names(gm, data.graphs[self.replayed_on].gm)
            data.local_error = {k: v for k, v in data.local_error.items() if k in shared}
            data.norms = {k: v for k, v in data.norms.items() if k in shared}


class FxTrials(Trials[Batch]):
    """The tolerance search's runs: each graph calibration ran batches on, rewritten by the trial plan (painted
    again from the trial's decisions, matched by node name and op, on a capture for other shapes)."""

    data: FxCalibration

    def __init__(self, data: FxCalibration, low: LowType, rewrite_options: RewriteOptions, low_weight_tables: bool):
        super().__init__(data)
        self.low, self.options, self.low_weight_tables = low, rewrite_options, low_weight_tables
        self.targets = {n.name: n.target for n in data.graphs[0].gm.graph.nodes}

    def checkpoints(self) -> list[Checkpoints]:
        """Each graph's checkpoints (:mod:`amppass.fx.runners.trial_runs`)."""
        return [g.checkpoints for g in self.data.graphs if g.checkpoints is not None]

    def run(self, plan: PrecisionPlan, decisions: Mapping[str, Decision],
            batches: Sequence[int]) -> Iterator[tuple[int, list[torch.Tensor]]]:
        """Each graph of ``batches`` rewritten by the trial (repainted from ``decisions`` on another capture),
        run on its batches from their checkpoints."""
        data = self.data
        for which in sorted({data.graph_of[b] for b in batches}):
            graph = data.graphs[which]
            if which:
                carried = {name: (self.targets.get(name), d) for name, d in decisions.items()}
                plan = paint(graph.view, self.low, carried_into(graph.gm, carried),
                             low_weight_tables=self.low_weight_tables)
            trial = shared_copy(graph.gm)
            rewrite(trial, plan, self.low, self.options)
            mine = [(b, *data.kept[b], flatten_inputs(graph.gm, *data.kept[b], b)) for b in batches
                    if data.graph_of[b] == which]
            with torch.no_grad():
                outputs = graph.checkpoints.run(trial, mine) if graph.checkpoints is not None else [
                    trial(*args, **kwargs) for _, args, kwargs, _ in mine]
            for (b, *_), out in zip(mine, outputs, strict=False):
                yield b, _floating(out)

    def noisy(self, batch: Batch) -> bool:
        """Whether a tensor input of ``batch`` gets noise (:func:`_noisy`)."""
        return any(_noisy(t) for t in pytree.tree_leaves(batch))

    def perturb(self, batch: Batch, how: Perturbation) -> Batch:
        """``batch`` with each noisy tensor perturbed by ``how`` (in numpy, back in its dtype and device)."""
        return pytree.tree_map(
            lambda t: torch.from_numpy(how.apply(t.detach().float().cpu().numpy())).to(t) if _noisy(t) else t, batch)

    def references(self, batches: list[Batch]) -> list[list[torch.Tensor]]:
        """The fp32 outputs of ``batches`` on the graph batch 0 ran on."""
        gm = self.data.graphs[self.data.graph_of[0]].gm
        with torch.no_grad():
            return [[t.clone() for t in _floating(gm(*args, **kwargs))] for args, kwargs in batches]

    def perturbed(self, how: Sequence[Perturbation]) -> list[int]:
        """The template's perturbed copies of batch 0, run on batch 0's graph."""
        added = super().perturbed(how)
        self.data.graph_of += [self.data.graph_of[0]] * len(added)
        return added


def shared_names(gm: fx.GraphModule, other: fx.GraphModule) -> set[str]:
    """Names of the nodes ``other`` has with the same op as in ``gm``: the values two captures share."""
    targets = {n.name: n.target for n in gm.graph.nodes}
    return {n.name for n in other.graph.nodes if targets.get(n.name, _MISSING) == n.target}


_MISSING = object()


def _tracked(view: GraphView) -> set[str]:
    return {v for node in view.nodes for v in node.inputs + node.outputs if v not in view.weights}


def _candidates(view: GraphView) -> set[str]:
    return {n.name for n in view.nodes if n.category in (Category.LOW, Category.FOLLOW) and n.outputs}


def _noisy(value: Any) -> bool:
    """Whether a perturbed copy adds noise to ``value``: a floating tensor of more than one element."""
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 1


def _graph_for(graphs: list[Graph], args: tuple, kwargs: dict, index: int, recapture: CaptureFp32 | None) -> int:
    """The graph batch ``index`` runs on: the first whose guards take it, else a capture made for it."""
    why = None
    for which, graph in enumerate(graphs):
        why = graph.takes(args, kwargs)
        if why is None:
            return which
        if which == 0:
            first = why
    where = f"calibration batch {index}: {first}"
    if recapture is None:
        raise CalibrationError(f"{where}, and this graph cannot be captured again for other shapes; pass batches "
                               "of the shapes it takes")
    if len(graphs) >= MAX_PLANS:
        raise CalibrationError(f"{where}, and the batches before it already needed {len(graphs)} captures "
                               f"(at most {MAX_PLANS}); pass batches of fewer shapes")
    try:
        gm, view = recapture(args, kwargs)
    except CaptureError as err:
        raise CalibrationError(f"{where}, and torch.export cannot capture the model for it ({first_line(err)}); "
                               f"{BATCH_FIX}") from err
    except Exception as err:  # the original model rejects the batch: the caller's data
        raise CalibrationError(f"calibration batch {index}: the fp32 model failed on it ({first_line(err)}); "
                               f"{BATCH_FIX}") from err
    log.info("%s: captured the model for it too", where)
    graphs.append(Graph(gm, view))
    return len(graphs) - 1


class _Recorder(fx.Interpreter):
    """Folds every tracked node's output into the stats; optionally replays nodes in low precision."""

    def __init__(self, gm: fx.GraphModule, stats: CalibrationStats, tracked: set[str]):
        super().__init__(gm)
        self.stats, self.tracked = stats, tracked
        self.replay: tuple[torch.dtype, set[str], dict[str, float]] | None = None
        self.checkpoints: Checkpoints | None = None  # with the kept batch's number: where fp32 values are kept
        self.batch = 0
        self.norms: dict[str, float] | None = None  # filled on the replayed batch, for the search's gains

    def run_node(self, n: fx.Node) -> Any:
        if self.checkpoints is not None and n.name in self.checkpoints.order:
            self.checkpoints.record(self.batch, n.name, self.env)
        result = super().run_node(n)
        if n.name in self.tracked:
            source = self._view_of(n, result)
            if source is None:
                self.stats.update(n.name, result)
            else:
                self.stats.alias(n.name, source)
        if self.norms is not None and n.name in self.tracked and isinstance(result, torch.Tensor) \
                and result.is_floating_point():
            self.norms[n.name] = float(result.detach().double().norm())
        if self.replay is not None and n.name in self.replay[1]:
            low, _, errors = self.replay
            errors[n.name] = self._replay(n, result, low)
        return result

    def _view_of(self, n: fx.Node, result: Any) -> str | None:
        """The input whose elements ``result`` shares exactly (a view, reshape or permutation), if any."""
        source = n.args[0] if n.args else None
        if not isinstance(source, fx.Node) or source.name not in self.stats or not isinstance(result, torch.Tensor):
            return None
        value = self.env.get(source)
        same = (isinstance(value, torch.Tensor) and value.dtype == result.dtype and value.numel() == result.numel()
                and value.numel() > 0 and value.data_ptr() == result.data_ptr())
        return source.name if same else None

    def _replay(self, n: fx.Node, reference: Any, low: torch.dtype) -> float:
        """The node's relative output error when its fp32 inputs and weights are rounded to ``low``."""
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        down = lambda a: a.to(low) if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a  # noqa: E731
        args, kwargs = pytree.tree_map(down, (args, kwargs))
        try:
            if n.op == "call_module":
                module = self.fetch_attr(str(n.target))
                state = {k: down(v) for k, v in list(module.named_parameters()) + list(module.named_buffers())}
                out = torch.func.functional_call(module, state, args, kwargs)
            else:
                out = getattr(self, n.op)(n.target, args, kwargs)
        except Exception as err:  # noqa: BLE001 - an op without a low-precision kernel here is just unranked
            log.debug("could not replay %s in %s: %s", n.name, low, err)
            return math.nan
        pairs = list(zip(_floating(out), _floating(reference), strict=False))
        return max((relative_error(o, r) for o, r in pairs), default=math.nan)


def _floating(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _check(node: fx.Node, value: Any, index: int) -> None:
    """Dtype and finiteness of one input against what capture recorded (its shape is the guards' business)."""
    where = f"calibration batch {index}, input {node.name!r}"
    expected = node.meta.get("val")
    if isinstance(expected, torch.Tensor):
        if not isinstance(value, torch.Tensor):
            raise CalibrationError(f"{where}: expected a tensor, got {type(value).__name__}; {BATCH_FIX}")
        if value.dtype != expected.dtype:
            raise CalibrationError(f"{where}: dtype {value.dtype}, but the model was captured with "
                                   f"{expected.dtype}; convert it (e.g. .to({expected.dtype})); {BATCH_FIX}")
    if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
        kind = "NaN" if bool(torch.isnan(value).any()) else "inf"
        raise CalibrationError(f"{where}: holds {kind}; calibration data must be finite, drop or clean that "
                               "batch (e.g. torch.nan_to_num) before passing it")


