"""Rewrite an ONNX model according to a :class:`PrecisionPlan`, subgraphs included.

Rules:

1. Casts sit on edges, one per (value, dtype) in the whole model, placed in the graph that defines the
   value, right before the first reader that needs it; a body reading an outer value (a capture) shares
   the outer cast.
2. Weights (float32 initializers, Constant nodes and ConstantOfShape fills) are converted once, through the
   :class:`~amppass.onnx.io.weight_store.WeightStore` that holds their payloads: in place when every reader runs
   low, as a low-precision copy beside the fp32 original when readers of both kinds share them. fp16
   values beyond 65504 are clamped and listed in the stats, never silently.
3. A Cast to float32 already in the model is retargeted to the low dtype when the plan runs it low.
4. Values that must stay float32 where they are defined (graph outputs with ``keep_io_types``, every
   If/Loop/Scan body output, so loop-carried state keeps one type) are produced low under a new name and
   cast back to the original name; readers inside the graph use the low one.
5. Each planned node carries its decision as JSON in ``metadata_props["amppass"]``; added Casts say what
   they cast.

The rewrite works in place on the private copy the conversion owns; the caller's model is never touched.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import onnx
from onnx import TensorProto, helper

from ..analysis.options import RewriteOptions
from ..analysis.plan import Decision, Precision, PrecisionPlan
from ..analysis.record import META_KEY
from ..dtypes import FP16_MAX, LowType
from .io.weight_store import WeightStore
from .view import FLOAT, NodeRef, subgraphs, weight_tensor

log = logging.getLogger(__name__)

SHORT = {TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16", TensorProto.FLOAT: "fp32"}


@dataclass
class RewriteStats:
    """What the rewrite did, for the model-level metadata and the report."""

    casts: int = 0
    weights_converted: int = 0
    weight_copies: int = 0
    clamped: dict[str, int] = field(default_factory=dict)  # weight -> number of values clamped


@dataclass
class _Scope:
    """One graph being rebuilt: its new node list and the names it defines."""

    graph: onnx.GraphProto
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    values: list[str] = field(default_factory=list)


class _Rewriter:
    def __init__(self, model: onnx.ModelProto, plan: PrecisionPlan, refs: dict[str, NodeRef],
                 types: dict[str, int], weights: set[str], store: WeightStore, low: LowType, keep_io_types: bool):
        self.model, self.plan, self.refs, self.types, self.store = model, plan, refs, types, store
        self.weights, self.low_type, self.low, self.keep_io = weights, low, low.onnx, keep_io_types
        self.stats = RewriteStats()
        self.dtype: dict[str, int] = {}
        self.cache: dict[tuple[str, int], str] = {}
        self.home: dict[str, _Scope] = {}
        self.names = all_names(model)
        self.demand = self._weight_demand()

    # -- planning helpers -------------------------------------------------------------------------
    def _wanted(self, node: onnx.NodeProto, position: int) -> int | None:
        """The dtype input ``position`` of ``node`` is read in, or None when it is fed unchanged."""
        ref = self.refs.get(node.name)
        if ref is not None and position in ref.kept_fp32:
            return FLOAT
        if ref is None or position not in ref.planned:
            return None
        low = self.plan[node.name].precision is Precision.LOW
        return self.low if low else FLOAT

    def _weight_demand(self) -> dict[str, set[int]]:
        """Weight -> the dtypes its readers need (fp32 for readers fed unchanged and graph outputs)."""
        demand: dict[str, set[int]] = {w: set() for w in self.weights}

        def visit(graph: onnx.GraphProto) -> None:
            for node in graph.node:
                for sub in subgraphs(node):
                    visit(sub)
                for i, value in enumerate(node.input):
                    if value in demand:
                        demand[value].add(self._wanted(node, i) or FLOAT)
            for out in graph.output:
                if out.name in demand:
                    demand[out.name].add(FLOAT)

        visit(self.model.graph)
        return demand

    # -- the walk ---------------------------------------------------------------------------------
    def run(self) -> RewriteStats:
        self._graph(self.model.graph, main=True)
        return self.stats

    def _graph(self, graph: onnx.GraphProto, main: bool) -> None:
        scope = _Scope(graph)
        pinned = {o.name for o in graph.output} if (self.keep_io or not main) else set()
        for value in graph.input:
            self._define(scope, value.name, self.types.get(value.name, 0))
        for init in list(graph.initializer):
            self._define(scope, init.name, init.data_type)
            if init.name in self.weights:
                copy = self._convert_weight(init.name, init)
                if copy is not None:
                    graph.initializer.append(copy)
                    self._define(scope, copy.name, copy.data_type)
                    self.cache[(init.name, self.low)] = copy.name
        for node in list(graph.node):
            self._node(scope, node, pinned)
        for out in graph.output:
            if self.dtype.get(out.name) != self.low or self.types.get(out.name) != FLOAT:
                continue  # only values the plan moved from fp32 to low change type (an fp16 model's stay)
            if out.name not in pinned:
                out.type.tensor_type.elem_type = self.low
            else:  # a body returning an outer value that now runs low: return its fp32 cast (by position)
                out.name = self._value_as(out.name, FLOAT)
        del graph.node[:]
        graph.node.extend(scope.nodes)
        if not main:
            self._close(scope)

    def _node(self, scope: _Scope, node: onnx.NodeProto, pinned: set[str]) -> None:
        tensor = weight_tensor(node)
        if tensor is not None and node.output[0] in self.weights:
            scope.nodes.append(node)
            copy = self._convert_weight(node.output[0], tensor)
            self._define(scope, node.output[0], self.dtype.get(node.output[0], tensor.data_type))
            if copy is not None:  # the same node writing the low copy (a ConstantOfShape reads the same shape)
                scope.nodes.append(helper.make_node(node.op_type, list(node.input), [copy.name],
                                                    name=self._node_name(f"{node.name}_{SHORT[self.low]}"),
                                                    value=copy))
                self._define(scope, copy.name, self.low)
                self.cache[(node.output[0], self.low)] = copy.name
            return
        for sub in subgraphs(node):
            self._graph(sub, main=False)
        casts_in = []
        for i, value in enumerate(node.input):
            wanted = self._wanted(node, i)
            if wanted is not None and value:
                new = self._value_as(value, wanted)
                if new != value:
                    casts_in.append(new)
                node.input[i] = new
        decision = self.plan[node.name] if node.name in self.plan else None
        low = decision is not None and decision.precision is Precision.LOW
        if node.op_type == "Cast" and low:
            for attr in node.attribute:
                if attr.name == "to" and attr.i == FLOAT:
                    attr.i = self.low
        scope.nodes.append(node)
        if decision is not None:
            self._record(node, decision, casts_in)
        for j, out in enumerate(node.output):
            if not out:
                continue
            original = self.types.get(out, 0)
            if original == FLOAT and low:
                if out in pinned:
                    internal = self._value_name(f"{out}__{SHORT[self.low]}")
                    node.output[j] = internal
                    self._define(scope, internal, self.low)
                    self.cache[(out, self.low)] = internal
                    self._emit_cast(scope, internal, out, FLOAT)
                    self._define(scope, out, FLOAT)
                    continue
                self._define(scope, out, self.low)
            else:
                self._define(scope, out, original)

    def _value_as(self, value: str, dtype: int) -> str:
        """Rule 1: ``value`` in ``dtype``, sharing one Cast per (value, dtype)."""
        if self.dtype.get(value, FLOAT) == dtype:
            return value
        key = (value, dtype)
        if key not in self.cache:
            scope = self.home[value]
            name = self._value_name(f"{value}__to_{SHORT[dtype]}")
            self._emit_cast(scope, value, name, dtype)
            self._define(scope, name, dtype)
            self.cache[key] = name
        return self.cache[key]

    def _emit_cast(self, scope: _Scope, source: str, target: str, dtype: int) -> None:
        cast = helper.make_node("Cast", [source], [target], name=self._node_name(f"{source}_to_{SHORT[dtype]}"),
                                to=dtype)
        _set_meta(cast, {"cast": True, "of": source, "to": SHORT[dtype]})
        scope.nodes.append(cast)
        self.stats.casts += 1

    # -- weights ----------------------------------------------------------------------------------
    def _convert_weight(self, name: str, tensor: onnx.TensorProto) -> onnx.TensorProto | None:
        """Rule 2: convert ``tensor`` in place, or return a low copy to store beside it, or do nothing."""
        wanted = self.demand.get(name, set())
        if self.low not in wanted:
            return None
        if wanted == {self.low}:
            target = tensor
            self.dtype[name] = self.low
            self.stats.weights_converted += 1
        else:
            target = TensorProto(name=self._value_name(f"{name}__{SHORT[self.low]}"))
            self.stats.weight_copies += 1
        clamped = self.store.lower(tensor, self.low_type, target)
        if clamped:
            self.stats.clamped[name] = clamped
            log.warning("weight %r: %d values beyond fp16's range clamped to +-%g", name, clamped, FP16_MAX)
        return None if target is tensor else target

    # -- bookkeeping ------------------------------------------------------------------------------
    def _define(self, scope: _Scope, name: str, dtype: int) -> None:
        self.dtype[name] = dtype
        self.home[name] = scope
        scope.values.append(name)

    def _close(self, scope: _Scope) -> None:
        """Forget a body's own values once it is rebuilt (sibling bodies may reuse the names)."""
        gone = set(scope.values)
        for name in gone:
            self.dtype.pop(name, None)
            self.home.pop(name, None)
        for key in [k for k in self.cache if k[0] in gone]:
            del self.cache[key]

    def _value_name(self, base: str) -> str:
        return self._unique(base)

    def _node_name(self, base: str) -> str:
        return self._unique(base)

    def _unique(self, base: str) -> str:
        return unique_name(self.names, base)

    def _record(self, node: onnx.NodeProto, decision: Decision, casts_in: list[str]) -> None:
        meta: dict[str, Any] = decision.to_meta()
        meta["op"] = node.op_type if not node.domain else f"{node.domain}.{node.op_type}"
        meta["casts_in"] = casts_in
        _set_meta(node, meta)


