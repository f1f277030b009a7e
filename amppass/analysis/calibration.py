"""The calibration template: each step of calibrating a model and planning from it, written once.

``amppass.convert(..., calibration=...)`` (through :func:`amppass.pipelines.stages.plan_captured`) and
``amppass.convert_onnx(..., calibration=...)`` call their front end's ``calibrated_plan``
(:mod:`amppass.fx.runners.calibrate`, :mod:`amppass.onnx.calibrate`), which runs these steps with its runner:

1. The data pass (:func:`record`): the front end's :class:`Runner` checks each of the caller's batches against
   the model's inputs and runs the fp32 model on it once (a torch.fx Interpreter; an onnxruntime session with
   every tracked value added as an output), folding every value into streaming
   :class:`~amppass.analysis.stats.CalibrationStats` (so memory does not grow with the number of batches). Where
   a tolerance is asked for, it also measures each candidate node's local error and the values' norms on the
   first batch, and keeps the fp32 values at the checkpoints (:mod:`amppass.analysis.checkpoints`) of every
   batch, which the template keeps with its fp32 outputs for the search.
2. The plan (:func:`plan_from_calibration`): range rules (:mod:`amppass.analysis.rules`), user overrides on top,
   painting (:mod:`amppass.analysis.painting`).
3. With a tolerance, the search (:func:`search_held_out`: the batches :func:`held_out` leaves it, the ranking and
   bisection of :mod:`amppass.analysis.tolerance`, the gains of :mod:`amppass.analysis.propagation`). Each of its
   runs is :meth:`Trials.error`: the front end runs the trial plan on kept batches, each from the checkpoint it
   resumes from (:class:`Trials`' abstract methods; :mod:`amppass.fx.runners.trial_runs`,
   :mod:`amppass.onnx.trial_runs`), and the template compares the outputs with fp32's.
4. The decisions, each with its reason and rule (the range rules' from :mod:`amppass.analysis.rules`, the
   search's from :mod:`amppass.analysis.tolerance`), and the metadata both front ends store (``calibrated``,
   ``calibration_batches``, ``tolerance``, ``achieved_error``, ``tolerance_reused``, ...).

Checkpoints, the fp32 values calibration keeps so the search's trials resume from them rather than run from the
start: :mod:`amppass.analysis.checkpoints`.

It also holds the argument check, the error measure and the progress bar the front ends share (calibration
batches, then the tolerance search's runs).
"""

from __future__ import annotations

import abc
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterable, Iterator, Mapping, Protocol, Sequence, TypeVar

import numpy as np
import torch

from ..dtypes import LowType
from ..errors import InputError, first_line
from . import propagation
from . import tolerance as search_tolerance
from .checkpoints import Checkpoints
from .painting import paint
from .plan import Decision, PrecisionPlan
from .rules import range_decisions
from .stats import CalibrationStats
from .view import GraphView

log = logging.getLogger(__name__)


def check_tolerance(tolerance: Any, calibration: Any = ..., example: str = "[inputs, ...]") -> None:
    """Raise InputError unless ``tolerance`` is None or a positive finite number, given with calibration
    data when ``calibration`` is passed (``example`` shows the caller's form of it in the message)."""
    if tolerance is None:
        return
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 < tolerance < math.inf:
        raise InputError(f"tolerance={tolerance!r} must be a positive number, the largest relative output "
                         "error allowed, e.g. tolerance=1e-3")
    if calibration is None:
        raise InputError(f"tolerance={tolerance!r} needs calibration data to measure the output error on: pass "
                         f"calibration={example} as well")


def relative_error(out: Any, ref: Any) -> float:
    """``||out - ref|| / ||ref||`` in fp32 for torch tensors or numpy arrays; inf when ``out`` is not finite
    where ``ref`` is."""
    out, ref = _tensor(out).float(), _tensor(ref).float()
    diff = float((out - ref).norm())
    if math.isnan(diff):
        return math.inf
    scale = float(ref.norm())
    return diff / scale if scale > 0 else diff


Batch = TypeVar("Batch")  # one calibration batch as a front end keeps it: (args, kwargs) in FX, a feed in ONNX


