"""Calibration for the FX front end: run the captured fp32 graph on the user's batches and plan from it.

:func:`calibrate` runs the GraphModule (before any rewrite) under a :class:`torch.fx.Interpreter` that folds
each node's output into streaming :class:`~amppass.analysis.stats.CalibrationStats`, keyed by node name
(the :class:`GraphView` value name). Values are freed as soon as their last reader has run, so memory is
one forward pass whatever the number of batches. For the tolerance search it also replays candidate
nodes in low precision on the first batch (their local error), records the norms of the values on that
batch (how errors propagate, :mod:`amppass.analysis.propagation`) and keeps the batches and the fp32
outputs, which the search re-runs.

Batches may have any shape the original model takes, as calls of the converted module may
(:mod:`amppass.serving.serving_graph`). A batch the capture's guards reject (an LSTM unrolled over the example's length,
a batch of 1 where export fixed it) runs on a capture of the model for its own shapes, made once per
shape the guards tell apart (at most :data:`~amppass.fx.capture.guards.MAX_PLANS`). What it records is mapped onto
the example's graph by node name and op, as later plans take decisions over: the statistics of the values
both graphs have are folded together, and each trial plan of the tolerance search is painted on that
capture from the same decisions (:class:`FxTrials`).

:func:`calibrated_plan` turns that into a plan: range rules, user overrides on top, painting, and the
tolerance search when asked.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ...analysis.calibration import Perturbation, Progress, Trials, check_tolerance, plan_from_stats, relative_error
from ...analysis import checkpoints
from ...analysis.painting import paint
from ...analysis.plan import Category, Decision, PrecisionPlan
from ...analysis.stats import CalibrationStats
from ...analysis.view import GraphView
from ...dtypes import LowType
from ...errors import CalibrationError, CaptureError, first_line
from ..capture.copies import shared_copy
from .trial_runs import Checkpoints
from ..rewrite.apply import rewrite
from ..capture.guards import GUARDS_KEY, MAX_PLANS, matching

log = logging.getLogger(__name__)

_FIX = ("pass batches the model takes, laid out like its calls: a tuple of positional inputs, or a dict of keyword inputs, "
        "e.g. calibration=[(x,) for x in batches] or calibration=[tokenizer(text, return_tensors=\"pt\") ...]")

# captures the fp32 model for a batch's (args, kwargs): its graph and view; raises CaptureError, or the
# original model's own error for inputs it rejects
CaptureFp32 = Callable[[tuple, dict], tuple[fx.GraphModule, GraphView]]


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
class Calibration:
    """What one pass over the calibration data recorded."""

    stats: CalibrationStats
    seconds: float = 0.0
    local_error: dict[str, float] = field(default_factory=dict)  # node -> relative error replayed low
    norms: dict[str, float] = field(default_factory=dict)  # value -> L2 norm on the first batch (with replay)
    kept: list[tuple[tuple, dict]] = field(default_factory=list)  # the batches, for the tolerance search
    references: list[list[torch.Tensor]] = field(default_factory=list)  # their fp32 floating outputs
    graphs: list[Graph] = field(default_factory=list)  # the example's graph first, then other captures
    graph_of: list[int] = field(default_factory=list)  # kept batch -> the graph it ran on

    @property
    def batches(self) -> int:
        """Batches folded into the statistics."""
        return self.stats.batches


def calibrate(
    gm: fx.GraphModule,
    calibration: Iterable[Any],
    view: GraphView,
    *,
    replay: torch.dtype | None = None,
    keep: bool = False,
    progress: bool = False,
    recapture: CaptureFp32 | None = None,
) -> Calibration:
    """Run ``gm`` (fp32, not yet rewritten) on every batch and record per-value statistics.

    ``calibration`` yields input tuples (a lone tensor or a dict of keyword inputs also works).
    ``replay`` (a low dtype) also measures, on the first batch, each LOW or FOLLOW node's relative error
    when run in that dtype. ``keep`` keeps the batches and their fp32 outputs for the tolerance search.
    ``recapture`` captures the model for a batch ``gm``'s guards reject (module docstring); without it such
    a batch is a :class:`CalibrationError`. ``progress`` shows a progress bar on stderr (off by default: the
    library does not print).
    """
    graphs = [Graph(gm, view)]
    result = Calibration(graphs[0].stats, graphs=graphs)
    recorders: dict[int, _Recorder] = {}
    replayed_on = None
    start = time.perf_counter()
    with torch.no_grad(), Progress(progress, calibration) as advance:
        for index, args, kwargs in _batches(gm, calibration):
            which = _graph_for(graphs, args, kwargs, index, recapture)
            graph = graphs[which]
            if which not in recorders:
                recorders[which] = _Recorder(graph.gm, graph.stats, _tracked(graph.view))
                if keep:
                    graph.checkpoints = recorders[which].checkpoints = Checkpoints(graph.gm, _candidates(graph.view))
            recorder = recorders[which]
            recorder.batch = len(result.kept)
            flat = flatten_inputs(graph.gm, args, kwargs, index)
            if replay is not None and index == 0:
                recorder.replay = (replay, _candidates(graph.view), result.local_error)
                recorder.norms, replayed_on = result.norms, which
            try:
                raw = recorder.run(*flat, enable_io_processing=False)
            except Exception as err:  # noqa: BLE001 - a batch the fp32 model rejects is the caller's data
                raise CalibrationError(
                    f"calibration batch {index}: the fp32 model failed on it ({first_line(err)}); {_FIX}"
                ) from err
            recorder.replay, recorder.norms = None, None
            if keep:
                result.kept.append((args, kwargs))
                result.references.append([t.clone() for t in _floating(raw)])
                result.graph_of.append(which)
            graph.stats.batches += 1
            advance()
    for graph in graphs[1:]:
        result.stats.absorb(graph.stats, shared_names(gm, graph.gm))
    if replayed_on:  # measured on another capture: kept where the example's graph has the same node
        shared = shared_names(gm, graphs[replayed_on].gm)
        result.local_error = {k: v for k, v in result.local_error.items() if k in shared}
        result.norms = {k: v for k, v in result.norms.items() if k in shared}
    result.seconds = time.perf_counter() - start
    log.info("calibrated on %d batches (%d graph%s) in %.2fs (%d values)", result.batches, len(graphs),
             "" if len(graphs) == 1 else "s", result.seconds, len(result.stats))
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
    rewrite_options: Mapping[str, Any] | None = None,
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
    trials = FxTrials(data, low, dict(rewrite_options or {}), low_weight_tables)
    plan, info = plan_from_stats(view, data.stats, low, given, batches=data.batches,
                                 seconds=data.seconds, low_weight_tables=low_weight_tables, tolerance=tolerance,
                                 local_error=data.local_error, norms=data.norms, trials=trials, progress=progress)
    if tolerance is not None:
        info["tolerance_reused"] = round(trials.reused(), 3)
    return plan, info


class FxTrials(Trials):
    """The tolerance search's runs: each graph calibration ran batches on, rewritten by the trial plan (painted
    again from the trial's decisions, matched by node name and op, on a capture for other shapes)."""

    def __init__(self, data: Calibration, low: LowType, rewrite_options: dict[str, Any], low_weight_tables: bool):
        self.data, self.low, self.options, self.low_weight_tables = data, low, rewrite_options, low_weight_tables
        self.calibrated = len(data.kept)
        self.targets = {n.name: n.target for n in data.graphs[0].gm.graph.nodes}

    def count(self) -> int:
        return self.calibrated

    def reused(self) -> float:
        """The share of the search's node runs that read fp32 values calibration kept instead
        (:mod:`amppass.fx.runners.trial_runs`)."""
        return checkpoints.reused(g.checkpoints for g in self.data.graphs if g.checkpoints is not None)

    def error(self, plan: PrecisionPlan, decisions: Mapping[str, Decision], batches: Sequence[int]) -> float:
        data, worst = self.data, 0.0
        for which in sorted({data.graph_of[b] for b in batches}):
            graph = data.graphs[which]
            if which:
                carried = {name: (self.targets.get(name), d) for name, d in decisions.items()}
                plan = paint(graph.view, self.low, matching(graph.gm, carried),
                             low_weight_tables=self.low_weight_tables)
            trial = shared_copy(graph.gm)
            rewrite(trial, plan, self.low, **self.options)
            mine = [(b, *data.kept[b], flatten_inputs(graph.gm, *data.kept[b], b)) for b in batches
                    if data.graph_of[b] == which]
            with torch.no_grad():
                outputs = graph.checkpoints.run(trial, mine) if graph.checkpoints is not None else [
                    trial(*args, **kwargs) for _, args, kwargs, _ in mine]
            for (b, *_), out in zip(mine, outputs):
                for got, ref in zip(_floating(out), data.references[b]):
                    worst = max(worst, relative_error(got, ref))
        return worst

    def perturbed(self, how: Sequence[Perturbation]) -> list[int]:
        data = self.data
        args, kwargs = data.kept[0]
        if not any(_noisy(t) for t in pytree.tree_leaves((args, kwargs))):
            return []
        graph = data.graphs[data.graph_of[0]]
        added = []
        for perturbation in how:
            def perturb(t: Any) -> Any:
                if not _noisy(t):
                    return t
                return torch.from_numpy(perturbation.apply(t.detach().float().cpu().numpy())).to(t)

            batch = pytree.tree_map(perturb, (args, kwargs))
            try:
                with torch.no_grad():
                    reference = [t.clone() for t in _floating(graph.gm(*batch[0], **batch[1]))]
            except Exception as err:  # noqa: BLE001 - then the single batch gets no held-out check
                log.info("tolerance search: the fp32 model rejects a perturbed copy of the calibration batch (%s)",
                         first_line(err))
                return []
            data.kept.append(batch)
            data.references.append(reference)
            data.graph_of.append(data.graph_of[0])
            added.append(len(data.kept) - 1)
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
                               f"{_FIX}") from err
    except Exception as err:  # noqa: BLE001 - the original model rejects the batch: the caller's data
        raise CalibrationError(f"calibration batch {index}: the fp32 model failed on it ({first_line(err)}); "
                               f"{_FIX}") from err
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
        pairs = list(zip(_floating(out), _floating(reference)))
        return max((relative_error(o, r) for o, r in pairs), default=math.nan)


