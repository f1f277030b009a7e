"""Tolerance-search runs of an ONNX model that start where the trial model first differs from the fp32 model.

The checkpoint rules of :mod:`amppass.analysis.checkpoints` (placement, budget, which checkpoint a trial
resumes from) hold here with a checkpoint named by its position in the main graph. The rewrite keeps the main graph's
node order and puts each Cast right before its first reader, so a trial's nodes up to the first one it changes
(a node run low, a Cast, a weight stored low) are the fp32 model's, in the same places. What is the ONNX
front end's:

1. Placement: of the positions placed over the search's candidates, those whose live values (made by earlier
   nodes, read by later ones or their bodies) are all typed and none a graph output. The calibration pass
   returns the live values as extra outputs (:meth:`Checkpoints.wanted`) and keeps them per feed, by value
   name; a feed's checkpoints are offered to the budget in order, and the first it refuses ends them.
2. A trial's nodes are unchanged up to the first that differs from the fp32 model's node at the same position
   (op, inputs, outputs, attributes, and the element type of each initializer read). The trial then runs as a
   model of the nodes from the cut on, fed the feed's inputs and the kept values (initializers only the
   cut-off nodes read are left out).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np
import onnx
from onnx import helper

from ..analysis import checkpoints
from .view import subgraphs


class Checkpoints(checkpoints.Checkpoints[int]):
    """The fp32 values live at the checkpoints of a model's main graph, per kept feed (module docstring)."""

    def __init__(self, model: onnx.ModelProto, candidates: Iterable[str], types: Mapping[str, int]):
        graph = model.graph
        nodes = list(graph.node)
        where = {n.name: i for i, n in enumerate(nodes)}
        outputs = {o.name for o in graph.output}
        reads = [_reads(n) for n in nodes]
        self.live: dict[int, list[str]] = {}  # checkpoint position -> the values live there
        for position in checkpoints.place(sorted(where[c] for c in candidates if c in where)):
            later = set().union(*reads[position:]) | outputs
            live = [v for n in nodes[:position] for v in n.output if v and v in later]
            if live and all(v in types and v not in outputs for v in live):
                self.live[position] = live
        super().__init__(self.live)
        self.types = dict(types)
        inits = _initializer_types(graph)
        self.signatures = [_signature(n, inits) for n in nodes]

    def wanted(self) -> list[str]:
        """Every value some checkpoint keeps: outputs the calibration pass adds."""
        return list(dict.fromkeys(v for live in self.live.values() for v in live))

    def record(self, feed: int, values: Mapping[str, np.ndarray]) -> None:
        """Keep, for kept ``feed``, the live values of each checkpoint in order until the budget refuses one."""
        for position, live in self.live.items():
            if not self.keep(feed, position, {v: values[v] for v in live}, {v: values[v].nbytes for v in live}):
                return

    def trial_cut(self, trial: onnx.ModelProto) -> int | None:
        """The last checkpoint position ``trial`` reaches unchanged (rule 2), or None."""
        inits = _initializer_types(trial.graph)
        return self.cut((_signature(node, inits) == signature for node, signature in zip(trial.graph.node,
                                                                                        self.signatures, strict=False)),
                        {p: p for p in self.order})

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
    """Initializer name -> its element type."""
    return {t.name: t.data_type for t in graph.initializer}


def _signature(node: onnx.NodeProto, initializers: Mapping[str, int]) -> tuple[Any, ...]:
    """What a node computes from what, comparable between the fp32 model and a rewritten copy."""
    return (node.domain, node.op_type, tuple(node.input), tuple(node.output),
            tuple(a.SerializeToString() for a in node.attribute), tuple(initializers.get(v) for v in node.input))