@dataclass
class Calibration(Generic[Batch]):
    """What one pass over the calibration data recorded; a front end adds fields of its own."""

    stats: CalibrationStats
    seconds: float = 0.0
    local_error: dict[str, float] = field(default_factory=dict)  # node -> relative error replayed low
    added_error: dict[str, float] = field(default_factory=dict)  # node -> the part of it the node adds itself
    norms: dict[str, float] = field(default_factory=dict)  # value -> L2 norm on the first batch (with replay)
    kept: list[Batch] = field(default_factory=list)  # the batches, for the tolerance search
    references: list[list[Any]] = field(default_factory=list)  # their fp32 floating outputs

    @property
    def batches(self) -> int:
        """Batches folded into the statistics."""
        return self.stats.batches


class Runner(Protocol[Batch]):
    """A front end's fp32 model on the caller's batches: its half of the data pass (:func:`record`)."""

    data: Calibration[Batch]  # what the pass records: the front end's Calibration, filled by both halves

    def batches(self, calibration: Iterable[Any]) -> Iterator[tuple[int, Batch]]:
        """``(index, batch)`` for each of the caller's batches, checked against the model's inputs
        (CalibrationError naming the batch, the input and the fix)."""

    def run(self, index: int, batch: Batch, kept: int | None) -> list[Any] | None:
        """Run the fp32 model on ``batch`` and fold its values into the statistics, counting the batch (all in
        ``data.stats`` once :meth:`finish` has run); on batch 0 also the local errors and norms, where asked.
        ``kept`` is the batch's number among the kept ones (None: not kept), under which its checkpoint values
        are kept. Returns its floating outputs, copies the template keeps (None where not kept);
        CalibrationError where the model rejects the batch."""

    def finish(self) -> None:
        """After the last batch: what the front end derives from all of them (other captures' statistics
        folded in, local errors measured)."""


def record(runner: Runner[Batch], calibration: Iterable[Any], *, keep: bool = False,
           progress: bool = False) -> Calibration[Batch]:
    """The data pass: every batch ``runner`` takes from ``calibration`` through its fp32 model, kept with its
    fp32 outputs for the tolerance search with ``keep``; ``progress`` shows a progress bar on stderr."""
    data = runner.data
    start = time.perf_counter()
    with Progress(progress, calibration) as advance:
        for index, batch in runner.batches(calibration):
            outputs = runner.run(index, batch, len(data.kept) if keep else None)
            if keep:
                data.kept.append(batch)
                data.references.append(outputs)
            advance()
    runner.finish()
    data.seconds = time.perf_counter() - start
    return data


HELD_OUT_SHARE = 4  # of two or more calibration batches, the last quarter (at least one) is held out of the search


@dataclass(frozen=True)
class Perturbation:
    """One way a fresh input can differ from the single calibration batch, applied to every floating input:
    its values times ``scale``, plus Gaussian noise of ``noise`` times its standard deviation, and, where
    ``window`` < 1, only a contiguous ``window`` share of its last dimension kept (the rest set to its mean).
    Non-finite values (masks of -inf) stay as they are."""

    name: str
    scale: float = 1.0
    noise: float = 0.0
    window: float = 1.0
    seed: int = 0

    def apply(self, value: np.ndarray) -> np.ndarray:
        """``value`` perturbed, in its own dtype; the same ``value`` always gives the same copy."""
        finite = np.isfinite(value)
        kept = value[finite].astype(np.float64)
        spread, mean = (float(kept.std()), float(kept.mean())) if kept.size else (0.0, 0.0)
        rng = np.random.default_rng(self.seed)
        out = value.astype(np.float64) * self.scale
        if self.noise:
            out += rng.standard_normal(value.shape) * (self.noise * spread)
        if self.window < 1 and value.ndim and value.shape[-1] > 1:
            width = value.shape[-1]
            keep = max(1, round(width * self.window))
            start = int(rng.integers(0, width - keep + 1))
            outside = np.ones(width, dtype=bool)
            outside[start:start + keep] = False
            out[..., outside] = mean
        return np.where(finite, out, value).astype(value.dtype)


# A single batch is checked on these copies of it: inputs vary louder and quieter, noisier, near silent and
# in part, and a front end whose low-precision error grows in any of these directions must not pass on the
# one batch it saw (an fp16 log-magnitude front end loses most on quiet inputs, never on louder ones).
PERTURBATIONS = (
    Perturbation("noise", noise=0.5, seed=1),
    Perturbation("noise", noise=0.5, seed=2),
    Perturbation("quieter", scale=0.5, noise=0.05, seed=3),
    Perturbation("louder", scale=1.5, noise=0.05, seed=4),
    Perturbation("near silence", scale=0.02, noise=0.01, seed=5),
    Perturbation("a window", window=0.5, noise=0.05, seed=6),
)
MARGIN_ROUNDS = 2  # at most this many more searches, with a margin, while the held-out error misses


