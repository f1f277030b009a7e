"""Profitability: run a part of the plan in low precision only where that is faster on the target device.

Low-precision kernels are not always faster. On CPUs without AMX, oneDNN's bf16 depthwise and grouped
convolutions are slower than fp32; small matrix products gain nothing and pay for the casts around them.
So after painting, the plan is checked against measurements on this machine's device:

1. Regions: the nodes painted low form connected regions (two low nodes are in one region when one reads
   the other's output). A region runs low or fp32 as a whole, so the casts it needs are exactly those on
   its boundary: an fp32 value read by a region node (a graph input, an fp32 op's output) is cast down
   once, a region value read outside the region in fp32 (or returned, with ``keep_io_types``) is cast up
   once. Weights are converted ahead of time in inference and cost nothing per call.
2. Costs: each region node is timed in fp32 and in the low dtype on inputs of the shapes the example
   inputs give it (:class:`CostModel`, cached per process and device under a key of op, shapes, dtypes
   and arguments); each boundary cast is timed the same way. A time is the fastest of several samples:
   other load only ever adds time (on a busy 2-core machine a multi-threaded kernel whose worker is
   descheduled waits a whole time slice), so the fastest sample is the kernel's own cost.
3. Decision: a region stays low when its low kernels plus its casts take at most ``1 - MARGIN`` of its fp32
   time; otherwise every LOW-category node in it gets an fp32 decision whose reason gives both times, and
   painting then runs the region's element-wise ops fp32 too. The margin keeps timing noise on a shared
   machine from flipping near-even regions, and a near-even region runs fp32: never slower than fp32.

4. Whole model (:func:`whole_model`, used by :func:`amppass.convert`): the converted graph against the original
   module in fp32; where the original is faster, it is kept (:mod:`amppass.fx.kept`). That throws the whole
   plan away, so it is done only on a quiet machine (:func:`busy`) or from a saved table.

The measured table is stored in the converted model's metadata (``info["costs"]``); passing it back as
``costs=`` makes a conversion reuse those times instead of measuring, so a plan is reproducible across
processes and machines.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..analysis.plan import Category, Decision, Precision, PrecisionPlan, Source
from ..analysis.view import GraphView
from ..dtypes import LowType
from .ops import display_name
from .view import fetch_attr

log = logging.getLogger(__name__)

MARGIN = 0.05  # a low region must save at least this share of its fp32 time
_SAMPLES = 7  # timed samples per variant (the fastest counts)
_SAMPLE_SECONDS = 2e-4  # calls are batched until one sample takes about this long


@dataclass(frozen=True)
class Region:
    """Connected low nodes and the values crossing their boundary."""

    nodes: tuple[str, ...]
    cast_in: tuple[str, ...]  # fp32 values cast down for the region
    cast_out: tuple[str, ...]  # region values cast up for readers outside it


class CostModel:
    """Measured times of ops on this process's device, cached under keys that name op, shapes and dtypes.

    ``known`` (a table from a converted model's metadata) is consulted first and never re-measured.
    """

    _cache: dict[str, float] = {}  # per process: the same op on the same shapes is timed once

    def __init__(self, known: Mapping[str, float] | None = None):
        self.known = dict(known or {})
        self.used: dict[str, float] = {}

    def time(self, key: str, call: Callable[[], Any]) -> float:
        """Seconds one ``call()`` takes (the fastest of several samples), measured once per key."""
        if key in self.known:
            seconds = float(self.known[key])
        elif key in CostModel._cache:
            seconds = CostModel._cache[key]
        else:
            seconds = CostModel._cache[key] = _measure(call)
        self.used[key] = seconds
        return seconds

    def table(self) -> dict[str, float]:
        """Every time this model's decisions used, in microseconds-precise seconds, for the metadata."""
        return {key: round(value, 9) for key, value in sorted(self.used.items())}


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
           given: Mapping[str, Decision], costs: CostModel, keep_io_types: bool, device: torch.device,
           ) -> dict[str, Decision]:
    """Rules 1-3: fp32 decisions for the LOW-category nodes of regions that are not faster low."""
    shapes = _Shapes(gm)
    with torch.no_grad():
        shapes.run(*flat_inputs, enable_io_processing=False)
    nodes = {n.name: n for n in gm.graph.nodes}
    categories = {n.name: n.category for n in view.nodes}
    timer = _Timer(gm, shapes.specs, costs, low, device)
    decisions: dict[str, Decision] = {}
    for region in regions(view, plan, keep_io_types):
        try:
            fp32 = sum(timer.node(nodes[name], low=False) for name in region.nodes)
            lowered = sum(timer.node(nodes[name], low=True) for name in region.nodes)
            casts = sum(timer.cast(nodes[v], down=True) for v in region.cast_in if v in nodes) + \
                sum(timer.cast(nodes[v], down=False) for v in region.cast_out if v in nodes)
        except _Unmeasurable as why:
            log.debug("profitability: region of %s not measured (%s); kept as painted", region.nodes[0], why)
            continue
        except _LowFailed as failed:  # a missing low kernel the kernel facts did not know of: never a crash
            if failed.node not in given:
                decisions[failed.node] = Decision(
                    Precision.FP32, f"its {low} kernel raised when timed on this {device.type.upper()} "
                    f"({failed.error}); runs fp32", Source.PROFITABILITY, {"rule": "profitability"})
            continue
        if lowered + casts <= (1 - MARGIN) * fp32:
            continue
        count = len(region.cast_in) + len(region.cast_out)
        reason = (f"profitability: on this {device.type.upper()} its region of {len(region.nodes)} node(s) takes "
                  f"{_us(lowered)} in {low} plus {_us(casts)} for {count} cast(s), against {_us(fp32)} in fp32; "
                  "runs fp32")
        evidence = {"rule": "profitability", "low_us": round(lowered * 1e6, 2), "casts_us": round(casts * 1e6, 2),
                    "fp32_us": round(fp32 * 1e6, 2), "region": len(region.nodes)}
        for name in region.nodes:
            if name not in given and categories.get(name) is Category.LOW:
                decisions[name] = Decision(Precision.FP32, reason, Source.PROFITABILITY, dict(evidence))
    return decisions


