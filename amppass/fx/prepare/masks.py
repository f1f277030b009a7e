"""An attention mask that masks nothing leaves ``scaled_dot_product_attention``; a causal one becomes ``is_causal``.

Eager transformers skips the mask of an unpadded call and passes ``attn_mask=None``. Under torch.export it cannot
know the call is unpadded, so it writes the mask out: ViT's captured graph builds a boolean ``[B, 1, 197, 197]``
mask of ``True`` from ``arange`` and ``ge`` and hands it to each layer's attention. On CUDA a mask rules out the
flash kernel (PyTorch's flash attention takes none), and on the CPU it costs a ``where`` per layer.

Rules:

1. Only a boolean mask whose value the graph fixes is folded, one of two ways. Evaluated: below its ``expand``
   calls (which only repeat it) it is computed from constants alone, by the pure ops in ``_PURE``, with no graph
   input, parameter, buffer or symbolic size among its ancestors. Proven: it is True whatever the sizes by its
   ops alone (``_proven_true``): an index ``arange`` counts up from its start, shifted by constants, compared
   ``>=`` or ``>`` with a bound it cannot fall below (BERT's unpadded mask is ``arange(S) + 0 >= 0``), ``ones``,
   the ``and`` of such, the ``or`` of one, and shape ops of them. Either way its value is the same on every call.
2. A boolean mask that is ``True`` everywhere is dropped (``attn_mask=None``): attention over every key is what
   SDPA does without one. A mask whose recorded shape does not broadcast into the scores' is kept.
3. A boolean mask equal to the lower triangle of a square ``[L, L]`` (the query and key lengths both ``L``, fixed)
   in every leading slice becomes ``is_causal=True``, which is exactly that mask.
4. Float masks (added to the scores) are kept: ``-inf`` and ``finfo.min`` differ on a row masked whole.
5. The attention node records what was folded (``meta["amppass_fused"]``), and the report's reason says so.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..arguments import argument
from .gelu import FUSED_KEY

log = logging.getLogger(__name__)

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_EXPAND = (aten.expand.default,)
# ops whose every output value is a value of their first argument
_SAME_VALUES = {aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.view.default,
                aten.reshape.default, aten.slice.Tensor, aten.select.int, aten.permute.default, aten.transpose.int,
                aten.clone.default, aten.contiguous.default, aten.alias.default}
_AND = {aten.__and__.Tensor, aten.logical_and.default, aten.bitwise_and.Tensor}
_OR = {aten.__or__.Tensor, aten.logical_or.default, aten.bitwise_or.Tensor}
_PURE = {
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default, aten.ones.default,
    aten.zeros.default, aten.scalar_tensor.default, aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor,
    aten.sub.Scalar, aten.mul.Tensor, aten.mul.Scalar, aten.ge.Scalar, aten.ge.Tensor, aten.gt.Scalar,
    aten.gt.Tensor, aten.le.Scalar, aten.le.Tensor, aten.lt.Scalar, aten.lt.Tensor, aten.eq.Scalar,
    aten.eq.Tensor, aten.ne.Scalar, aten.ne.Tensor, aten.logical_and.default, aten.logical_or.default,
    aten.logical_not.default, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_not.default,
    aten.__and__.Tensor, aten.__or__.Tensor, aten.where.self, aten.unsqueeze.default, aten.squeeze.dim,
    aten.view.default, aten.reshape.default, aten.expand.default, aten.slice.Tensor, aten.select.int,
    aten.permute.default, aten.transpose.int, aten.clone.default, aten._to_copy.default, aten.to.dtype,
    aten.tril.default, aten.triu.default, aten.index.Tensor,
}


def fold_constant_masks(gm: fx.GraphModule) -> int:
    """Drop the all-true attention masks of ``gm`` and turn constant causal ones into ``is_causal``; return how
    many attention calls changed."""
    folded = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target != _SDPA:
            continue
        mask, is_causal = argument(node, "attn_mask"), argument(node, "is_causal")
        if not isinstance(mask, fx.Node) or is_causal:
            continue
        if not _is_bool(mask) or not _broadcasts_into_scores(mask, node):
            continue
        proven = _proven_true(mask)
        value = None if proven else _constant_value(_below_expands(mask))
        if proven or value is not None and bool(value.all()):
            _set(node, attn_mask=None)
            why = "the attention mask is True everywhere (fixed by the graph), so SDPA runs without one"
        elif value is not None and _is_square_causal(value, node):
            _set(node, attn_mask=None, is_causal=True)
            why = "the attention mask is the causal lower triangle (fixed by the graph), so SDPA runs is_causal"
        else:
            continue
        node.meta[FUSED_KEY] = f"{why}, which lets it use a fused kernel ({mask.name} folded)"
        _erase_unread(gm.graph, mask)
        folded += 1
    if folded:
        gm.recompile()
        log.info("folded %d constant attention masks", folded)
    return folded


def _erase_unread(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` if nothing reads it, then so each of its inputs (the mask's own ops; a size or value other
    nodes read stays, and so does an op that writes)."""
    if node.users or node.op != "call_function" or node.is_impure():
        return
    inputs = node.all_input_nodes
    graph.erase_node(node)
    for value in inputs:
        _erase_unread(graph, value)


