"""Profitability: run a part of the plan in low precision only where that is faster on the target device.

Low-precision kernels are not always faster. On CPUs without AMX, oneDNN's bf16 depthwise and grouped
convolutions are slower than fp32; small matrix products gain nothing and pay for the casts around them;
a CPU without native bf16/fp16 instructions runs every low-precision kernel several times slower. So after
painting, the plan is checked against the target device. This module holds the rule, for any front end: the
regions of a plan, where their times come from, and what is decided on them. A front end gives it each
region's calls (:class:`TimedCall`; :mod:`amppass.fx.runners.region_timing` builds them for torch.fx), and a
:class:`TimingSource` for the device (:class:`amppass.targets.cost_model.DeviceFacts`).

1. Regions: the nodes painted low form connected regions (two low nodes are in one region when one reads
   the other's output). A region runs low or fp32 as a whole, so the casts it needs are exactly those on
   its boundary: an fp32 value read by a region node (a graph input, an fp32 op's output) is cast down
   once, a region value read outside the region in fp32 (or returned, with ``keep_io_types``) is cast up
   once. Weights are converted ahead of time in inference and cost nothing per call.
2. Costs: every region node has a time in fp32 and in the low dtype, every boundary cast a time, on
   inputs of the shapes the example inputs give it, under a key of op, shapes, dtypes and arguments
   (:class:`amppass.targets.cost_model.CostModel`). A region's times come from the first of these that has them
   all, and the report names it for every region (``info["profitability"]["regions"]``, and the reason of each
   fp32 decision):

   - ``table``: the cost table passed as ``costs=`` (a converted model's ``info["costs"]``);
   - ``device``: the device has no native arithmetic for the low dtype (:func:`amppass.targets.device.native_low`):
     nothing can win there, so the region runs fp32 without timing a kernel;
   - ``cached``: the device's timing cache (:mod:`amppass.targets.timing_cache`, kept across processes) or an
     earlier conversion in this process;
   - ``measured``: the region's kernels timed now, fp32 and low variants in interleaved rounds
     (:func:`amppass.targets.measure.interleaved`) that leave out every round during which a thread of this
     process waited for a CPU. Each kernel's time is its median over the undisturbed samples, the low side
     scaled so that the region's ratio is the median of the undisturbed rounds' ratios. The measurement
     counts only with at least three such rounds whose ratios tell (:func:`amppass.targets.measure.agree`: their
     interquartile range at most :data:`~amppass.targets.cost_model.SPREAD_LIMIT` of their median, or the
     decision's ``1 - MARGIN`` outside the 95% interval of their median); then its times are stored in the
     timing cache;
   - ``prior``: the rounds did not tell (the machine is too busy): the times are estimated from the
     device's roofline (:mod:`amppass.targets.prior`), the region is decided on them, and nothing is cached.
     Once :data:`GIVE_UP` regions in a row, over a second or more, had no undisturbed round at all, the
     conversion stops timing and estimates the rest (timing them would only cost time).

   Every kernel of a region is called once before any timing or estimate: a low-precision kernel that
   raises where its fp32 twin runs (a missing kernel the kernel facts of :mod:`amppass.fx.view.low_kernels` did not
   know of) makes its node fp32 with that reason, never a crash at run time.
   A region whose ops cannot run alone on synthetic inputs is kept as painted (``unmeasured``). A region
   is labelled with the most doubtful source among its times. Where some of its times are known
   and others are measured now, the new ones are scaled so that the known (not estimated) ones agree with
   them: a busy machine's times are slower, not different in ratio. Estimates are never scaled, so a
   prior's times depend on the op and the device alone.
3. Decision: a region stays low when its low kernels plus its casts take at most ``1 - MARGIN`` of its fp32
   time; otherwise every LOW-category node in it gets an fp32 decision whose reason gives both times and
   their source, and painting then runs the region's element-wise ops fp32 too. The margin keeps timing
   noise from flipping near-even regions, and a near-even region runs fp32: never slower than fp32. The
   decision is made from the recorded (rounded) table, so the table alone reproduces it.

4. Whole model (:func:`amppass.fx.runners.region_timing.whole_model`, used by :func:`amppass.convert`): the
   converted graph against the original module in fp32; where the original is faster, it is kept
   (:mod:`amppass.serving.fp32_original`). That throws the whole plan away, so it is done only from a saved table, the
   timing cache (under a digest of the converted graph, so another model of the same class never reads it), or
   rounds that other load left undisturbed; it is not timed at all where the last region's timing had no
   undisturbed round.

5. Decided before capture: ``mode="train"`` plans time no region (a train graph's kernels are not the ones its
   backward runs), nor does ``torch.compile(backend="amppass")`` in either mode (eager kernels say nothing of the
   fused code inductor makes), so rule 2's ``device`` case is decided for the whole plan before anything is
   captured (:func:`fp32_by_device`): on a device without native arithmetic for the low dtype, a plan for speed
   would keep every op fp32, so the model is not captured at all and :func:`amppass.convert` in train mode returns
   the original, kept in fp32 with its own copy of the weights (:mod:`amppass.serving.fp32_original`), at no
   conversion cost; the compile backend, in training and inference, runs its graphs as dynamo traced them.
   ``force_low=`` (ops the user wants low whatever the device) and ``costs=`` (a table made for another device)
   make a plan as before; ``plan_for="coverage"`` paints low as always.

The table of every time used is stored in the converted model's metadata (``info["costs"]``); passing it
back as ``costs=`` makes a conversion reuse those times instead of measuring, so a plan is reproducible
across processes and machines.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Mapping, Protocol

import torch

from ..dtypes import LowType
from ..errors import first_line
from ..targets.cost_model import SPREAD_LIMIT, CostModel, DeviceFacts
from ..targets.device import Native
from ..targets.measure import Timings, agree, spread
from ..targets.prior import Prior
from ..targets.target import Target
from .options import PlanOptions
from .plan import Category, Decision, Precision, PrecisionPlan, Source
from .record import summary
from .view import GraphView

log = logging.getLogger(__name__)

MARGIN = 0.05  # a low region must save at least this share of its fp32 time
ROUNDS = 9  # undisturbed interleaved rounds per region measurement (up to three times as many where they disagree)
CLEAR = (0.3, 3.0)  # round ratios all below / all above these: clear-cut after three undisturbed rounds
GIVE_UP = (3, 1.0)  # regions in a row, and seconds, without one undisturbed round: then a conversion stops timing
SOURCES = ("table", "cached", "measured", "prior")  # rule 2, in increasing order of doubt


@dataclass(frozen=True)
class Region:
    """Connected low nodes and the values crossing their boundary."""

    nodes: tuple[str, ...]
    cast_in: tuple[str, ...]  # fp32 values cast down for the region
    cast_out: tuple[str, ...]  # region values cast up for readers outside it


def regions(view: GraphView, plan: PrecisionPlan, keep_io_types: bool) -> list[Region]:
    """Rule 1: the connected low regions of ``plan``, in graph order."""
    low = {n.name for n in view.nodes if n.name in plan and plan[n.name].precision is Precision.LOW}
    producer = view.producers()
    parent = {name: name for name in low}

    def find(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    for node in view.nodes:
        if node.name not in low:
            continue
        for value in node.inputs:
            source = producer.get(value)
            if source is not None and source.name in low:
                parent[find(node.name)] = find(source.name)
    groups: dict[str, list[str]] = {}
    for node in view.nodes:
        if node.name in low:
            groups.setdefault(find(node.name), []).append(node.name)
    readers = {value: [n.name for n in nodes] for value, nodes in view.consumers().items()}
    by_name = {n.name: n for n in view.nodes}
    outputs = set(view.outputs)
    found = []
    for members in groups.values():
        inside = set(members)
        cast_in = {v for name in members for v in by_name[name].inputs if v not in view.weights
                   and (producer.get(v) is None or producer[v].name not in inside)}
        cast_out = {v for name in members for v in by_name[name].outputs
                    if any(r not in inside and _reads_fp32(plan, r) for r in readers.get(v, []))
                    or (keep_io_types and v in outputs)}
        found.append(Region(tuple(members), tuple(sorted(cast_in)), tuple(sorted(cast_out))))
    return found


def _reads_fp32(plan: PrecisionPlan, name: str) -> bool:
    """Whether node ``name`` reads its float inputs in fp32 (an fp32-accumulating op takes them low)."""
    return name in plan and plan[name].precision is Precision.FP32


@dataclass(frozen=True)
class TimedCall:
    """One thing a region's decision adds up: a node's kernel in fp32 or low precision, or a cast."""

    key: str  # the cost-table key: op, shapes, dtypes, arguments, device
    kind: str  # "fp32", "low" or "cast"
    call: Callable[[], Any]
    prior: Callable[[Prior], float]  # its estimated seconds under a device prior
    node: str = ""  # the node whose kernel it times ("" for a cast)

    @property
    def side(self) -> int:
        """Which side of the region's comparison it is on: fp32 (0), or low kernels and casts (1)."""
        return 0 if self.kind == "fp32" else 1