def _set_meta(node: onnx.NodeProto, meta: dict[str, Any]) -> None:
    for entry in node.metadata_props:
        if entry.key == META_KEY:
            entry.value = json.dumps(meta, default=str)
            return
    node.metadata_props.add(key=META_KEY, value=json.dumps(meta, default=str))


def all_names(model: onnx.ModelProto) -> set[str]:
    """Every node and value name in the model, subgraphs included, so added names never collide."""
    names: set[str] = set()

    def visit(graph: onnx.GraphProto) -> None:
        names.update(i.name for i in graph.input)
        names.update(i.name for i in graph.initializer)
        for node in graph.node:
            names.add(node.name)
            names.update(node.output)
            for sub in subgraphs(node):
                visit(sub)

    visit(model.graph)
    return names


def unique_name(taken: set[str], base: str) -> str:
    """``base``, or ``base_1``, ``base_2``, ... : the first not in ``taken``, which it joins."""
    name, n = base, 0
    while name in taken:
        n += 1
        name = f"{base}_{n}"
    taken.add(name)
    return name


def rewrite(model: onnx.ModelProto, plan: PrecisionPlan, refs: dict[str, NodeRef], types: dict[str, int],
            weights: set[str], store: WeightStore, low: LowType,
            options: RewriteOptions | None = None) -> RewriteStats:
    """Rewrite ``model`` (a private skeleton whose payloads ``store`` holds) in place according to ``plan`` and
    ``options`` (an ONNX model's low weights are always stored once: only ``keep_io_types`` applies); returns what
    was done. Weights are converted through ``store``; nothing is written into it in place."""
    keep_io_types = (options or RewriteOptions()).keep_io_types
    return _Rewriter(model, plan, refs, types, weights, store, low, keep_io_types).run()
