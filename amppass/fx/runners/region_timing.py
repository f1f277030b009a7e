"""Profitability on torch.fx graphs: the timed calls of a graph's low regions, and the converted graph against the
original module.

The rule that decides (regions, where times come from, margins, what a busy machine gets) is front-end neutral
and lives in :mod:`amppass.analysis.profitability`; the device's facts and cost table in
:mod:`amppass.targets.cost_model`. This module gives the rule what only a torch.fx graph can: :func:`decide`
runs the fp32 graph once to record the shapes and dtypes of its values, and builds for each region its nodes'
ops in fp32 and in the low dtype and its boundary casts, as calls on synthetic inputs of those shapes
(:class:`amppass.analysis.profitability.TimedCall`, keyed by op, shapes, dtypes and arguments).
:func:`whole_model` times the converted graph against the original module in fp32 (rule 4 there).
"""

from __future__ import annotations

import copy
import hashlib
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, cast

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ...analysis.plan import Decision, PrecisionPlan
from ...analysis.profitability import Profitability, Region, TimedCall, Unmeasurable, regions
from ...analysis.view import GraphView
from ...dtypes import LowType
from ...targets.cost_model import SPREAD_LIMIT, CostModel
from ...targets.measure import agree, interleaved
from ..view.build import fetch_attr
from ..view.macs import node_macs
from ..view.ops import display_name


class _Shapes(fx.Interpreter):
    """Runs the fp32 graph once and keeps what timing each node needs: shapes and dtypes of its float
    values, the integer values themselves (indices, sizes), and nothing else."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.specs: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        """Run ``n`` and keep its result's spec."""
        result = super().run_node(n)
        self.specs[n] = pytree.tree_map(_spec, result)
        return result


@dataclass(frozen=True)
class _Float:
    """A floating value as timing needs it: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _spec(value: Any) -> Any:
    """What is kept of a value: a floating tensor's shape and dtype, anything else as it is."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return _Float(tuple(value.shape), value.dtype)
    return value


def decide(gm: fx.GraphModule, view: GraphView, plan: PrecisionPlan, flat_inputs: list,
           given: Mapping[str, Decision], keep_io_types: bool, rule: Profitability, device: torch.device,
           ) -> tuple[dict[str, Decision], list[dict[str, Any]]]:
    """Rules 1-3 of :mod:`amppass.analysis.profitability` on ``gm`` (run on ``device``): fp32 decisions for the
    LOW-category nodes of regions that are not faster low, and one record per region for the report."""
    shapes = _Shapes(gm)
    with torch.no_grad():
        shapes.run(*flat_inputs, enable_io_processing=False)
    nodes = {n.name: n for n in gm.graph.nodes}
    timer = _Timer(gm, shapes.specs, rule.low, device)
    return rule.decide(regions(view, plan, keep_io_types), lambda region: timer.items(region, nodes),
                       {n.name: n.category for n in view.nodes}, given)