class Trials(abc.ABC, Generic[Batch]):
    """The tolerance search's runs on the batches calibration kept: the template, whose abstract methods are the
    front end's half (running a trial plan, from a checkpoint where it can; perturbing a batch).

    Batches are numbered in the order they were kept; :meth:`perturbed` may add more after them.
    """

    def __init__(self, data: Calibration[Batch]):
        self.data = data
        self.calibrated = len(data.kept)

    def count(self) -> int:
        """Batches kept by calibration (perturbed copies left out)."""
        return self.calibrated

    def error(self, plan: PrecisionPlan, decisions: Mapping[str, Decision], batches: Sequence[int]) -> float:
        """Largest relative error of any floating output of the model rewritten by ``plan`` (painted from
        ``decisions``, by node name) against fp32, over ``batches``; inf where the trial did not run."""
        return max(self.errors(plan, decisions, batches), default=0.0)

    def errors(self, plan: PrecisionPlan, decisions: Mapping[str, Decision], batches: Sequence[int]) -> list[float]:
        """:meth:`error` of each of ``batches`` on its own, in their order (one trial run over all of them)."""
        found = {}  # a front end may run its batches in groups, in another order
        for batch, outputs in self.run(plan, decisions, batches):
            found[batch] = self.batch_error(batch, outputs)
        return [found[batch] for batch in batches]

    def judge(self, plan: PrecisionPlan, decisions: Mapping[str, Decision]) -> Callable[[int], float]:
        """:meth:`errors` of one batch at a time, for a search that stops a trial at its first batch beyond the
        tolerance (:class:`amppass.analysis.tolerance.JudgedTrials`); a front end that can build a trial once for
        all its batches overrides this, which builds it for each."""
        return lambda batch: self.errors(plan, decisions, [batch])[0]

    def batch_error(self, batch: int, outputs: Sequence[Any] | None) -> float:
        """The largest relative error of a trial's floating ``outputs`` on ``batch`` against fp32; inf where the
        trial did not run (None)."""
        return math.inf if outputs is None else max(
            (relative_error(got, ref) for got, ref in zip(outputs, self.data.references[batch], strict=False)),
            default=0.0)

    def perturbed(self, how: Sequence[Perturbation]) -> list[int]:
        """Keep a copy of batch 0 for each of ``how``, each floating input of more than one element perturbed
        by it (:meth:`Perturbation.apply`; other inputs as they are), with their fp32 outputs; their numbers,
        or [] where the batch has no such input or the fp32 model rejects a copy."""
        batch = self.data.kept[0]
        if not self.noisy(batch):
            return []
        copies = [self.perturb(batch, perturbation) for perturbation in how]
        try:
            references = self.references(copies)
        except Exception as err:  # noqa: BLE001 - then the single batch gets no held-out check
            log.info("tolerance search: the fp32 model rejects a perturbed copy of the calibration batch (%s)",
                     first_line(err))
            return []
        self.data.kept += copies
        self.data.references += references
        return list(range(len(self.data.kept) - len(copies), len(self.data.kept)))

    def reused(self) -> float:
        """The share of the search's node runs that read fp32 values calibration kept instead (rule 4)."""
        kept = self.checkpoints()
        total = sum(c.nodes_skipped + c.nodes_run for c in kept)
        return sum(c.nodes_skipped for c in kept) / total if total else 0.0

    @abc.abstractmethod
    def run(self, plan: PrecisionPlan, decisions: Mapping[str, Decision],
            batches: Sequence[int]) -> Iterator[tuple[int, list[Any] | None]]:
        """``(batch, floating outputs)`` of the model rewritten by ``plan`` on each of ``batches``, run from the
        checkpoint it resumes from where it has one; None for the outputs of a trial the runtime rejects."""

    @abc.abstractmethod
    def noisy(self, batch: Batch) -> bool:
        """Whether ``batch`` holds a floating input of more than one element."""

    @abc.abstractmethod
    def perturb(self, batch: Batch, how: Perturbation) -> Batch:
        """A copy of ``batch``, each floating input of more than one element perturbed by ``how``."""

    @abc.abstractmethod
    def references(self, batches: list[Batch]) -> list[list[Any]]:
        """The fp32 model's floating outputs on each of ``batches`` (raises where it rejects one)."""

    @abc.abstractmethod
    def checkpoints(self) -> list[Checkpoints]:
        """The checkpoints calibration kept, one per graph run."""


