"""Profitability: run a part of the plan in low precision only where that is faster on the target device.

Low-precision kernels are not always faster. On CPUs without AMX, oneDNN's bf16 depthwise and grouped
convolutions are slower than fp32; small matrix products gain nothing and pay for the casts around them;
a CPU without native bf16/fp16 instructions runs every low-precision kernel several times slower. So after
painting, the plan is checked against the target device:

1. Regions: the nodes painted low form connected regions (two low nodes are in one region when one reads
   the other's output). A region runs low or fp32 as a whole, so the casts it needs are exactly those on
   its boundary: an fp32 value read by a region node (a graph input, an fp32 op's output) is cast down
   once, a region value read outside the region in fp32 (or returned, with ``keep_io_types``) is cast up
   once. Weights are converted ahead of time in inference and cost nothing per call.
2. Costs: every region node has a time in fp32 and in the low dtype, every boundary cast a time, on
   inputs of the shapes the example inputs give it, under a key of op, shapes, dtypes and arguments
   (:class:`CostModel`). A region's times come from the first of these that has them all, and the report
   names it for every region (``info["profitability"]["regions"]``, and the reason of each fp32 decision):

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
     interquartile range at most :data:`SPREAD_LIMIT` of their median, or the decision's ``1 - MARGIN``
     outside the 95% interval of their median); then its times are stored in the timing cache;
   - ``prior``: the rounds did not tell (the machine is too busy): the times are estimated from the
     device's roofline (:mod:`amppass.targets.prior`), the region is decided on them, and nothing is cached.
     Once :data:`GIVE_UP` regions in a row, over a second or more, had no undisturbed round at all, the
     conversion stops timing and estimates the rest (timing them would only cost time).

   Every kernel of a region is called once before any timing or estimate: a low-precision kernel that
   raises where its fp32 twin runs (a missing kernel the kernel facts of :mod:`amppass.fx.view.kernels` did not
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

4. Whole model (:func:`whole_model`, used by :func:`amppass.convert`): the converted graph against the original
   module in fp32; where the original is faster, it is kept (:mod:`amppass.serving.fp32_original`). That throws
   the whole plan away, so it is done only from a saved table, the timing cache (under a digest of the converted
   graph, so another model of the same class never reads it), or rounds that other load left undisturbed;
   it is not timed at all where the last region's timing had no undisturbed round.

The table of every time used is stored in the converted model's metadata (``info["costs"]``); passing it
back as ``costs=`` makes a conversion reuse those times instead of measuring, so a plan is reproducible
across processes and machines.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ...analysis.plan import Category, Decision, Precision, PrecisionPlan, Source
from ...analysis.view import GraphView
from ...dtypes import LowType
from ...errors import first_line
from ..view.macs import node_macs
from ...targets import device as device_facts
from ...targets.measure import Timings, agree, interleaved, probe, spread
from ..view.ops import display_name
from ...targets.prior import Prior
from ...targets.timing_cache import TimingCache
from ..view.build import fetch_attr

log = logging.getLogger(__name__)

MARGIN = 0.05  # a low region must save at least this share of its fp32 time
ROUNDS = 9  # undisturbed interleaved rounds per region measurement (up to three times as many where they disagree)
SPREAD_LIMIT = 0.25  # a region's round ratios agree when their interquartile range is at most this share of
# their median (or the decision lies outside their median's 95% interval)
CLEAR = (0.3, 3.0)  # round ratios all below / all above these: clear-cut after three undisturbed rounds
GIVE_UP = (3, 1.0)  # regions in a row, and seconds, without one undisturbed round: then a conversion stops timing
SOURCES = ("table", "cached", "measured", "prior")  # rule 2, in increasing order of doubt


@dataclass(frozen=True)
class Region:
    """Connected low nodes and the values crossing their boundary."""

    nodes: tuple[str, ...]
    cast_in: tuple[str, ...]  # fp32 values cast down for the region
    cast_out: tuple[str, ...]  # region values cast up for readers outside it


class CostModel:
    """Times of ops on one device, each with where it came from (module docstring, rule 2).

    ``known`` (a table from a converted model's metadata) is consulted first, then ``cache`` (the device's
    :class:`~amppass.targets.timing_cache.TimingCache`) and the times measured earlier in this process."""

    _memory: dict[str, dict[str, float]] = {}  # per process, per device fingerprint: times measured here

    def __init__(self, known: Mapping[str, float] | None = None, cache: TimingCache | None = None):
        self.known = dict(known or {})
        self.cache = cache
        self.memory = CostModel._memory.setdefault(device_facts.digest(cache.fingerprint), {}) if cache else {}
        self.used: dict[str, float] = {}
        self.sources: dict[str, str] = {}
        self.fresh: dict[str, float] = {}  # measured now and trusted: for the caches

    def lookup(self, key: str) -> float | None:
        """The time of ``key`` from the table or a cache (recorded as used), or None."""
        if key not in self.used:
            stored = self.cache.entries if self.cache is not None else {}
            for source, table in (("table", self.known), ("cached", stored), ("cached", self.memory)):
                if key in table:
                    self.record(key, table[key], source)
                    break
            else:
                return None
        return self.used[key]

    def record(self, key: str, seconds: float, source: str) -> None:
        """Use ``seconds`` for ``key`` from now on; a measured time goes into the caches on :meth:`save`."""
        self.used[key] = round(float(seconds), 9)
        self.sources[key] = source
        if source == "measured":
            self.fresh[key] = self.used[key]

    def save(self) -> None:
        """Store the times measured since the last save in this process's and the device's cache."""
        self.memory.update(self.fresh)
        if self.cache is not None:
            self.cache.add(self.fresh)
        self.fresh = {}

    def table(self) -> dict[str, float]:
        """Every time this model's decisions used, in seconds rounded to nanoseconds, for the metadata."""
        return dict(sorted(self.used.items()))