def _floating(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _batches(gm: fx.GraphModule, calibration: Iterable[Any]) -> Iterator[tuple[int, tuple, dict]]:
    """Batches checked against ``gm``'s inputs (structure, dtypes, finite values): (index, args, kwargs)."""
    if calibration is None or isinstance(calibration, (torch.Tensor, dict, str, bytes)) or not hasattr(
        calibration, "__iter__"
    ):
        raise CalibrationError(f"calibration must be an iterable of input tuples, got {type(calibration).__name__}; "
                               f"{_FIX}")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = -1
    for index, batch in enumerate(calibration):
        args, kwargs = split_batch(batch)
        flat = flatten_inputs(gm, args, kwargs, index)
        for node, value in zip(placeholders, flat):
            _check(node, value, index)
        yield index, args, kwargs
    if index < 0:
        raise CalibrationError(f"calibration is empty: it yielded no batches; {_FIX}")


def split_batch(batch: Any) -> tuple[tuple, dict]:
    if isinstance(batch, dict):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def flatten_inputs(gm: fx.GraphModule, args: tuple, kwargs: dict, index: int) -> list:
    """The graph's placeholder values for one batch of ``args``/``kwargs``; CalibrationError naming batch ``index``
    when its structure is not the captured one."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    codegen = gm.graph._codegen
    spec = getattr(getattr(codegen, "pytree_info", None), "in_spec", None)
    if spec is not None:
        flat, got = pytree.tree_flatten((args, kwargs))
        guards = gm.meta.get(GUARDS_KEY)
        if got != spec and guards is not None:  # keywords in another order, a positional input by name
            flat = guards.flatten(args, kwargs)
            got = spec if flat is not None else got
        if got != spec:
            raise CalibrationError(
                f"calibration batch {index}: it holds {len(args)} positional and {sorted(kwargs)} keyword inputs "
                f"({got.num_leaves} values), but the model was captured with {spec.num_leaves} input values in "
                f"another structure; {_FIX}"
            )
        return flat
    try:
        bound = inspect.signature(gm.forward).bind(*args, **kwargs)
    except TypeError as err:
        raise CalibrationError(f"calibration batch {index}: {err} (the model takes "
                               f"{[p.name for p in placeholders]}); {_FIX}") from err
    return [bound.arguments[str(p.target)] for p in placeholders if str(p.target) in bound.arguments]


def _check(node: fx.Node, value: Any, index: int) -> None:
    """Dtype and finiteness of one input against what capture recorded (its shape is the guards' business)."""
    where = f"calibration batch {index}, input {node.name!r}"
    expected = node.meta.get("val")
    if isinstance(expected, torch.Tensor):
        if not isinstance(value, torch.Tensor):
            raise CalibrationError(f"{where}: expected a tensor, got {type(value).__name__}; {_FIX}")
        if value.dtype != expected.dtype:
            raise CalibrationError(f"{where}: dtype {value.dtype}, but the model was captured with "
                                   f"{expected.dtype}; convert it (e.g. .to({expected.dtype})); {_FIX}")
    if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
        kind = "NaN" if bool(torch.isnan(value).any()) else "inf"
        raise CalibrationError(f"{where}: holds {kind}; calibration data must be finite, drop or clean that "
                               "batch (e.g. torch.nan_to_num) before passing it")


