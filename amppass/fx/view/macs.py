"""Multiply-accumulate counts of the heavy FX ops, from the shapes torch.export recorded.

Only the ops that dominate a model's compute are counted (matrix products, convolutions, attention,
recurrent layers and cells: :data:`amppass.fx.view.policy.HEAVY_OPS`, those of them with a formula here); the
report uses them to say which share of the heavy work runs in low precision. Symbolic dimensions count at
the example inputs' sizes (their hint); a node whose shapes are unknown counts as ``None``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import fx

from .ops import op_name
from .policy import HEAVY_OPS

# ops whose MACs are (output elements) x (length of the reduced dimension of the first matrix operand),
# with the index of that operand in node.args
_MATMULS = {"linear": 0, "mm": 0, "bmm": 0, "matmul": 0, "addmm": 1, "baddbmm": 1, "addbmm": 1}
_CONVS = frozenset({"conv1d", "conv2d", "conv3d", "convolution", "_convolution"})
_CONV_TRANSPOSES = frozenset({"conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})
# recurrent layers take their weights as a list (args[2]: w_ih, w_hh, biases, projections per layer and
# direction); cells take w_ih and w_hh as args[2] and args[3]
_RECURRENT_LAYERS = frozenset({"lstm", "gru", "rnn_tanh", "rnn_relu"})
_RECURRENT_CELLS = frozenset({"lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"})


def node_macs(node: fx.Node) -> int | None:
    """Multiply-accumulates one call of ``node`` performs, or None if it is not heavy or shapes are unknown."""
    if node.op != "call_function":
        return None
    name = op_name(node)
    if name not in HEAVY_OPS:
        return None
    try:
        if name in _MATMULS:
            operand = _shape(node.args[_MATMULS[name]])
            out = _shape(node)
            return math.prod(out) * operand[-1] if operand and out is not None else None
        if name in _CONVS or name in _CONV_TRANSPOSES:
            return _conv_macs(node, transposed=name in _CONV_TRANSPOSES)
        if name == "scaled_dot_product_attention":
            return _attention_macs(node)
        if name in _RECURRENT_LAYERS:
            return _recurrent_macs(node, node.args[2])
        if name in _RECURRENT_CELLS:
            return _recurrent_macs(node, node.args[2:4])
    except (IndexError, TypeError):
        return None
    return None


def _conv_macs(node: fx.Node, transposed: bool) -> int | None:
    weight = _shape(node.args[1])
    if weight is None:
        return None
    if op_name(node) in ("convolution", "_convolution"):
        transposed = bool(node.args[6]) if len(node.args) > 6 else bool(node.kwargs.get("transposed", False))
    per_element = weight[1] * math.prod(weight[2:])
    # a convolution does one weight slice per output element; a transposed one, per input element
    counted = _shape(node.args[0]) if transposed else _shape(node)
    return math.prod(counted) * per_element if counted is not None else None


def _attention_macs(node: fx.Node) -> int | None:
    query, key, value = (_shape(node.args[i]) for i in range(3))
    if query is None or key is None or value is None:
        return None
    batch = math.prod(query[:-2])
    length, source = query[-2], key[-2]
    return batch * length * source * (query[-1] + value[-1])  # Q @ K^T, then weights @ V


def _recurrent_macs(node: fx.Node, weights: Any) -> int | None:
    """Every weight matrix (input, hidden and projection, each layer and direction) is applied once per
    time step and batch element; biases are additions, not MACs."""
    steps = _shape(node.args[0])
    shapes = [_shape(w) for w in weights]
    known = [s for s in shapes if s is not None]
    if steps is None or len(known) < len(shapes):
        return None
    return math.prod(steps[:-1]) * sum(math.prod(s) for s in known if len(s) == 2)


def _shape(value: Any) -> list[int] | None:
    """Concrete sizes of a node's recorded output, symbolic dims at their hint."""
    tensor = value.meta.get("val") if isinstance(value, fx.Node) else None
    if not isinstance(tensor, torch.Tensor):
        return None
    sizes = []
    for dim in tensor.shape:
        if isinstance(dim, torch.SymInt):
            hint = dim.node.hint
            if hint is None:
                return None
            dim = hint
        sizes.append(int(dim))
    return sizes


def measured_macs(run: Callable[[], Any]) -> tuple[int, int]:
    """(all, low): the multiply-accumulates the heavy ops make while ``run()`` runs, eager code included, counted
    at dispatch with torch's FLOP formulas (``torch.utils.flop_counter``); low ones are those whose first
    floating operand is fp16 or bf16."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    registry = dict(flop_registry)
    flash = registry.get(torch.ops.aten._scaled_dot_product_flash_attention)
    if flash is not None and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        registry[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu] = flash  # the CPU kernel's name
    counts = [0, 0]

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            formula = registry.get(func.overloadpacket)
            if formula is not None:
                try:
                    macs = int(formula(*args, **kwargs, out_val=out)) // 2
                except (TypeError, ValueError, IndexError):  # an overload the formula does not read
                    return out
                floating = next((a.dtype for a in torch.utils._pytree.tree_leaves(args)
                                 if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
                counts[0] += macs
                counts[1] += macs if floating in (torch.float16, torch.bfloat16) else 0
            return out

    with Counting():
        run()
    return counts[0], counts[1]