class DeviceFacts:
    """The target device as profitability needs it: its fingerprint and timing cache, whether it runs the
    low dtype natively, and (on demand) its cost prior. The probe is kept (in this process and the timing
    cache) the first time other load leaves it undisturbed; until then each conversion that needs it takes
    it again."""

    _probes: dict[tuple[str, str], dict[str, float]] = {}  # per process: (fingerprint digest, dtype) -> probe

    def __init__(self, device: torch.device, low: LowType, found: dict[str, Any] | None = None,
                 cache: TimingCache | None = None):
        self.device, self.low = device, low
        self.fingerprint = found if found is not None else device_facts.fingerprint(device)
        self.cache = cache if cache is not None else TimingCache(self.fingerprint)
        self.sync = torch.cuda.synchronize if device.type == "cuda" else None
        self.native = device_facts.native_low(self.fingerprint, low, self._probed(measure=False))
        if not self.native.known:
            self.native = device_facts.native_low(self.fingerprint, low, self._probed(measure=True))
        self._prior: Prior | None = None
        self.misses, self._missing_since = 0, 0.0  # regions in a row whose timing had no undisturbed round
        self._said = False

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
                     "busy, the remaining regions are estimated from %s", self.misses, self.prior().source)

    @property
    def too_busy(self) -> bool:
        """Whether the machine was too busy to time a region for :data:`GIVE_UP` regions and seconds."""
        return self.misses >= GIVE_UP[0] and time.perf_counter() - self._missing_since >= GIVE_UP[1]

    def prior(self) -> Prior:
        """The device's prior (:mod:`amppass.targets.prior`): from the probe where it can be trusted."""
        if self._prior is None:
            probed = self._probed(measure=True)
            self._prior = Prior.from_probe(probed) if probed else Prior.default(self.native.native)
        return self._prior

    def _probed(self, measure: bool) -> dict[str, float] | None:
        """The probe's numbers from the cache or this process; with ``measure``, taken now where missing
        (and kept only if undisturbed by other load)."""
        prefix = f"probe|{self.low.name}|"
        stored = {**{k[len(prefix):]: v for k, v in self.cache.entries.items() if k.startswith(prefix)},
                  **DeviceFacts._probes.get((device_facts.digest(self.fingerprint), self.low.name), {})}
        if len(stored) == 4 or not measure:
            return stored if len(stored) == 4 else None
        found, ratio_spread = probe(self.device, self.low)
        if ratio_spread > SPREAD_LIMIT:
            how = (f"its rounds spread {ratio_spread:.0%}" if math.isfinite(ratio_spread)
                   else "no round of it was undisturbed")
            log.info("profitability: the device probe was disturbed by other load (%s); not kept", how)
            return None
        DeviceFacts._probes[(device_facts.digest(self.fingerprint), self.low.name)] = found
        self.cache.add({prefix + k: v for k, v in found.items()})
        return found

    def describe(self) -> dict[str, Any]:
        """What the report says about the device: native support and why, the fingerprint, the cache."""
        return {"native_low": self.native.native, "why": self.native.reason,
                "fingerprint": device_facts.digest(self.fingerprint), "timing_cache": self.cache.describe()}


