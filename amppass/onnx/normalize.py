"""Clean-ups of the private copy before planning, for graphs whose exporter wrapped weights in nodes.

The TorchScript exporter without constant folding (the way to keep an eval BatchNorm as its own node) reads
shared parameters through ``Identity`` nodes: a BatchNorm's scale, bias, mean and variance come out of
``Identity(initializer)``. To the planner those are run-time values computed in fp32, not weights, so the
op mixes an fp32 value with its low-precision input and runs fp32, with a Cast on each side. Readers of
such an Identity read the weight itself instead, and the Identity goes: the weight rules then decide (a
weight that fits the low dtype is stored low once), as for the same model exported with folding.

Models of IR version 3 (opset 8 and older exporters, the ONNX suite's light nets) must list every initializer
among the graph inputs; there it is a constant all the same. The converted model is written at IR version 10,
where an initializer listed as an input is only a default the caller may override, and the plan treats such
inputs as fp32 values: the copy drops them from the inputs, so they stay the constants they were and are
weights to the plan.
"""

from __future__ import annotations

import onnx

from .view import all_nodes, replace_nodes, subgraphs


def bypass_weight_identities(model: onnx.ModelProto) -> int:
    """Point readers of ``Identity(weight)`` in the main graph at the weight and drop the Identity; the
    number dropped. An Identity whose output is a graph output, or is read inside a subgraph, stays."""
    graph = model.graph
    weights = {t.name for t in graph.initializer}
    weights.update(n.output[0] for n in graph.node if n.op_type == "Constant" and n.output)
    kept = {o.name for o in graph.output} | _read_in_subgraphs(graph)
    alias = {}
    for node in graph.node:
        if node.op_type == "Identity" and node.domain in ("", "ai.onnx") and len(node.input) == 1 \
                and node.input[0] in weights and node.output[0] not in kept:
            alias[node.output[0]] = node.input[0]
    if not alias:
        return 0
    for node in graph.node:
        for i, value in enumerate(node.input):
            if value in alias:
                node.input[i] = alias[value]
    replace_nodes(graph, [n for n in graph.node
                          if not (n.op_type == "Identity" and n.output and n.output[0] in alias)])
    return len(alias)


def initializers_out_of_inputs(model: onnx.ModelProto) -> int:
    """Drop the initializers of an IR-version-3 ``model``'s main graph from its inputs and make it IR version 4,
    the first that allows this (module docstring); the number dropped. Later IR versions keep them: there
    they are overridable inputs."""
    if model.ir_version >= 4:
        return 0
    model.ir_version = 4
    graph = model.graph
    constants = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in constants]
    dropped = len(graph.input) - len(inputs)
    if dropped:
        kept = [onnx.ValueInfoProto() for _ in inputs]
        for copy, info in zip(kept, inputs, strict=True):
            copy.CopyFrom(info)
        del graph.input[:]
        graph.input.extend(kept)
    return dropped


def _read_in_subgraphs(graph: onnx.GraphProto) -> set[str]:
    """Names read by nodes of any subgraph (If/Loop/Scan bodies) of ``graph``, however deep."""
    return {value for node in graph.node for body in subgraphs(node) for inner in all_nodes(body)
            for value in inner.input}
