"""Tolerance search: move the most sensitive low-precision nodes back to fp32 until the outputs are close.

Front-end neutral. The front end supplies two things: the local error of each node (its output replayed in
low precision on recorded inputs, relative to fp32; see :func:`amppass.fx.calibrate.calibrate`) and a
``measure(given)`` callback that paints, rewrites and runs the model on the calibration batches and returns
the largest relative output error ``||out - out_fp32|| / ||out_fp32||``.

The search ranks the nodes painted low by local error and moves growing prefixes of that ranking to fp32
(1, 2, 4, ... nodes), then bisects between the last prefix that missed and the first that met the
tolerance. Local error is not output error: a node can rank high and still not matter downstream. So the
search then *trims*: it gives the moved nodes back to low precision in groups (halves, then quarters, ...
of what is still moved), keeping each give-back that still meets the tolerance, for at most
``trim_runs(k)`` more runs for ``k`` moved nodes. Each step is one full run over the calibration data, so
a graph of ``n`` candidates costs at most about ``2 * log2(n) + 2 * log2(k)`` runs — never one run per
node or per segment.

If the tolerance is missed with every candidate in fp32, the search returns the all-fp32 plan, marks the
result ``met=False`` and logs a warning; it does not raise, because the model is still usable and the
report says how far from the tolerance it is.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Mapping

from ..dtypes import LowType
from .plan import Decision, Precision, PrecisionPlan, Source

log = logging.getLogger(__name__)

Measure = Callable[[Mapping[str, Decision]], float]


@dataclass
class SearchResult:
    """What the tolerance search decided and measured."""

    given: dict[str, Decision]  # the decisions to paint with: the caller's plus the nodes moved
    moved: list[str]
    achieved_error: float
    initial_error: float
    met: bool
    runs: int
    errors: list[tuple[int, float]] = field(default_factory=list)  # (nodes moved, error) per run


def rank(plan: PrecisionPlan, local_error: Mapping[str, float], given: Mapping[str, Decision]) -> list[str]:
    """Nodes painted low and not pinned by ``given`` (overrides, range rules), most sensitive first.

    Nodes whose local error could not be measured come last, in graph order; an infinite local error (the
    node overflows on its own) ranks first.
    """
    candidates = [n for n, d in plan.items() if d.precision is Precision.LOW and n not in given]
    return sorted(candidates, key=lambda n: -local_error[n] if _known(local_error.get(n)) else math.inf)


def search(
    plan: PrecisionPlan,
    given: Mapping[str, Decision],
    local_error: Mapping[str, float],
    tolerance: float,
    measure: Measure,
    low: LowType,
    on_run: Callable[[int, float], None] | None = None,
) -> SearchResult:
    """Smallest prefix of the sensitivity ranking that, moved to fp32, meets ``tolerance`` (module docstring).

    ``on_run(nodes moved, error)`` hears of every run as it ends (the progress bar); it changes nothing.
    """
    order = rank(plan, local_error, given)
    errors: list[tuple[int, float]] = []

    def run_with(moved: list[str]) -> float:
        error = measure(_with_moves(given, moved, local_error, low, order))
        errors.append((len(moved), error))
        log.info("tolerance search: %d node(s) in fp32 -> max relative output error %.3g", len(moved), error)
        if on_run is not None:
            on_run(len(moved), error)
        return error

    def run(k: int) -> float:
        return run_with(order[:k])

    initial = run(0)
    met_at, met_error, missed = (0, initial, -1) if initial <= tolerance else (None, math.inf, 0)
    step = 1
    while met_at is None and missed < len(order):
        k = min(missed + step, len(order))
        error = run(k)
        if error <= tolerance:
            met_at, met_error = k, error
        else:
            missed = k
        step *= 2
    if met_at is None:
        log.warning("tolerance %.3g not met even with all %d candidate nodes in fp32 (error %.3g)",
                    tolerance, len(order), errors[-1][1])
        return SearchResult(_with_moves(given, order, local_error, low, order), order, errors[-1][1], initial,
                            False, len(errors), errors)
    while met_at - missed > 1:  # bisect: the smallest prefix that meets the tolerance
        k = (missed + met_at) // 2
        error = run(k)
        if error <= tolerance:
            met_at, met_error = k, error
        else:
            missed = k
    moved, met_error = _trim(order[:met_at], met_error, tolerance, run_with)
    return SearchResult(_with_moves(given, moved, local_error, low, order), moved, met_error, initial, True,
                        len(errors), errors)


def trim_runs(moved: int) -> int:
    """The most runs the trim spends on ``moved`` nodes: two per halving level."""
    return 2 * math.ceil(math.log2(moved)) if moved > 1 else 0


def _trim(moved: list[str], error: float, tolerance: float,
          run_with: Callable[[list[str]], float]) -> tuple[list[str], float]:
    """Give groups of ``moved`` back to low precision while the tolerance holds (module docstring).

    Groups halve in size level by level; a level tries its first two groups of what is still moved, so the
    runs stay within :func:`trim_runs`. Returns the nodes still moved and the error measured with them.
    """
    kept, budget = list(moved), trim_runs(len(moved))
    size = len(kept) // 2
    while size >= 1 and budget > 0 and kept:
        start, tries = 0, 0
        while start < len(kept) and tries < 2 and budget > 0:
            trial = kept[:start] + kept[start + size:]
            budget, tries = budget - 1, tries + 1
            trial_error = run_with(trial)
            if trial_error <= tolerance:
                kept, error = trial, trial_error
            else:
                start += size
        size //= 2
    return kept, error


def _with_moves(given: Mapping[str, Decision], moved: list[str], local_error: Mapping[str, float],
                low: LowType, order: list[str]) -> dict[str, Decision]:
    result = dict(given)
    rank_of = {name: i for i, name in enumerate(order)}
    for name in moved:
        rank_index = rank_of[name]
        error = local_error.get(name)
        measured = f"{error:.2g}" if _known(error) else "not measurable"
        result[name] = Decision(
            Precision.FP32,
            f"moved back to fp32 to meet the output tolerance: its local {low} error ({measured}) "
            f"ranks #{rank_index + 1} among the low-precision nodes",
            Source.TOLERANCE,
            {"rule": "tolerance", "local_error": error, "rank": rank_index + 1},
        )
    return result


def _known(error: float | None) -> bool:
    return error is not None and not math.isnan(error)