def forget() -> None:
    """Forget the times and probes measured in this process (the timing cache on disk is kept): the next
    conversion starts from the cache alone, as a new process would."""
    CostModel._memory.clear()
    DeviceFacts._probes.clear()


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


class _Shapes(fx.Interpreter):
    """Runs the fp32 graph once and keeps what timing each node needs: shapes and dtypes of its float
    values, the integer values themselves (indices, sizes), and nothing else."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.specs: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        self.specs[n] = pytree.tree_map(_spec, result)
        return result


@dataclass(frozen=True)
class _Float:
    shape: tuple[int, ...]
    dtype: torch.dtype


def _spec(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return _Float(tuple(value.shape), value.dtype)
    return value


def decide(gm: fx.GraphModule, view: GraphView, plan: PrecisionPlan, low: LowType, flat_inputs: list,
           given: Mapping[str, Decision], costs: CostModel, keep_io_types: bool, facts: DeviceFacts,
           ) -> tuple[dict[str, Decision], list[dict[str, Any]]]:
    """Rules 1-3: fp32 decisions for the LOW-category nodes of regions that are not faster low, and one
    record per region (its first node, size, outcome, times and their source) for the report."""
    shapes = _Shapes(gm)
    with torch.no_grad():
        shapes.run(*flat_inputs, enable_io_processing=False)
    nodes = {n.name: n for n in gm.graph.nodes}
    categories = {n.name: n.category for n in view.nodes}
    timer = _Timer(gm, shapes.specs, low, facts.device)
    kind = facts.device.type.upper()
    decisions: dict[str, Decision] = {}
    records = []
    for region in regions(view, plan, keep_io_types):
        record: dict[str, Any] = {"first": region.nodes[0], "nodes": len(region.nodes)}
        try:
            items = timer.items(region, nodes)
            record["timing"] = _time_region(items, costs, facts)
        except _Unmeasurable as why:
            log.debug("profitability: region of %s not measured (%s); kept as painted", region.nodes[0], why)
            records.append({**record, "runs": low.name, "timing": "unmeasured"})
            continue
        except _LowFailed as failed:  # a missing low kernel the kernel facts did not know of: never a crash
            if failed.node not in given:
                decisions[failed.node] = Decision(
                    Precision.FP32, f"its {low} kernel raised when timed on this {kind} "
                    f"({failed.error}); runs fp32", Source.PROFITABILITY, {"rule": "profitability"},
                    rule="low-kernel-failed")
            records.append({**record, "runs": "fp32", "timing": "low kernel failed"})
            continue
        if record["timing"] == "device":
            reason = f"profitability: {facts.native.reason}; runs fp32 (not timed)"
            evidence: dict[str, Any] = {"rule": "profitability", "timing": "device", "region": len(region.nodes)}
        else:
            fp32, lowered, casts = (sum(costs.used[item.key] for item in items if item.kind == kind_)
                                    for kind_ in ("fp32", "low", "cast"))
            record.update(fp32_us=round(fp32 * 1e6, 2), low_us=round(lowered * 1e6, 2), casts_us=round(casts * 1e6, 2))
            if lowered + casts <= (1 - MARGIN) * fp32:
                records.append({**record, "runs": low.name})
                continue
            count = len(region.cast_in) + len(region.cast_out)
            reason = (f"profitability: on this {kind} its region of {len(region.nodes)} node(s) takes "
                      f"{_us(lowered)} in {low} plus {_us(casts)} for {count} cast(s), against {_us(fp32)} in fp32 "
                      f"({_SAID[record['timing']]}); runs fp32")
            evidence = {"rule": "profitability", "timing": record["timing"], "low_us": record["low_us"],
                        "casts_us": record["casts_us"], "fp32_us": record["fp32_us"], "region": len(region.nodes)}
        records.append({**record, "runs": "fp32"})
        for name in region.nodes:
            if name not in given and categories.get(name) is Category.LOW:
                decisions[name] = Decision(Precision.FP32, reason, Source.PROFITABILITY, dict(evidence),
                                           rule="profitability")
    costs.save()
    return decisions, records


_SAID = {"table": "from the given cost table", "cached": "from the timing cache", "measured": "measured",
         "prior": "estimated from the device prior: the machine was too busy for timings to agree"}


def _time_region(items: list[_Item], costs: CostModel, facts: DeviceFacts) -> str:
    """Rule 2: give every key of ``items`` a time in ``costs``; return where the region's times came from
    (one of :data:`SOURCES`, or "device" where nothing is timed because nothing can win)."""
    unique: dict[str, _Item] = {}
    weights: dict[str, int] = {}
    for item in items:
        unique.setdefault(item.key, item)
        weights[item.key] = weights.get(item.key, 0) + 1
    known = {key: costs.lookup(key) for key in unique}
    if all(value is not None for value in known.values()):
        return max((costs.sources[key] for key in unique), key=SOURCES.index)
    if not facts.native.native:
        return "device"
    keys = list(unique)
    _try_once(unique.values())
    if facts.too_busy:  # this machine is too busy now: estimate the rest of the regions
        return _estimated(keys, unique, costs, facts)
    try:
        found = interleaved([unique[k].call for k in keys], [unique[k].side for k in keys], _enough_rounds, 3 * ROUNDS,
                            weights=[weights[k] for k in keys], sync=facts.sync)
    except Exception as error:  # noqa: BLE001 - an op that fails on synthetic values: the region stays as painted
        raise _Unmeasurable(f"{type(error).__name__}: {error}") from None
    facts.note(bool(found.ratios))
    if not agree(found.ratios, 1 - MARGIN, SPREAD_LIMIT):
        log.debug("profitability: region of %s: %d of %d timing rounds undisturbed, their ratios spread %.0f%% "
                  "across %.2f; estimated", items[0].key.split("|")[0], len(found.ratios), found.rounds,
                  spread(found.ratios) * 100, 1 - MARGIN)
        return _estimated(keys, unique, costs, facts)
    for key, seconds in _measured(keys, unique, weights, found, known, costs).items():
        if known[key] is None:
            costs.record(key, seconds, "measured")
    return max((costs.sources[key] for key in unique), key=SOURCES.index)


def _try_once(items: Iterable[_Item]) -> None:
    """Call each item once, fp32 kernels first: a low kernel that raises where its fp32 twin ran is a missing
    kernel (:class:`_LowFailed`), decided fp32 even when the region's times come from a prior; any other
    failure leaves the region unmeasured."""
    for item in sorted(items, key=lambda i: i.kind == "low"):
        try:
            item.call()
        except Exception as error:  # noqa: BLE001 - a kernel that fails here must not fail the conversion
            if item.kind == "low":
                raise _LowFailed(item.node, error) from error
            raise _Unmeasurable(f"{type(error).__name__}: {error}") from None


def _estimated(keys: list[str], unique: Mapping[str, _Item], costs: CostModel, facts: DeviceFacts) -> str:
    """Rule 2's prior: estimates for the keys without a time (never scaled: they depend on op and device alone)."""
    prior = facts.prior()
    for key in keys:
        if key not in costs.used:
            costs.record(key, unique[key].prior(prior), "prior")
    return max((costs.sources[key] for key in keys), key=SOURCES.index)