class TimingSource(Protocol):
    """The device as the rule needs it (:class:`amppass.targets.cost_model.DeviceFacts` is the real one)."""

    native: Native  # whether the device runs the low dtype natively, and why

    @property
    def kind(self) -> str:
        """The device's kind as a reason names it ("CPU")."""

    def prior(self) -> Prior:
        """The device's cost prior, for estimates."""

    def time(self, calls: list[Callable[[], Any]], sides: list[int | None], settled: Callable[[list[float]], bool],
             max_rounds: int, weights: list[int] | None = None) -> Timings:
        """``calls`` timed in interleaved rounds (:func:`amppass.targets.measure.interleaved`)."""


class Unmeasurable(Exception):
    """A node that cannot be timed alone (no recorded inputs, an op that fails on synthetic values)."""


class LowFailed(Exception):
    """A node whose low-precision call raised where its fp32 call ran: no low kernel for it here."""

    def __init__(self, node: str, error: BaseException):
        super().__init__(node)
        self.node = node
        self.error = first_line(error, 200)


class Profitability:
    """Rules 2 and 3 for one conversion: the times of each region's calls in ``costs``, from ``device`` where
    nothing holds them, and the fp32 decisions they give. It remembers how many regions in a row the machine
    was too busy to time (:data:`GIVE_UP`)."""

    def __init__(self, costs: CostModel, device: TimingSource, low: LowType):
        self.costs, self.device, self.low = costs, device, low
        self.misses, self._missing_since = 0, 0.0  # regions in a row whose timing had no undisturbed round
        self._said = False

    def decide(self, found: Iterable[Region], calls: Callable[[Region], list[TimedCall]],
               categories: Mapping[str, Category], given: Mapping[str, Decision],
               ) -> tuple[dict[str, Decision], list[dict[str, Any]]]:
        """Rules 2 and 3: fp32 decisions for the LOW-category nodes of the regions ``found`` that are not faster
        low (``calls`` gives a region's timed calls), and one record per region (its first node, size, outcome,
        times and their source) for the report."""
        costs, low, kind = self.costs, self.low, self.device.kind
        decisions: dict[str, Decision] = {}
        records = []
        for region in found:
            record: dict[str, Any] = {"first": region.nodes[0], "nodes": len(region.nodes)}
            try:
                items = calls(region)
                record["timing"] = self.time_region(items)
            except Unmeasurable as why:
                log.debug("profitability: region of %s not measured (%s); kept as painted", region.nodes[0], why)
                records.append({**record, "runs": low.name, "timing": "unmeasured"})
                continue
            except LowFailed as failed:  # a missing low kernel the kernel facts did not know of: never a crash
                if failed.node not in given:
                    decisions[failed.node] = Decision(
                        Precision.FP32, f"its {low} kernel raised when timed on this {kind} "
                        f"({failed.error}); runs fp32", Source.PROFITABILITY, {"rule": "profitability"},
                        rule="low-kernel-failed")
                records.append({**record, "runs": "fp32", "timing": "low kernel failed"})
                continue
            if record["timing"] == "device":
                reason = f"profitability: {self.device.native.reason}; runs fp32 (not timed)"
                evidence: dict[str, Any] = {"rule": "profitability", "timing": "device", "region": len(region.nodes)}
            else:
                fp32, lowered, casts = (sum(costs.used[item.key] for item in items if item.kind == kind_)
                                        for kind_ in ("fp32", "low", "cast"))
                record.update(fp32_us=round(fp32 * 1e6, 2), low_us=round(lowered * 1e6, 2),
                              casts_us=round(casts * 1e6, 2))
                if lowered + casts <= (1 - MARGIN) * fp32:
                    records.append({**record, "runs": low.name})
                    continue
                count = len(region.cast_in) + len(region.cast_out)
                reason = (f"profitability: on this {kind} its region of {len(region.nodes)} node(s) takes "
                          f"{_us(lowered)} in {low} plus {_us(casts)} for {count} cast(s), against {_us(fp32)} in "
                          f"fp32 ({_SOURCE_WORDS[record['timing']]}); runs fp32")
                evidence = {"rule": "profitability", "timing": record["timing"], "low_us": record["low_us"],
                            "casts_us": record["casts_us"], "fp32_us": record["fp32_us"], "region": len(region.nodes)}
            records.append({**record, "runs": "fp32"})
            for name in region.nodes:
                if name not in given and categories.get(name) is Category.LOW:
                    decisions[name] = Decision(Precision.FP32, reason, Source.PROFITABILITY, dict(evidence),
                                               rule="profitability")
        costs.save()
        return decisions, records

    def time_region(self, items: list[TimedCall]) -> str:
        """Rule 2: give every key of ``items`` a time in the costs; return where the region's times came from
        (one of :data:`SOURCES`, or "device" where nothing is timed because nothing can win)."""
        costs = self.costs
        unique: dict[str, TimedCall] = {}
        weights: dict[str, int] = {}
        for item in items:
            unique.setdefault(item.key, item)
            weights[item.key] = weights.get(item.key, 0) + 1
        known = {key: costs.lookup(key) for key in unique}
        if all(value is not None for value in known.values()):
            return max((costs.sources[key] for key in unique), key=SOURCES.index)
        if not self.device.native.native:
            return "device"
        keys = list(unique)
        _try_once(unique.values())
        if self.too_busy:  # this machine is too busy now: estimate the rest of the regions
            return self._estimated(keys, unique)
        try:
            found = self.device.time([unique[k].call for k in keys], [unique[k].side for k in keys], _enough_rounds,
                                     3 * ROUNDS, weights=[weights[k] for k in keys])
        except Exception as error:  # noqa: BLE001 - an op that fails on synthetic values: the region stays as painted
            raise Unmeasurable(f"{type(error).__name__}: {error}") from None
        self.note(bool(found.ratios))
        if not agree(found.ratios, 1 - MARGIN, SPREAD_LIMIT):
            log.debug("profitability: region of %s: %d of %d timing rounds undisturbed, their ratios spread %.0f%% "
                      "across %.2f; estimated", items[0].key.split("|")[0], len(found.ratios), found.rounds,
                      spread(found.ratios) * 100, 1 - MARGIN)
            return self._estimated(keys, unique)
        for key, seconds in _measured(keys, unique, weights, found, known, costs).items():
            if known[key] is None:
                costs.record(key, seconds, "measured")
        return max((costs.sources[key] for key in unique), key=SOURCES.index)

    def note(self, undisturbed: bool) -> None:
        """Record whether a region's timing had an undisturbed round; say so when the machine turns out too
        busy to time any (:data:`GIVE_UP`), after which the conversion estimates the remaining regions."""
        if undisturbed:
            self.misses = 0
            return
        self.misses += 1
        if self.misses == 1:
            self._missing_since = time.perf_counter()
        if self.too_busy and not self._said:
            self._said = True
            log.info("profitability: %d regions in a row without an undisturbed timing round; the machine is too "
                     "busy, the remaining regions are estimated from %s", self.misses, self.device.prior().source)

    @property
    def too_busy(self) -> bool:
        """Whether the machine was too busy to time a region for :data:`GIVE_UP` regions and seconds."""
        return self.misses >= GIVE_UP[0] and time.perf_counter() - self._missing_since >= GIVE_UP[1]

    def _estimated(self, keys: list[str], unique: Mapping[str, TimedCall]) -> str:
        """Rule 2's prior: estimates for the keys without a time (never scaled: they depend on op and device
        alone)."""
        prior = self.device.prior()
        for key in keys:
            if key not in self.costs.used:
                self.costs.record(key, unique[key].prior(prior), "prior")
        return max((self.costs.sources[key] for key in keys), key=SOURCES.index)