def _is_bool(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dtype == torch.bool


def _proven_true(node: fx.Node) -> bool:
    """Whether ``node`` is True everywhere by its ops alone, whatever the sizes (rule 1's bounds): an index that
    ``arange`` counts up from its start, shifted by constants, compared with a bound it cannot fall below; ones;
    and of two such, or of one and anything; shape ops of one."""
    if node.op != "call_function":
        return False
    target, args = node.target, node.args
    if target in _SAME_VALUES and args and isinstance(args[0], fx.Node):
        return _proven_true(args[0])
    if target in (aten.ge.Scalar, aten.gt.Scalar) and isinstance(args[0], fx.Node) and _number(args[1]):
        least = _least(args[0])
        return least is not None and (least >= args[1] if target == aten.ge.Scalar else least > args[1])
    if target in _AND:
        return all(isinstance(a, fx.Node) and _proven_true(a) for a in args[:2])
    if target in _OR:
        return any(isinstance(a, fx.Node) and _proven_true(a) for a in args[:2])
    if target in (aten.ones.default, aten.new_ones.default) or \
            target in (aten.full.default, aten.new_full.default) and args[-1] is True:
        return _is_bool(node)
    return False


def _least(node: fx.Node) -> float | None:
    """A lower bound of every value of ``node`` that its ops prove (``arange`` from its start, shifted by
    constants), or None."""
    if node.op != "call_function":
        return None
    target, args = node.target, node.args
    if target == aten.arange.default:
        return 0
    if target in (aten.arange.start, aten.arange.start_step) and _number(args[0]):
        step = args[2] if len(args) > 2 else node.kwargs.get("step", 1)
        return args[0] if _number(step) and step > 0 else None
    if target in _SAME_VALUES and args and isinstance(args[0], fx.Node):
        return _least(args[0])
    if target in (aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar) and \
            isinstance(args[0], fx.Node) and _number(args[1]) and "alpha" not in node.kwargs:
        least = _least(args[0])
        if least is None:
            return None
        return least + args[1] if target in (aten.add.Tensor, aten.add.Scalar) else least - args[1]
    return None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _set(node: fx.Node, **values: Any) -> None:
    """Set SDPA arguments by name, moving positional ones from ``attn_mask`` on into keywords."""
    names = ("attn_mask", "dropout_p", "is_causal")
    kwargs = dict(node.kwargs)
    for offset, name in enumerate(names):
        if len(node.args) > 3 + offset:
            kwargs.setdefault(name, node.args[3 + offset])
    kwargs.update(values)
    node.args = node.args[:3]
    node.kwargs = kwargs


def _below_expands(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target in _EXPAND and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _constant_value(node: fx.Node) -> torch.Tensor | None:
    """The value of ``node`` if the graph fixes it (rule 1), computed on the CPU; else None."""
    order: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(current: fx.Node) -> bool:
        if current in seen:
            return True
        seen.add(current)
        if current.op != "call_function" or current.target not in _PURE:
            return False
        for leaf in pytree.tree_leaves((current.args, current.kwargs)):
            if isinstance(leaf, fx.Node):
                if not visit(leaf):
                    return False
            elif isinstance(leaf, torch.SymInt | torch.SymFloat | torch.SymBool | torch.Tensor):
                return False
        order.append(current)
        return True

    if not visit(node):
        return None
    values: dict[fx.Node, Any] = {}
    try:
        for current in order:
            kwargs = dict(fx.node.map_arg(current.kwargs, values.__getitem__))
            if "device" in kwargs:
                kwargs["device"] = torch.device("cpu")
            kwargs.pop("pin_memory", None)
            values[current] = current.target(*fx.node.map_arg(current.args, values.__getitem__), **kwargs)
    except Exception:  # a value this cannot compute is not folded
        log.debug("attention mask %s not evaluated", node.name, exc_info=True)
        return None
    value = values[node]
    return value if isinstance(value, torch.Tensor) else None


def _shape(node: Any) -> tuple | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _broadcasts_into_scores(mask: fx.Node, sdpa: fx.Node) -> bool:
    """Whether the mask broadcasts into the scores' shape ``[..., L, S]`` without enlarging it (rule 2)."""
    mask_shape, query, key = _shape(mask), _shape(sdpa.args[0]), _shape(sdpa.args[1])
    if mask_shape is None or query is None or key is None or len(mask_shape) > len(query):
        return False
    scores = (*query[:-1], key[-2])
    return all(_same(m, 1) or _same(m, s) for m, s in zip(reversed(mask_shape), reversed(scores), strict=False))


def _same(size: Any, other: Any) -> bool:
    """Whether two sizes are the same without asking the shape environment (a symbolic size equals only itself)."""
    if isinstance(size, int) and isinstance(other, int):
        return size == other
    return str(size) == str(other)


def _is_square_causal(value: torch.Tensor, sdpa: fx.Node) -> bool:
    query, key = _shape(sdpa.args[0]), _shape(sdpa.args[1])
    if value.dim() < 2 or query is None or key is None:
        return False
    length = value.shape[-1]
    if value.shape[-2] != length or query[-2] != length or key[-2] != length or not isinstance(query[-2], int):
        return False
    lower = torch.ones(length, length, dtype=torch.bool).tril()
    return bool((value == lower).all())