def _enough_rounds(ratios: list[float]) -> bool:
    """Whether a region's undisturbed rounds are enough: :data:`ROUNDS` that tell the decision, or three that
    are clear-cut (all beyond :data:`CLEAR`)."""
    if max(ratios) < CLEAR[0] or min(ratios) > CLEAR[1]:
        return True
    return len(ratios) >= ROUNDS and agree(ratios, 1 - MARGIN, SPREAD_LIMIT)


def _measured(keys: list[str], unique: Mapping[str, _Item], weights: Mapping[str, int], found: Timings,
              known: Mapping[str, float | None], costs: CostModel) -> dict[str, float]:
    """Rule 2's measured times: each kernel's median, the low side scaled to the median round ratio, all
    scaled so that the times already known (not estimated) agree with them."""
    sides = [sum(weights[k] * m for k, m in zip(keys, found.medians) if unique[k].side == side) for side in (0, 1)]
    low_scale = statistics.median(found.ratios) * sides[0] / sides[1] if sides[1] > 0 else 1.0
    times = {k: m * (low_scale if unique[k].side == 1 else 1.0) for k, m in zip(keys, found.medians)}
    agreed = [k for k in keys if known[k] is not None and costs.sources[k] != "prior"]
    basis = sum(times[k] for k in agreed)
    load = sum(known[k] for k in agreed) / basis if agreed and basis > 0 else 1.0
    return {k: value * load for k, value in times.items()}