class _Timer:
    """Builds the timed calls of a region: its nodes' ops, and its casts, on synthetic inputs of the
    recorded shapes."""

    def __init__(self, gm: fx.GraphModule, specs: Mapping[fx.Node, Any], low: LowType, device: torch.device):
        self.gm, self.specs, self.low, self.device = gm, specs, low, device
        self.low_modules: dict[str, torch.nn.Module] = {}

    def items(self, region: Region, nodes: Mapping[str, fx.Node]) -> list[TimedCall]:
        """The region's calls: each op node in fp32 and in the low dtype, then its casts in and out."""
        found = []
        for name in region.nodes:
            if nodes[name].op in ("call_function", "call_method", "call_module"):
                found += [self.node(nodes[name], low=False), self.node(nodes[name], low=True)]
        for values, down in ((region.cast_in, True), (region.cast_out, False)):
            found += [cast for v in values if v in nodes and (cast := self.cast(nodes[v], down)) is not None]
        return found

    def node(self, node: fx.Node, low: bool) -> TimedCall:
        """``node``'s op on synthetic inputs of its recorded shapes, in the low dtype or in fp32."""
        dtype = self.low.torch if low else torch.float32
        args, kwargs = pytree.tree_map(lambda a: self._value(a, dtype), (node.args, node.kwargs))
        target = self._callable(node, low)
        key = f"{display_name(node, self.gm)}|{_describe((args, kwargs))}|{self.device.type}"
        macs, values = node_macs(node) or 0, self._float_values(node)
        size = self.low.torch.itemsize
        return TimedCall(key, "low" if low else "fp32", lambda: target(*args, **kwargs),
                         lambda prior: prior.op(macs, values, low, size), node.name)

    def cast(self, node: fx.Node, down: bool) -> TimedCall | None:
        """The cast of ``node``'s value down to the low dtype or up to fp32 (None: not a floating value)."""
        spec = self.specs.get(node)
        if not isinstance(spec, _Float):
            return None
        source, dest = (torch.float32, self.low.torch) if down else (self.low.torch, torch.float32)
        tensor = torch.randn(spec.shape, device=self.device).to(source)
        key = f"cast|{list(spec.shape)}|{_short(source)}->{_short(dest)}|{self.device.type}"
        values, size = math.prod(spec.shape), self.low.torch.itemsize
        return TimedCall(key, "cast", lambda: tensor.to(dest), lambda prior: prior.cast(values, size))

    def _float_values(self, node: fx.Node) -> int:
        """Float values a node reads and writes (its operands, weights included, and its results)."""
        specs = [self.specs.get(node)] + [self.specs.get(a) for a in node.all_input_nodes if a.op != "get_attr"]
        weights = [fetch_attr(self.gm, str(a.target)) for a in node.all_input_nodes if a.op == "get_attr"]
        floats = [leaf for leaf in pytree.tree_leaves(specs) if isinstance(leaf, _Float)]
        return sum(math.prod(f.shape) for f in floats) + sum(w.numel() for w in weights
                                                        if isinstance(w, torch.Tensor) and w.is_floating_point())

    def _value(self, arg: Any, dtype: torch.dtype) -> Any:
        """A synthetic value for argument ``arg``: a weight in ``dtype``, a recorded value of its shape."""
        if not isinstance(arg, fx.Node):
            return arg
        if arg.op == "get_attr":
            value = fetch_attr(self.gm, str(arg.target))
            return value.detach().to(dtype) if isinstance(value, torch.Tensor) and value.dtype == torch.float32 \
                else value
        if arg not in self.specs:
            raise Unmeasurable(f"{arg.name} was not recorded")
        return pytree.tree_map(lambda s: _make(s, dtype, self.device), self.specs[arg])

    def _callable(self, node: fx.Node, low: bool) -> Callable[..., Any]:
        """What runs ``node``: its function, its method, or its module (a low-precision copy for ``low``)."""
        if node.op == "call_function":
            return cast(Callable[..., Any], node.target)  # a call_function node's target is its function
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
    """``float32`` for ``torch.float32``."""
    return str(dtype).replace("torch.", "")


def whole_model(converted: torch.nn.Module, original: torch.nn.Module, args: tuple, kwargs: dict,
                costs: CostModel, budget: float = 1.0) -> tuple[float, float] | None:
    """Seconds per call of ``converted`` and of ``original`` (fp32), the medians of interleaved rounds left
    undisturbed by other load (rule 2 of :mod:`amppass.analysis.profitability`), within about ``budget`` seconds of
    measuring (3 to 15 rounds); None
    where too few rounds were undisturbed to tell. Both times go into ``costs`` (keyed by the model and its
    input shapes), which answers instead when it already holds them; its timing cache keeps them under a
    key that also names the converted graph's code and tensor shapes, so another model of the same class
    never reads them."""
    key = whole_model_key(original, args, kwargs)
    names = [f"{key}|converted", f"{key}|original"]
    if all(name in costs.known for name in names):
        converted_s, original_s = costs.lookup(names[0]), costs.lookup(names[1])
        if converted_s is not None and original_s is not None:  # the table holds both: they are its times
            return converted_s, original_s
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
            costs.cache.add(dict(zip(stored, found, strict=False)))
    for name, seconds in zip(names, found, strict=False):
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
