"""Multiply-accumulate counts of the heavy ONNX ops (:func:`amppass.onnx.policy.is_heavy`), from the shapes onnx
shape inference gives. Einsum and Attention have no formula here (their counts depend on the equation and the
heads): they count as unknown.

The ONNX counterpart of :mod:`amppass.fx.view.macs`: the report uses the counts to say which share of the
heavy work runs in low precision. A dimension shape inference left symbolic (a ``dim_param`` such as a
dynamic batch) makes the count unknown (``None``) rather than a guess.
"""

from __future__ import annotations

import math

import onnx

from .policy import is_heavy
from .view import dims, subgraphs

Shapes = dict[str, list[int]]


def operands(node: onnx.NodeProto) -> list[str]:
    """The values whose shapes :func:`node_macs` reads: the first two inputs and the output; for a
    recurrent op, its input and its two weights (X, W, R)."""
    if node.op_type in _RECURRENT:
        return list(node.input[:3])
    return list(node.input[:2]) + list(node.output[:1])


def value_shapes(model: onnx.ModelProto, wanted: set[str]) -> Shapes:
    """Value name -> concrete shape, for the ``wanted`` values of ``model`` (bodies included) whose shape
    is known."""
    shapes: Shapes = {}

    def visit(graph: onnx.GraphProto) -> None:
        for info in list(graph.input) + list(graph.output) + list(graph.value_info):
            if info.name not in wanted or not info.type.tensor_type.HasField("shape"):
                continue
            known = dims(info)
            if all(d is not None for d in known):
                shapes[info.name] = [d for d in known if d is not None]
        for init in graph.initializer:
            if init.name in wanted:
                shapes[init.name] = list(init.dims)
        for node in graph.node:
            for sub in subgraphs(node):
                visit(sub)

    visit(model.graph)
    return shapes


def node_macs(node: onnx.NodeProto, shapes: Shapes) -> int | None:
    """Multiply-accumulates ``node`` performs, or None if it is not a heavy op or a shape is unknown."""
    counter = _COUNTERS.get(node.op_type) if is_heavy(node) else None
    if counter is None:
        return None
    known = [shapes.get(v) for v in operands(node)]
    found = [s for s in known if s is not None]
    if len(found) < len(known) or len(node.input) < 2:
        return None
    return counter(node, *found)


def _matmul(node: onnx.NodeProto, a: list[int], b: list[int], out: list[int]) -> int:
    return math.prod(out) * a[-1]  # a 1-D operand keeps its only dimension last as well


def _gemm(node: onnx.NodeProto, a: list[int], b: list[int], out: list[int]) -> int:
    transposed = any(attr.name == "transA" and attr.i for attr in node.attribute)
    return math.prod(out) * (a[0] if transposed else a[-1])


def _conv(node: onnx.NodeProto, x: list[int], w: list[int], out: list[int]) -> int:
    return math.prod(out) * math.prod(w[1:])  # one weight slice (C/group x kernel) per output element


def _conv_transpose(node: onnx.NodeProto, x: list[int], w: list[int], out: list[int]) -> int:
    return math.prod(x) * math.prod(w[1:])  # one weight slice (M/group x kernel) per input element


def _recurrent(node: onnx.NodeProto, x: list[int], w: list[int], r: list[int]) -> int:
    # W and R ([directions, gates x hidden, in / hidden]) are applied once per time step and batch element
    return math.prod(x[:-1]) * (math.prod(w) + math.prod(r))


_RECURRENT = frozenset({"LSTM", "GRU", "RNN"})
_COUNTERS = {"MatMul": _matmul, "Gemm": _gemm, "Conv": _conv, "ConvTranspose": _conv_transpose,
             **{op: _recurrent for op in _RECURRENT}}