class _Unmeasurable(Exception):
    """A node that cannot be timed alone (no recorded inputs, an op that fails on synthetic values)."""


class _LowFailed(Exception):
    """A node whose low-precision call raised where its fp32 call ran: no low kernel for it here."""

    def __init__(self, node: str, error: BaseException):
        super().__init__(node)
        self.node = node
        self.error = first_line(error, 200)


@dataclass(frozen=True)
class _Item:
    """One thing a region's decision adds up: a node's kernel in fp32 or low precision, or a cast."""

    key: str
    kind: str  # "fp32", "low" or "cast"
    call: Callable[[], Any]
    prior: Callable[[Prior], float]  # its estimated seconds under a device prior
    node: str = ""  # the node whose kernel it times ("" for a cast)

    @property
    def side(self) -> int:
        """Which side of the region's comparison it is on: fp32 (0), or low kernels and casts (1)."""
        return 0 if self.kind == "fp32" else 1


class _Timer:
    """Builds the timed items of a region: its nodes' ops, and its casts, on synthetic inputs of the
    recorded shapes."""

    def __init__(self, gm: fx.GraphModule, specs: Mapping[fx.Node, Any], low: LowType, device: torch.device):
        self.gm, self.specs, self.low, self.device = gm, specs, low, device
        self.low_modules: dict[str, torch.nn.Module] = {}

    def items(self, region: Region, nodes: Mapping[str, fx.Node]) -> list[_Item]:
        found = []
        for name in region.nodes:
            if nodes[name].op in ("call_function", "call_method", "call_module"):
                found += [self.node(nodes[name], low=False), self.node(nodes[name], low=True)]
        for values, down in ((region.cast_in, True), (region.cast_out, False)):
            found += [cast for v in values if v in nodes and (cast := self.cast(nodes[v], down)) is not None]
        return found

    def node(self, node: fx.Node, low: bool) -> _Item:
        dtype = self.low.torch if low else torch.float32
        args, kwargs = pytree.tree_map(lambda a: self._value(a, dtype), (node.args, node.kwargs))
        target = self._callable(node, low)
        key = f"{display_name(node, self.gm)}|{_describe((args, kwargs))}|{self.device.type}"
        macs, values = node_macs(node) or 0, self._float_values(node)
        size = self.low.torch.itemsize
        return _Item(key, "low" if low else "fp32", lambda: target(*args, **kwargs),
                     lambda prior: prior.op(macs, values, low, size), node.name)

    def cast(self, node: fx.Node, down: bool) -> _Item | None:
        spec = self.specs.get(node)
        if not isinstance(spec, _Float):
            return None
        source, dest = (torch.float32, self.low.torch) if down else (self.low.torch, torch.float32)
        tensor = torch.randn(spec.shape, device=self.device).to(source)
        key = f"cast|{list(spec.shape)}|{_short(source)}->{_short(dest)}|{self.device.type}"
        values, size = math.prod(spec.shape), self.low.torch.itemsize
        return _Item(key, "cast", lambda: tensor.to(dest), lambda prior: prior.cast(values, size))

    def _float_values(self, node: fx.Node) -> int:
        """Float values a node reads and writes (its operands, weights included, and its results)."""
        specs = [self.specs.get(node)] + [self.specs.get(a) for a in node.all_input_nodes if a.op != "get_attr"]
        weights = [fetch_attr(self.gm, str(a.target)) for a in node.all_input_nodes if a.op == "get_attr"]
        floats = [leaf for leaf in pytree.tree_leaves(specs) if isinstance(leaf, _Float)]
        return sum(math.prod(f.shape) for f in floats) + sum(w.numel() for w in weights
                                                        if isinstance(w, torch.Tensor) and w.is_floating_point())

    def _value(self, arg: Any, dtype: torch.dtype) -> Any:
        if not isinstance(arg, fx.Node):
            return arg
        if arg.op == "get_attr":
            value = fetch_attr(self.gm, str(arg.target))
            return value.detach().to(dtype) if isinstance(value, torch.Tensor) and value.dtype == torch.float32 \
                else value
        if arg not in self.specs:
            raise _Unmeasurable(f"{arg.name} was not recorded")
        return pytree.tree_map(lambda s: _make(s, dtype, self.device), self.specs[arg])

    def _callable(self, node: fx.Node, low: bool) -> Callable[..., Any]:
        if node.op == "call_function":
            return node.target
        if node.op == "call_method":
            return lambda obj, *a, **k: getattr(obj, str(node.target))(*a, **k)
        module = fetch_attr(self.gm, str(node.target))
        if not low:
            return module
        if str(node.target) not in self.low_modules:
            self.low_modules[str(node.target)] = copy.deepcopy(module).to(self.low.torch)
        return self.low_modules[str(node.target)]