def held_out(trials: Trials) -> tuple[list[int], list[int], str, bool]:
    """(batches the search fits, batches that judge it, how the second were chosen, whether they are
    calibration batches rather than perturbed copies).

    Of two or more batches the last quarter, at least one, is held out. A single batch is checked on
    perturbed copies of it: a stand-in for inputs the search did not see, weaker than real ones.
    """
    count = trials.count()
    if count >= 2:
        held = max(1, count // HELD_OUT_SHARE)
        return list(range(count - held)), list(range(count - held, count)), \
            f"the last {held} of {count} calibration batches", True
    copies = trials.perturbed(PERTURBATIONS)
    if copies:
        kinds = ", ".join(dict.fromkeys(p.name for p in PERTURBATIONS))
        return [0], copies, (f"{len(copies)} perturbed copies of the single calibration batch ({kinds}); pass "
                             "more batches for a real held-out check"), False
    return [0], [], "none: a single calibration batch with no floating input to perturb; pass two or more batches", \
        False


def plan_from_calibration(
    view: GraphView,
    data: Calibration,
    low: LowType,
    given: Mapping[str, Decision],
    *,
    trials: Trials | None = None,
    tolerance: float | None = None,
    low_weight_tables: bool = False,
    progress: bool = False,
) -> tuple[PrecisionPlan, dict[str, Any]]:
    """The calibrated plan and the metadata to store with the converted model (steps 2 to 4 of the module
    docstring).

    ``given`` (user overrides) wins over the range rules. With ``tolerance``, ``trials`` runs the model
    rewritten by trial plans on the calibration data, and ``data``'s local errors (and added errors, the part
    of it each node adds itself) with its norms (values' L2 norms on one batch, for
    :mod:`amppass.analysis.propagation`) rank the nodes the search of :mod:`amppass.analysis.tolerance`
    moves back to fp32 (:func:`search_held_out`); ``progress`` shows each of its runs (nodes moved, error) on
    a progress bar on stderr. Every node's observed output range lands in its evidence, for the report's
    range plot.
    """
    ranges = range_decisions(view, data.stats, low)
    merged = {**ranges, **given}  # user overrides win over calibration
    plan = paint(view, low, merged, low_weight_tables=low_weight_tables)
    info: dict[str, Any] = {
        "calibrated": True, "calibration_batches": data.batches,
        "calibration_seconds": round(data.seconds, 3), "calibration_decisions": len(ranges),
    }
    if tolerance is not None and trials is not None:
        sensitivity = search_tolerance.Sensitivity(data.local_error, data.added_error,
                                                   propagation.gains(view, data.norms))
        decided, found = search_held_out(view, low, plan, merged, sensitivity, tolerance, trials,
                                         low_weight_tables=low_weight_tables, progress=progress)
        info.update(found)
        info["tolerance_reused"] = round(trials.reused(), 3)
        plan = paint(view, low, decided, low_weight_tables=low_weight_tables)
    return with_ranges(plan, view, data.stats), info


def max_runs(candidates: int) -> int:
    """The most runs :func:`search_held_out` spends on ``candidates`` nodes: one search, then each margin round
    one run on the held-out batches and a search that ranks nothing again."""
    return (search_tolerance.search_runs(candidates) + 1
            + MARGIN_ROUNDS * (search_tolerance.search_runs(candidates, ranked=True) + 1))


def search_held_out(view: GraphView, low: LowType, plan: PrecisionPlan, given: Mapping[str, Decision],
                    sensitivity: search_tolerance.Sensitivity, tolerance: float, trials: Trials, *,
                    low_weight_tables: bool = False, progress: bool = False) -> tuple[dict[str, Decision], dict]:
    """The tolerance search on the batches :func:`held_out` leaves it, judged on the ones it holds out.

    Where the held-out error misses the tolerance, the fit batches underestimate the error on new inputs by
    the ratio of the two: the search goes on from where it stopped (with the ranking it measured) towards
    the tolerance divided by that ratio, at most :data:`MARGIN_ROUNDS` times. Returns the decisions to paint
    with and the metadata: ``achieved_error`` over every calibration batch (perturbed copies left out),
    ``tolerance_met`` when that and the held-out error are within the tolerance, ``held_out_error`` beside it (None
    without a held-out check), ``held_out`` saying which batches, ``tolerance_margin`` (tolerance / the target the
    last search met), ``tolerance_runs``, at most :func:`max_runs` of the candidates, and
    ``tolerance_seconds``.
    """
    start = time.perf_counter()
    fit, held, how, real = held_out(trials)

    def measure(batches: Sequence[int]) -> search_tolerance.Measure:
        return lambda decisions: trials.error(paint(view, low, decisions, low_weight_tables=low_weight_tables),
                                              decisions, batches)

    with Progress(progress, label="tolerance search") as advance:
        runs = itertools.count(1)

        def show(moved: int, error: float, on: str = "") -> None:
            limit = tolerance if on else target
            verdict = "<=" if error <= limit else ">"
            advance(f"run {next(runs)}, {moved} nodes fp32, error {error:.2g} {verdict} {limit:.2g}{on}")

        target = tolerance
        found = search_tolerance.search(plan, given, sensitivity, target, measure(fit), low, on_run=show)
        initial, spent, moved, held_error = found.initial_error, found.runs, list(found.moved), None
        for round_ in range(MARGIN_ROUNDS + 1):
            if not held:
                break
            held_error = measure(held)(found.given)
            spent += 1
            show(len(moved), held_error, " on the held-out batches")
            if held_error <= tolerance or round_ == MARGIN_ROUNDS or not found.met or found.achieved_error <= 0:
                break
            target = target * found.achieved_error / held_error  # the margin the held-out error asks for
            log.info("tolerance search: %.3g on held-out batches, %.3g on the fit ones: searching again for %.3g",
                     held_error, found.achieved_error, target)
            rank = search_tolerance.ranked_before(found.ranked) if found.ranked is not None else None
            found = search_tolerance.search(paint(view, low, found.given, low_weight_tables=low_weight_tables),
                                            found.given, sensitivity, target, measure(fit), low, on_run=show,
                                            rank_with=rank)
            spent += found.runs
            moved += found.moved
    achieved = max(found.achieved_error, held_error) if real and held_error is not None else found.achieved_error
    # Met means met on the inputs the search did not see as well: perturbed copies of a single batch that
    # still miss say that one batch cannot support the promise, whatever the batch itself measures.
    met = achieved <= tolerance and (held_error is None or held_error <= tolerance)
    if not met and achieved <= tolerance:
        log.warning("tolerance search: %.3g on the calibration batch but %.3g on %s: the tolerance %.3g is not met "
                    "on inputs the search held out; pass more calibration batches", achieved, held_error, how,
                    tolerance)
    return found.given, {
        "tolerance": tolerance, "achieved_error": achieved, "initial_error": initial,
        "tolerance_met": met, "moved_by_tolerance": len(moved), "tolerance_runs": spent,
        "held_out_error": held_error, "held_out": how, "tolerance_margin": tolerance / target,
        "tolerance_seconds": round(time.perf_counter() - start, 3),
    }


def with_ranges(plan: PrecisionPlan, view: GraphView, stats: CalibrationStats) -> PrecisionPlan:
    """Record each node's observed output range in its evidence, so the report can show every one."""
    for node in view.nodes:
        seen = next((stats.get(v) for v in node.outputs if stats.get(v) is not None), None)
        if seen is None or node.name not in plan:
            continue
        evidence = plan[node.name].evidence
        evidence.setdefault("absmax", seen.absmax)
        if math.isfinite(seen.min_nonzero):
            evidence.setdefault("min_nonzero", seen.min_nonzero)
    return plan


class Progress:
    """A rich progress bar on stderr when enabled; a no-op otherwise.

    Entering it returns ``advance(note="")``: one step done, with ``note`` (what that step found) shown
    after the label. The calibration counts batches against their number when ``steps`` has a length; the
    tolerance search counts its runs, whose number is not known ahead.
    """

    def __init__(self, enabled: bool, steps: Any = None, label: str = "calibrating"):
        self.enabled, self.label = enabled, label
        self.total = len(steps) if enabled and hasattr(steps, "__len__") else None

    def __enter__(self) -> Callable[..., None]:
        if not self.enabled:
            return lambda note="": None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bar

        counted = [MofNCompleteColumn()] if self.total is not None else []
        self.bar = Bar(TextColumn("{task.description}"), BarColumn(bar_width=12), *counted, TimeElapsedColumn(),
                       console=Console(stderr=True), transient=True)
        self.bar.start()
        task = self.bar.add_task(self.label, total=self.total)

        def advance(note: str = "") -> None:
            self.bar.update(task, advance=1, description=f"{self.label}: {note}" if note else self.label,
                            refresh=True)

        return advance

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self.bar.stop()


def _tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))