class _Unmeasurable(Exception):
    """A node that cannot be timed alone (no recorded inputs, an op that fails on synthetic values)."""


class _LowFailed(Exception):
    """A node whose low-precision call raised where its fp32 call ran: no low kernel for it here."""

    def __init__(self, node: str, error: BaseException):
        super().__init__(node)
        self.node = node
        self.error = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


class _Timer:
    """Times one node's op, or one cast, on synthetic inputs of the recorded shapes."""

    def __init__(self, gm: fx.GraphModule, specs: Mapping[fx.Node, Any], costs: CostModel, low: LowType,
                 device: torch.device):
        self.gm, self.specs, self.costs, self.low, self.device = gm, specs, costs, low, device
        self.low_modules: dict[str, torch.nn.Module] = {}

    def node(self, node: fx.Node, low: bool) -> float:
        if node.op not in ("call_function", "call_method", "call_module"):
            return 0.0
        dtype = self.low.torch if low else torch.float32
        args, kwargs = pytree.tree_map(lambda a: self._value(a, dtype), (node.args, node.kwargs))
        target = self._callable(node, low)
        key = f"{display_name(node, self.gm)}|{_describe((args, kwargs))}|{self.device.type}"
        try:
            return self.costs.time(key, lambda: target(*args, **kwargs))
        except Exception as err:  # noqa: BLE001 - a kernel that fails here must not fail the conversion
            if low:
                raise _LowFailed(node.name, err) from err
            raise _Unmeasurable(f"{node.name} fails on synthetic inputs: {err}") from err

    def cast(self, node: fx.Node, down: bool) -> float:
        spec = self.specs.get(node)
        if not isinstance(spec, _Float):
            return 0.0
        source, dest = (torch.float32, self.low.torch) if down else (self.low.torch, torch.float32)
        tensor = torch.randn(spec.shape, device=self.device).to(source)
        key = f"cast|{list(spec.shape)}|{_short(source)}->{_short(dest)}|{self.device.type}"
        return self.costs.time(key, lambda: tensor.to(dest))

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


def _measure(call: Callable[[], Any]) -> float:
    """Seconds of one ``call()``: the fastest of :data:`_SAMPLES` samples, each batching enough calls to be
    timed (module docstring, rule 2)."""
    with torch.no_grad():
        call()  # warm-up: kernel selection, allocator
        start = time.perf_counter()
        call()
        once = max(time.perf_counter() - start, 1e-7)
        repeat = max(1, min(1000, int(_SAMPLE_SECONDS / once)))
        samples = []
        for _ in range(_SAMPLES):
            start = time.perf_counter()
            for _ in range(repeat):
                call()
            samples.append((time.perf_counter() - start) / repeat)
    return min(samples)


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} µs" if seconds < 1e-2 else f"{seconds * 1e3:.1f} ms"



def whole_model(converted: torch.nn.Module, original: torch.nn.Module, args: tuple, kwargs: dict,
                costs: CostModel, budget: float = 1.0) -> tuple[float, float]:
    """Seconds per call of ``converted`` and of ``original`` (fp32): the fastest of interleaved rounds (as in
    rule 2), within ``budget`` seconds of measuring (at least 3 rounds, at most 15). Both times go into
    ``costs`` (keyed by the model and its input shapes), which answers instead when it already holds them."""
    key = whole_model_key(original, args, kwargs)
    if f"{key}|converted" in costs.known and f"{key}|original" in costs.known:
        return costs.time(f"{key}|converted", lambda: None), costs.time(f"{key}|original", lambda: None)
    calls = (lambda: converted(*args, **kwargs), lambda: original(*args, **kwargs))
    samples: tuple[list[float], list[float]] = ([], [])
    with torch.inference_mode():
        for call in calls:  # warm-up
            call()
        spent = 0.0
        while len(samples[0]) < 15 and (len(samples[0]) < 3 or spent < budget):
            for call, found in zip(calls, samples):
                start = time.perf_counter()
                call()
                found.append(time.perf_counter() - start)
                spent += found[-1]
    costs.used[f"{key}|converted"], costs.used[f"{key}|original"] = min(samples[0]), min(samples[1])
    return min(samples[0]), min(samples[1])


def whole_model_key(original: torch.nn.Module, args: tuple, kwargs: dict) -> str:
    """The cost-table key of the whole-model times (``<key>|converted``, ``<key>|original``)."""
    return f"whole model|{type(original).__name__}|{_describe((args, kwargs))}"


def busy() -> str:
    """Why whole-model timings here cannot be trusted now ("" when they can): a 1-minute load average at or
    above the number of cores means other processes take the cores the model's threads wait for."""
    try:
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
    except OSError:
        return ""
    return f"the machine is busy (load {load:.1f} on {cores} cores)" if load >= cores else ""