CONVERT_ANYWAY = ("plan_for='coverage' converts it anyway; to plan for another device, convert there, pass "
                  "target='cuda' for a GPU, or costs= from there")


# what fp32_by_device says of a plan in each mode: the plan, and what the model does in fp32
_MODE_WORDS = {"train": ("a train-mode", "train"), "inference": ("an inference-mode", "run")}


def fp32_by_device(name: str, target: Target, device: torch.device | None, options: PlanOptions,
                   weight_bytes: int, anyway: str = CONVERT_ANYWAY, mode: str = "train") -> dict[str, Any] | None:
    """Rule 5: the record of a plan for speed that the device alone keeps fp32, decided before anything is
    captured; None where the plan is to be made (another ``plan_for``, a target not on this machine, a device
    with native arithmetic for the low dtype or unknown facts, ``force_low=`` or ``costs=`` given).

    The entry points that time no region call it, each once per model: :func:`amppass.convert` in train mode
    (which then returns the original) and the compile backend in either ``mode`` (whose graphs then run as dynamo
    traced them). ``name`` is the model's (for the warning, which says, in ``anyway``, how to convert it anyway
    through the caller's own options), ``device`` where its weights are, ``weight_bytes`` their size, ``mode`` the
    plan's ("train" or "inference": the words say the model trains or runs in fp32). The
    record has the keys of every conversion's summary, the device's facts under ``profitability`` and the reason
    under ``whole_model``, as an inference conversion that kept the original records them."""
    if options.plan_for != "speed" or not target.profitable or options.force_low or options.costs is not None:
        return None
    facts = DeviceFacts(device if device is not None and device.type == target.name else torch.device(target.name),
                        target.low)
    if facts.native.native:
        return None
    plan, verb = _MODE_WORDS[mode]
    log.warning("%s: profitability: %s; %s plan for speed would keep every op fp32, so the model is not "
                "converted and %ss in fp32 as it is (%s)", name, facts.native.reason, plan, verb, anyway)
    untouched = SimpleNamespace(casts=0, weights_converted=0, weight_copies=0)
    return {**summary("fx", target.low.name, target.describe(), mode, options.keep_io_types, untouched,
                      weight_bytes, weight_bytes),
            "plan_for": options.plan_for,
            "profitability": {"timing": {}, "device": facts.describe(), "decided": "before capture"},
            "whole_model": {"skipped": f"{facts.native.reason}; no op can {verb} faster in {target.low.name} here, "
                                       "so nothing was captured"}}