def _make(spec: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """A tensor of the recorded shape in ``dtype`` (floating values), or the recorded value itself."""
    if isinstance(spec, _Float):
        return torch.randn(spec.shape, device=device).to(dtype if spec.dtype == torch.float32 else spec.dtype)
    return spec


def _describe(value: Any) -> str:
    """A short stable description of call arguments for the cache key."""
    leaves = pytree.tree_leaves(value)
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append(f"{_short(leaf.dtype)}{list(leaf.shape)}")
        elif isinstance(leaf, (int, float, bool, str, torch.dtype)) or leaf is None:
            parts.append(repr(leaf))
        else:
            parts.append(type(leaf).__name__)
    return ",".join(parts)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} µs" if seconds < 1e-2 else f"{seconds * 1e3:.1f} ms"


def whole_model(converted: torch.nn.Module, original: torch.nn.Module, args: tuple, kwargs: dict,
                costs: CostModel, budget: float = 1.0) -> tuple[float, float] | None:
    """Seconds per call of ``converted`` and of ``original`` (fp32), the medians of interleaved rounds left
    undisturbed by other load (rule 2), within about ``budget`` seconds of measuring (3 to 15 rounds); None
    where too few rounds were undisturbed to tell. Both times go into ``costs`` (keyed by the model and its
    input shapes), which answers instead when it already holds them; its timing cache keeps them under a
    key that also names the converted graph's code and tensor shapes, so another model of the same class
    never reads them."""
    key = whole_model_key(original, args, kwargs)
    names = [f"{key}|converted", f"{key}|original"]
    if all(name in costs.known for name in names):
        return costs.lookup(names[0]), costs.lookup(names[1])
    stored = [f"{key}|{_graph_digest(converted)}|{name.rsplit('|', 1)[1]}" for name in names]
    cache = costs.cache.entries if costs.cache is not None else {}
    if all(name in cache for name in stored):
        found = [cache[name] for name in stored]
    else:
        calls = [lambda: converted(*args, **kwargs), lambda: original(*args, **kwargs)]
        began = time.perf_counter()
        with torch.inference_mode():
            timings = interleaved(calls, [1, 0], lambda ratios: time.perf_counter() - began > budget, 15,
                                  sync=_synchronizer(converted, args, kwargs))
        if not agree(timings.ratios, 1.0, SPREAD_LIMIT):  # the converted graph is kept only where it is faster
            return None
        found = [round(seconds, 9) for seconds in timings.medians]
        if costs.cache is not None:
            costs.cache.add(dict(zip(stored, found)))
    for name, seconds in zip(names, found):
        costs.used[name] = seconds  # recorded, not saved: the cache holds them under the graph's own key
    return found[0], found[1]


def _synchronizer(model: torch.nn.Module, args: tuple, kwargs: dict) -> Callable[[], None] | None:
    """``torch.cuda.synchronize`` where the model or its inputs are on a CUDA device: a call there returns when
    its kernels are queued, and only a synchronized clock times the kernels themselves."""
    tensors = [*model.parameters(), *model.buffers(), *pytree.tree_leaves((args, kwargs))]
    on_cuda = any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in tensors)
    return torch.cuda.synchronize if on_cuda else None


def _graph_digest(gm: torch.nn.Module) -> str:
    """A short digest of a converted graph's code and of its tensors' shapes and dtypes."""
    parts = [getattr(gm, "code", type(gm).__name__)]
    parts += [f"{name}{tuple(t.shape)}{t.dtype}" for name, t in (*gm.named_parameters(), *gm.named_buffers())]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def whole_model_key(original: torch.nn.Module, args: tuple, kwargs: dict) -> str:
    """The cost-table key of the whole-model times (``<key>|converted``, ``<key>|original``)."""
    return f"whole model|{type(original).__name__}|{_describe((args, kwargs))}"
