"""Tolerance-search runs that start where the trial model first differs from the fp32 model (ONNX).

The ONNX counterpart of :mod:`amppass.fx.runners.trial_runs`. The rewrite keeps the main graph's node order and puts
each Cast right before its first reader, so a trial's nodes up to the first one it changes (a node run
low, a Cast, a weight stored low) are the fp32 model's, in the same places. Rules:

1. Checkpoints: at most :data:`~amppass.analysis.calibration.CHECKPOINTS` positions in the main graph,
   spread evenly over the search's candidates. At each, the values live there (made by earlier nodes, read
   by later ones or their bodies) are returned by the calibration pass as extra outputs and kept per feed,
   within :data:`~amppass.analysis.calibration.CACHE_BYTES`; a position whose live values are untyped or
   graph outputs is not used.
2. A trial's cut is the last checkpoint before which its nodes equal the fp32 model's (op, inputs, outputs,
   attributes, and the element type of each initializer read). The trial then runs as a model of the nodes
   from the cut on, fed the feed's inputs and the kept values (initializers only the cut-off nodes read are
   left out); a feed without that checkpoint runs the whole trial.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping

import numpy as np
import onnx
from onnx import helper

from ..analysis.calibration import CACHE_BYTES, CHECKPOINTS
from .view import subgraphs

log = logging.getLogger(__name__)


class Checkpoints:
    """The fp32 values live at the checkpoints of a model's main graph, per kept feed (module docstring)."""

    def __init__(self, model: onnx.ModelProto, candidates: Iterable[str], types: Mapping[str, int]):
        graph = model.graph
        nodes = list(graph.node)
        where = {n.name: i for i, n in enumerate(nodes)}
        positions = sorted(where[c] for c in candidates if c in where)
        step = max(1, len(positions) // CHECKPOINTS)
        outputs = {o.name for o in graph.output}
        reads = [_reads(n) for n in nodes]
        self.live: dict[int, list[str]] = {}
        for position in positions[step // 2::step][:CHECKPOINTS]:
            later = set().union(*reads[position:]) | outputs
            live = [v for n in nodes[:position] for v in n.output if v and v in later]
            if live and all(v in types and v not in outputs for v in live):
                self.live[position] = live
        self.types = dict(types)
        self.signatures = [_signature(n, _initializer_types(graph)) for n in nodes]
        self.values: dict[int, dict[int, dict[str, np.ndarray]]] = {}  # feed -> position -> value -> array
        self.bytes = 0

    def wanted(self) -> list[str]:
        """Every value some checkpoint keeps: outputs the calibration pass adds."""
        return list(dict.fromkeys(v for live in self.live.values() for v in live))

    def record(self, feed: int, values: Mapping[str, np.ndarray]) -> None:
        """Keep, for kept ``feed``, the live values of each checkpoint while they fit the budget."""
        held: set[str] = set()
        for position, live in self.live.items():
            fresh = sum(values[v].nbytes for v in live if v not in held)
            if self.bytes + fresh > CACHE_BYTES:
                return
            self.bytes += fresh
            held.update(live)
            self.values.setdefault(feed, {})[position] = {v: values[v] for v in live}

    def cut(self, trial: onnx.ModelProto) -> int | None:
        """Rule 2: the last checkpoint position the trial reaches unchanged, or None."""
        inits = _initializer_types(trial.graph)
        same = 0
        for node, signature in zip(trial.graph.node, self.signatures):
            if _signature(node, inits) != signature:
                break
            same += 1
        return max((p for p in self.live if p <= same), default=None)

    def suffix(self, trial: onnx.ModelProto, position: int) -> onnx.ModelProto:
        """The trial from the node at ``position`` on, taking the values live there as inputs (rule 2)."""
        model = onnx.ModelProto()
        model.CopyFrom(trial)
        graph = model.graph
        del graph.node[:position]
        read = set().union(*(_reads(n) for n in graph.node)) | {o.name for o in graph.output}
        graph.input.extend(helper.make_tensor_value_info(v, self.types[v], None) for v in self.live[position])
        kept = [t for t in graph.initializer if t.name in read]
        del graph.initializer[:]
        graph.initializer.extend(kept)
        return model


def _reads(node: onnx.NodeProto) -> set[str]:
    """Names ``node`` reads: its inputs and every name its bodies read (their own values included: harmless)."""
    names = {v for v in node.input if v}
    for body in subgraphs(node):
        for inner in body.node:
            names |= _reads(inner)
    return names


def _initializer_types(graph: onnx.GraphProto) -> dict[str, int]:
    return {t.name: t.data_type for t in graph.initializer}


def _signature(node: onnx.NodeProto, initializers: Mapping[str, int]) -> tuple[Any, ...]:
    """What a node computes from what, comparable between the fp32 model and a rewritten copy."""
    return (node.domain, node.op_type, tuple(node.input), tuple(node.output),
            tuple(a.SerializeToString() for a in node.attribute), tuple(initializers.get(v) for v in node.input))
