"""Tolerance search: move the most sensitive low-precision nodes back to fp32 until the outputs are close.

Front-end neutral. The front end supplies what it measured on the calibration data (a
:class:`Sensitivity`): the local error of each node (its output replayed in low precision on recorded
inputs, relative to fp32; see :func:`amppass.fx.runners.calibrate.calibrate`), where it can the part of that error
the node adds itself (not the rounding its low-precision producers already did, see
:mod:`amppass.onnx.calibrate`), and the gains computed from the norms of the values on one batch; and a
``measure(given)`` callback that paints, rewrites and runs the model on the calibration batches and returns
the largest relative output error ``||out - out_fp32|| / ||out_fp32||``.

The search ranks the candidates, the nodes painted low that no override or range rule pins, by their
estimated effect on the output, and moves growing prefixes of that ranking to fp32 (1, 2, 4, ... nodes),
then bisects between the last prefix that missed and the first that met the tolerance. An estimate is
not a measurement: a node can rank high and still not matter downstream. So the search then *trims*: it
gives the moved nodes back to low precision in groups (halves, then quarters, ... of what is still moved),
keeping each give-back that still meets the tolerance, for at most ``trim_runs(k)`` more runs for ``k``
moved nodes.

The ranking (:func:`by_region_effect`) estimates each candidate's effect as its own error times its gain,
the share of a relative error at its output that reaches the outputs (:mod:`amppass.analysis.propagation`:
additions and concatenations scale it by norm ratios), and corrects that estimate with runs: regions of
the graph are measured (alone in low precision, and moved to fp32), best first, in at most ``rank_runs(n) = 4 *
ceil(log2(n))`` runs for ``n``
candidates. Each step is one full run over the calibration data, so a search costs at most
``search_runs(n) = 1 + rank_runs(n) + 2 * ceil(log2(n)) + 1 + trim_runs(n)`` runs, about ``8 log2(n)``:
never one run per node or per segment. A trial is run once per set of nodes moved; a step that asks for
one already run reads its error back.

Other rankings are strategies of the same type (:data:`Ranking`): :func:`by_local_error`, which spends no
run, and :func:`by_error_alone`, which moves each candidate alone to fp32 and ranks by the output error that
leaves, one run per candidate: too slow for a conversion, it is the reference the default is measured
against (``benchmarks/tolerance_reference.py``). ``with ranking(by_error_alone): amppass.convert_onnx(...)``
runs conversions with another strategy.

If the tolerance is missed with every candidate in fp32, the search returns the all-fp32 plan, marks the
result ``met=False`` and logs a warning; it does not raise, because the model is still usable and the
report says how far from the tolerance it is.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping, Sequence

from ..dtypes import LowType
from .plan import Decision, Precision, PrecisionPlan, Source

log = logging.getLogger(__name__)

Measure = Callable[[Mapping[str, Decision]], float]
RunWith = Callable[[list[str]], float]  # the output error with these candidates moved to fp32 (one run)
# Student's t quantiles for a one-sided 95% bound, by degrees of freedom (1 to 10): the standard deviations of the
# per-batch errors :func:`batch_bound` adds for n batches (n - 1 degrees of freedom)
_T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812)
_Z95 = 1.645  # its limit for many batches
JUDGED = 8  # at most this many calibration batches, the last ones, judge each trial of an fp8 tolerance search
BOUND_RULE = ("one-sided 95% prediction bound for a new batch, mean + t(0.95, n - 1) x standard deviation x "
              "sqrt(1 + 1/n) of the n judged batches' errors, at least the largest")  # :func:`batch_bound`'s rule


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
    ranked: "Ranked | None" = None  # the ranking the search moved nodes by (None: nothing needed moving)


@dataclass(frozen=True)
class Sensitivity:
    """What the front end measured about each candidate before the search runs anything."""

    local_error: Mapping[str, float]  # node -> relative error of its output replayed in low precision
    # node -> the part of its local error it adds itself (not its low producers' rounding of its inputs)
    added_error: Mapping[str, float] = field(default_factory=dict)
    gain: Mapping[str, float] = field(default_factory=dict)  # node -> propagation.gains; 1 where absent

    def own(self, node: str) -> float | None:
        """The error ``node`` adds itself (its local error where that was not measured apart)."""
        return self.added_error.get(node, self.local_error.get(node))

    def estimate(self, node: str) -> float:
        """``own error * gain``: the node's estimated relative effect on the output; NaN where its error was
        not measured, inf where it overflows on its own."""
        error = self.own(node)
        if not _known(error) or math.isinf(error):
            return math.nan if not _known(error) else math.inf
        return error * self.gain.get(node, 1.0)


@dataclass(frozen=True)
class Ranked:
    """Candidates in the order the search moves them, and what they were ranked by."""

    order: list[str]  # most worth moving to fp32 first
    scores: Mapping[str, float]  # the number each candidate was ranked by (NaN where not measured)
    measure: str  # what that number is, for the reasons of the nodes moved ("local fp16 error")


# (candidates in graph order, sensitivity, run_with, the error with every candidate low, low dtype) -> the
# ranking; the runs it spends count as the search's runs
Ranking = Callable[[list[str], Sensitivity, RunWith, float, LowType], Ranked]


def by_local_error(candidates: list[str], sensitivity: Sensitivity, run_with: RunWith, initial: float,
                   low: LowType) -> Ranked:
    """Local error, largest first; no run. Nodes whose local error could not be measured come last, in
    graph order; an infinite local error (the node overflows on its own) ranks first."""
    local = sensitivity.local_error
    order = sorted(candidates, key=lambda n: -local[n] if _known(local.get(n)) else math.inf)
    return Ranked(order, {n: local.get(n, math.nan) for n in candidates}, f"local {low} error")


def by_error_alone(candidates: list[str], sensitivity: Sensitivity, run_with: RunWith, initial: float,
                   low: LowType) -> Ranked:
    """The reference: each candidate alone moved to fp32, one run each; the lowest output error left first
    (ties by estimated effect). Linear in the number of candidates: for benchmarks, not conversions."""
    alone = {n: run_with([n]) for n in candidates}
    estimate = {n: sensitivity.estimate(n) for n in candidates}
    order = sorted(candidates, key=lambda n: (alone[n], -estimate[n] if _known(estimate[n]) else math.inf))
    return Ranked(order, alone, "output error with it alone in fp32")


def by_region_effect(candidates: list[str], sensitivity: Sensitivity, run_with: RunWith, initial: float,
                     low: LowType, splits: int | None = None) -> Ranked:
    """The default: each candidate's estimated effect (its own error times its gain), checked and scaled by
    regions of the graph measured in runs.

    A region is a run of candidates in graph order. Its *effect* is measured twice: its rounding alone (the
    squared output error with only its nodes low, every other candidate in fp32) and what moving it to fp32
    removes (the initial squared error less the squared error left with it in fp32). While roundings add in
    squares the two agree; where they interact, errors that saturate (the sensor net's early convolutions:
    removing one of two leaves the output as wrong) or compound (a class token the pooler reads), each
    misses what the other sees, so the effect is their mean. Best first, the region with the largest effect
    is split in halves and both halves measured (at most four runs: the first split's halves are each
    other's complements, so two), ``splits`` times (default ``ceil(log2(n))``);
    a region's nodes share its effect in proportion to their squared estimates.

    How far the gains are trusted is decided by those runs: the estimate is ``own error * gain ** t`` for
    the ``t`` in (0, 1/2, 1) whose shares best predict how each split region's effect divided between its
    halves (the gains model additions, not the token or channel a later op selects, nor a softmax that
    flattens a perturbation). Nodes then rank by their share of their final region's effect. A node that
    overflows on its own (infinite local error) ranks first; one whose error was not measured gets the
    median estimate."""
    n = len(candidates)
    splits = (math.ceil(math.log2(n)) if n > 1 else 0) if splits is None else splits
    regions: list[tuple[int, int, float]] = [(0, n, initial ** 2)]  # (start, end, squared effect)
    divided: list[tuple[int, int, int, float]] = []  # (start, middle, end, measured share of the first half)

    def effect(start: int, end: int) -> float:
        alone = run_with(candidates[:start] + candidates[end:]) ** 2
        removed = max(initial ** 2 - run_with(candidates[start:end]) ** 2, 0.0)
        return (alone + removed) / 2

    for _ in range(splits):
        splittable = [r for r in regions if r[1] - r[0] > 1 and math.isfinite(r[2])]
        if not splittable:
            break
        region = max(splittable, key=lambda r: r[2])
        regions.remove(region)
        start, end, _effect = region
        middle = (start + end) // 2
        halves = [(start, middle, effect(start, middle)), (middle, end, effect(middle, end))]
        regions += halves
        if halves[0][2] + halves[1][2] > 0:
            divided.append((start, middle, end, halves[0][2] / (halves[0][2] + halves[1][2])))
    trust = min(_TRUST, key=lambda t: _misfit(_weights(candidates, sensitivity, t), candidates, divided))
    weight = _weights(candidates, sensitivity, trust)
    share: dict[str, float] = {}
    for start, end, squared in regions:
        members = candidates[start:end]
        total = sum(weight[m] for m in members)
        for m in members:
            share[m] = math.sqrt(squared * (weight[m] / total if total > 0 else 1 / len(members)))
    overflows = {m for m in candidates if sensitivity.estimate(m) == math.inf}
    order = sorted(candidates, key=lambda m: (m not in overflows, -share[m]))
    return Ranked(order, share, f"estimated effect on the output (its own {low} error x gain^{trust:g}, scaled "
                                "by the runs of its region)")


_TRUST = (0.0, 0.5, 1.0)  # exponents of the gain the region runs choose between


def _misfit(weight: Mapping[str, float], candidates: list[str], divided: list[tuple[int, int, int, float]]) -> float:
    """How badly ``weight`` predicts the measured division of each split region between its halves."""
    loss = 0.0
    for start, middle, end, measured in divided:
        first = sum(weight[m] for m in candidates[start:middle])
        total = first + sum(weight[m] for m in candidates[middle:end])
        loss += ((first / total if total > 0 else 0.5) - measured) ** 2
    return loss


def _weights(candidates: list[str], sensitivity: Sensitivity, trust: float = 1.0) -> dict[str, float]:
    """Squared estimates ``(own error * gain ** trust) ** 2``; an unmeasured (or overflowing) node gets
    the median of the finite ones."""
    estimates = {}
    for m in candidates:
        own = sensitivity.own(m)
        known = _known(own) and math.isfinite(own)
        estimates[m] = own * sensitivity.gain.get(m, 1.0) ** trust if known else math.nan
    finite = sorted(e * e for e in estimates.values() if _known(e))
    typical = finite[len(finite) // 2] if finite else 1.0
    return {m: e * e if _known(e) else typical for m, e in estimates.items()}


_RANKING: contextvars.ContextVar[Ranking] = contextvars.ContextVar("amppass_tolerance_ranking",
                                                                   default=by_region_effect)


@contextlib.contextmanager
def ranking(strategy: Ranking) -> Iterator[None]:
    """Run the tolerance searches of the conversions inside the ``with`` block with ``strategy``."""
    token = _RANKING.set(strategy)
    try:
        yield
    finally:
        _RANKING.reset(token)


def search(
    plan: PrecisionPlan,
    given: Mapping[str, Decision],
    sensitivity: Sensitivity | Mapping[str, float],
    tolerance: float,
    measure: Measure,
    low: LowType,
    on_run: Callable[[int, float], None] | None = None,
    rank_with: Ranking | None = None,
) -> SearchResult:
    """Smallest prefix of the sensitivity ranking that, moved to fp32, meets ``tolerance`` (module docstring).

    The candidates are the nodes ``plan`` paints low that ``given`` (overrides, range rules) does not pin.
    ``sensitivity`` is what was measured about them (a mapping: their local errors alone). ``rank_with``
    orders the candidates (default: the :func:`ranking` in effect, :func:`by_region_effect` unless set).
    ``on_run(nodes moved, error)`` hears of every run as it ends (the progress bar); it changes nothing.
    """
    candidates = [n for n, d in plan.items() if d.precision is Precision.LOW and n not in given]
    if not isinstance(sensitivity, Sensitivity):
        sensitivity = Sensitivity(sensitivity)
    errors: list[tuple[int, float]] = []
    measured: dict[frozenset[str], float] = {}  # a trial depends only on the set moved: never run one twice

    def run_with(moved: list[str]) -> float:
        key = frozenset(moved)
        if key in measured:
            return measured[key]
        error = measured[key] = measure(_trial(given, moved))
        errors.append((len(moved), error))
        log.info("tolerance search: %d node(s) in fp32 -> max relative output error %.3g", len(moved), error)
        if on_run is not None:
            on_run(len(moved), error)
        return error

    initial = run_with([])
    if initial <= tolerance:
        return SearchResult(dict(given), [], initial, initial, True, len(errors), errors)
    ranked = (rank_with or _RANKING.get())(candidates, sensitivity, run_with, initial, low)
    order = ranked.order

    def run(k: int) -> float:
        return run_with(order[:k])

    met_at, met_error, missed = None, math.inf, 0
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
        return SearchResult(_with_moves(given, order, sensitivity, ranked), order, errors[-1][1], initial,
                            False, len(errors), errors, ranked)
    while met_at - missed > 1:  # bisect: the smallest prefix that meets the tolerance
        k = (missed + met_at) // 2
        error = run(k)
        if error <= tolerance:
            met_at, met_error = k, error
        else:
            missed = k
    moved, met_error = _trim(order[:met_at], met_error, tolerance, run_with)
    return SearchResult(_with_moves(given, moved, sensitivity, ranked), moved, met_error, initial, True,
                        len(errors), errors, ranked)


def longest_within(count: int, within: Callable[[int], bool]) -> int:
    """The largest ``k`` in ``0..count`` for which ``within(k)`` holds, where it holds up to some ``k`` and not after
    (an output error that grows with the number of products lowered): ``within(count)`` first, then a bisection;
    ``within(0)`` is never asked (0 is the answer where nothing else holds)."""
    if count == 0 or within(count):
        return count
    low, high = 0, count  # within(low) holds (or low is 0), within(high) does not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if within(middle) else (low, middle)
    return low


def batch_bound(errors: Sequence[float]) -> float:
    """An upper bound on the output error of a batch the search did not see, from one plan's error on each of the
    ``n`` batches of ``errors``: the one-sided 95% prediction bound for one new batch of the same source, were the
    batches' errors normal, ``mean + t * s * sqrt(1 + 1/n)`` (``s`` their standard deviation, ``t`` Student's 95%
    quantile for ``n - 1`` degrees of freedom: :func:`spreads`), and never below the largest error measured. One
    batch shows no spread: its error is the bound."""
    if len(errors) < 2:
        return max(errors, default=0.0)
    mean = math.fsum(errors) / len(errors)
    deviation = math.sqrt(math.fsum((e - mean) ** 2 for e in errors) / (len(errors) - 1))
    return max(max(errors), mean + spreads(len(errors)) * deviation * math.sqrt(1 + 1 / len(errors)))


BatchError = Callable[[int], float]  # one trial's output error on judged batch i (0 to batches - 1)
STOP_EARLY = True  # whether :class:`JudgedTrials` stops a trial at its first batch beyond the tolerance


class JudgedTrials:
    """The trials of an fp8 tolerance search, each a set of products in fp8 judged by :func:`batch_bound` of its
    output errors on ``batches`` judged batches, both front ends' memo and early stop.

    ``start(names)`` prepares one trial (the products ``names`` in fp8) and returns its :data:`BatchError`; it is
    called at most once per trial while the trial runs, so a front end builds its trial model and sessions once. A
    trial depends only on its set of products: each batch of it is run once. Since the bound is never below the
    largest batch error, a trial whose error on one batch is beyond ``tolerance`` is beyond it whatever the other
    batches give: :meth:`error` runs a trial's batches one at a time, the batch that was the worst in the most trials
    so far first, and stops at the first beyond the tolerance (:data:`STOP_EARLY`). Its decisions are those of
    judging every batch; of a trial stopped early it knows only a lower bound, which :meth:`words` says."""

    def __init__(self, start: Callable[[frozenset[str]], BatchError], batches: int, tolerance: float):
        self.start, self.batches, self.tolerance = start, batches, tolerance
        self.seen: dict[frozenset[str], dict[int, float]] = {}  # trial -> its error on each batch run so far
        self.worst = [0] * batches  # per batch: in how many trials it was the worst (or the one beyond)
        self.runs = 0  # batch runs, over every trial

    def error(self, names: Iterable[str]) -> float:
        """The bound on a new batch's output error with ``names`` in fp8, where it is within the tolerance; beyond
        it, the largest batch error run (the bound where every batch ran): above the tolerance either way."""
        seen = self._run(frozenset(names), complete=False)
        if len(seen) == self.batches:
            return batch_bound([seen[b] for b in range(self.batches)])
        return max(e for e in seen.values() if e > self.tolerance)

    def measured(self, names: Iterable[str]) -> list[float]:
        """The output error of every judged batch with ``names`` in fp8, in batch order (the batches a trial stopped
        early did not run are run now)."""
        seen = self._run(frozenset(names), complete=True)
        return [seen[b] for b in range(self.batches)]

    def known(self, names: Iterable[str]) -> bool:
        """Whether :meth:`error` of ``names`` is the bound (every batch ran), not a lower bound on it."""
        return len(self.seen.get(frozenset(names), ())) == self.batches

    def words(self, names: Iterable[str], spec: str = ".3g") -> str:
        """:meth:`error` of ``names`` in words: the bound, or for a trial stopped early the batch error that stopped
        it, "at least 0.031 on one batch of 8"."""
        names = frozenset(names)
        error = self.error(names)
        return format(error, spec) if self.known(names) else f"at least {error:{spec}} on one batch of {self.batches}"

    def _run(self, key: frozenset[str], complete: bool) -> dict[int, float]:
        """The batch errors of trial ``key``, running its batches not yet run, worst first, until one is beyond the
        tolerance (every one where ``complete`` or not :data:`STOP_EARLY`)."""
        seen = self.seen.setdefault(key, {})
        if not complete and STOP_EARLY and any(e > self.tolerance for e in seen.values()):
            return seen
        error = None
        for batch in sorted(range(self.batches), key=lambda b: (-self.worst[b], b)):
            if batch in seen:
                continue
            error = error or self.start(key)
            seen[batch] = error(batch)
            self.runs += 1
            if seen[batch] > self.tolerance and STOP_EARLY and not complete:
                break
        if error is not None:
            self.worst[max(seen, key=lambda b: seen[b])] += 1
        return seen


def judged(errors: Sequence[float]) -> dict[str, object]:
    """What a search judged by :func:`batch_bound` records of the plan it kept, from that plan's error on each
    judged batch: those errors (``batch_errors``, ``judged_batches``), their largest (``output_error``), the bound
    (``error_bound``, with ``bound_rule``) and what it adds to the largest (``margin``)."""
    largest, bound = max(errors, default=0.0), batch_bound(errors)
    return {"output_error": largest, "error_bound": bound, "margin": bound - largest, "batch_errors": list(errors),
            "bound_rule": BOUND_RULE, "judged_batches": len(errors)}


def spreads(batches: int) -> float:
    """The standard deviations :func:`batch_bound` adds for ``batches`` (at least two): Student's t 95% quantile
    for ``batches - 1`` degrees of freedom (tabled to 10; beyond, its Cornish-Fisher expansion, within 0.02)."""
    freedom = batches - 1
    if freedom <= len(_T95):
        return _T95[freedom - 1]
    return _Z95 + (_Z95 ** 3 + _Z95) / (4 * freedom)


def search_runs(candidates: int, ranked: bool = False) -> int:
    """The most runs one :func:`search` spends on ``candidates`` nodes with the default ranking: the initial run,
    the ranking's (none when ``ranked``: a ranking from before, :func:`ranked_before`), the growing prefixes,
    the bisection and the trim (for at most every candidate moved)."""
    levels = math.ceil(math.log2(candidates)) if candidates > 1 else 0
    return 1 + (0 if ranked else rank_runs(candidates)) + (levels + 1) + levels + trim_runs(candidates)


def ranked_before(previous: Ranked) -> Ranking:
    """A ranking that spends no run: ``previous``'s order, of the candidates still low. A search that goes
    on from an earlier one (with a tighter tolerance) moves nodes in the order that one measured."""

    def rank(candidates: list[str], sensitivity: Sensitivity, run_with: RunWith, initial: float,
             low: LowType) -> Ranked:
        left = set(candidates)
        order = [n for n in previous.order if n in left] + [n for n in candidates if n not in previous.scores]
        return Ranked(order, previous.scores, previous.measure)

    return rank


def rank_runs(candidates: int) -> int:
    """The most runs :func:`by_region_effect` spends on ``candidates`` nodes: four per split."""
    return 4 * math.ceil(math.log2(candidates)) if candidates > 1 else 0


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


def _trial(given: Mapping[str, Decision], moved: list[str]) -> dict[str, Decision]:
    """The decisions one run paints with: ``given`` plus ``moved`` in fp32 (reasons come with the result)."""
    trial = dict(given)
    trial.update({name: Decision(Precision.FP32, "tolerance trial", Source.TOLERANCE, rule="tolerance")
                  for name in moved})
    return trial


def _with_moves(given: Mapping[str, Decision], moved: list[str], sensitivity: Sensitivity,
                ranked: Ranked) -> dict[str, Decision]:
    result = dict(given)
    rank_of = {name: i for i, name in enumerate(ranked.order)}
    for name in moved:
        rank_index = rank_of[name]
        score = ranked.scores.get(name)
        measured = f"{score:.2g}" if _known(score) else "not measurable"
        result[name] = Decision(
            Precision.FP32,
            f"moved back to fp32 to meet the output tolerance: its {ranked.measure} ({measured}) "
            f"ranks #{rank_index + 1} among the low-precision nodes",
            Source.TOLERANCE,
            {"rule": "tolerance", "local_error": sensitivity.local_error.get(name),
             "gain": sensitivity.gain.get(name), "rank": rank_index + 1}, rule="tolerance",
        )
    return result


def _known(error: float | None) -> bool:
    return error is not None and not math.isnan(error)