_SOURCE_WORDS = {"table": "from the given cost table", "cached": "from the timing cache", "measured": "measured",
                 "prior": "estimated from the device prior: the machine was too busy for timings to agree"}


def _try_once(items: Iterable[TimedCall]) -> None:
    """Call each item once, fp32 kernels first: a low kernel that raises where its fp32 twin ran is a missing
    kernel (:class:`LowFailed`), decided fp32 even when the region's times come from a prior; any other
    failure leaves the region unmeasured."""
    for item in sorted(items, key=lambda i: i.kind == "low"):
        try:
            item.call()
        except Exception as error:  # a kernel that fails here must not fail the conversion
            if item.kind == "low":
                raise LowFailed(item.node, error) from error
            raise Unmeasurable(f"{type(error).__name__}: {error}") from None


def _enough_rounds(ratios: list[float]) -> bool:
    """Whether a region's undisturbed rounds are enough: :data:`ROUNDS` that tell the decision, or three that
    are clear-cut (all beyond :data:`CLEAR`)."""
    if max(ratios) < CLEAR[0] or min(ratios) > CLEAR[1]:
        return True
    return len(ratios) >= ROUNDS and agree(ratios, 1 - MARGIN, SPREAD_LIMIT)


def _measured(keys: list[str], unique: Mapping[str, TimedCall], weights: Mapping[str, int], found: Timings,
              known: Mapping[str, float | None], costs: CostModel) -> dict[str, float]:
    """Rule 2's measured times: each kernel's median, the low side scaled to the median round ratio, all
    scaled so that the times already known (not estimated) agree with them."""
    sides = [
        sum(weights[k] * m for k, m in zip(keys, found.medians, strict=False) if unique[k].side == side)
        for side in (0, 1)
    ]
    low_scale = statistics.median(found.ratios) * sides[0] / sides[1] if sides[1] > 0 else 1.0
    times = {k: m * (low_scale if unique[k].side == 1 else 1.0) for k, m in zip(keys, found.medians, strict=False)}
    agreed = [k for k in keys if known[k] is not None and costs.sources[k] != "prior"]
    basis = sum(times[k] for k in agreed)
    load = sum(known[k] for k in agreed) / basis if agreed and basis > 0 else 1.0
    return {k: value * load for k, value in times.items()}


def _us(seconds: float) -> str:
    """Seconds in words: microseconds below 10 ms, milliseconds above."""
    return f"{seconds * 1e6:.0f} µs" if seconds < 1e-2 else f"{seconds * 1e3:.1f} ms"
