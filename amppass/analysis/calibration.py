"""Calibration steps both front ends share, once their data pass has filled :class:`CalibrationStats`.

A front end runs its fp32 model on the caller's batches (``amppass.fx.calibrate`` through a torch.fx
Interpreter, ``amppass.onnx.calibrate`` through onnxruntime), measures each candidate node's local error
if a tolerance was asked for, and hands over to :func:`plan_from_stats`: range rules, user overrides on top,
painting, the tolerance search and the metadata both front ends record (``calibrated``,
``calibration_batches``, ``tolerance``, ``achieved_error``, ...). It also holds the argument check, the error
measure and the progress bar the front ends share (calibration batches, then the tolerance search's runs).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Mapping

import numpy as np
import torch

from ..dtypes import LowType
from ..errors import InputError
from . import propagation
from . import tolerance as search_tolerance
from .painting import paint
from .plan import Decision, PrecisionPlan
from .rules import range_decisions
from .stats import CalibrationStats
from .view import GraphView


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


def plan_from_stats(
    view: GraphView,
    stats: CalibrationStats,
    low: LowType,
    given: Mapping[str, Decision],
    *,
    batches: int,
    seconds: float,
    low_weight_tables: bool = False,
    tolerance: float | None = None,
    local_error: Mapping[str, float] | None = None,
    added_error: Mapping[str, float] | None = None,
    norms: Mapping[str, float] | None = None,
    run_plan: Callable[[PrecisionPlan], float] | None = None,
    progress: bool = False,
) -> tuple[PrecisionPlan, dict[str, Any]]:
    """The calibrated plan and the metadata to store with the converted model.

    ``given`` (user overrides) wins over the range rules. With ``tolerance``, ``run_plan(plan)`` returns the
    largest relative output error of the model rewritten by ``plan`` over the calibration data, and
    ``local_error`` (and ``added_error``, the part of it each node adds itself) with ``norms`` (values' L2
    norms on one batch, for :mod:`amppass.analysis.propagation`) ranks the nodes the search of
    :mod:`amppass.analysis.tolerance` moves back to fp32;
    ``progress`` shows each of its runs (nodes moved, error) on a progress bar on stderr.
    Every node's observed output range lands in its evidence, for the report's range plot.
    """
    ranges = range_decisions(view, stats, low)
    merged = {**ranges, **given}  # user overrides win over calibration
    plan = paint(view, low, merged, low_weight_tables=low_weight_tables)
    info: dict[str, Any] = {
        "calibrated": True, "calibration_batches": batches,
        "calibration_seconds": round(seconds, 3), "calibration_decisions": len(ranges),
    }
    if tolerance is not None and run_plan is not None:

        def measure(decisions: Mapping[str, Decision]) -> float:
            return run_plan(paint(view, low, decisions, low_weight_tables=low_weight_tables))

        with Progress(progress, label="tolerance search") as advance:
            runs = itertools.count(1)

            def show(moved: int, error: float) -> None:
                verdict = "<=" if error <= tolerance else ">"
                advance(f"run {next(runs)}, {moved} nodes fp32, error {error:.2g} {verdict} {tolerance:.2g}")

            sensitivity = search_tolerance.Sensitivity(local_error or {}, added_error or {},
                                                       propagation.gains(view, norms or {}))
            found = search_tolerance.search(plan, merged, sensitivity, tolerance, measure, low, on_run=show)
        info.update({
            "tolerance": tolerance, "achieved_error": found.achieved_error, "initial_error": found.initial_error,
            "tolerance_met": found.met, "moved_by_tolerance": len(found.moved), "tolerance_runs": found.runs,
        })
        plan = paint(view, low, found.given, low_weight_tables=low_weight_tables)
    return with_ranges(plan, view, stats), info


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


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (or its type), for one-line errors and logs."""
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


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
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn

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
