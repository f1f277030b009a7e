"""The operators a program's ``models/model.json`` names, checked against what ``torch.export.save`` writes
before torch resolves any of them.

torch 2.13's deserializer (``GraphModuleDeserializer.deserialize_operator``) turns a node's ``target`` and every
``as_operator`` argument into a Python object by ``getattr`` from the ``torch``, ``math`` or ``operator``
module, whatever the name: ``torch.os.system`` is :func:`os.system`. A higher-order op such as
``torch.ops.higher_order.wrap`` then calls the object it is given when the graph runs (``torch.fx.Interpreter``
runs it, and so does the module torch generates). So every name must be one of (:func:`operator_refusal`):

- an operator overload of ``torch.ops`` (``torch.ops.aten.linear.default``) that reads or writes no file
  (``aten.from_file`` and ``aten.save`` take a file name);
- a higher-order op of :data:`HIGHER_ORDER_OPS`, those ``torch.export`` writes whose operands are graphs of the
  same file, tensors, operators checked the same way, or plain values;
- for a node's target alone, one of the arithmetic functions torch writes for symbolic sizes
  (``_operator.add``, ``torch.sym_max``; torch's ``_SYM_OPS``).

Anything else is refused (:func:`amppass.archive.program.check_program` names the node) before torch reads the file.
A node of size arithmetic that raises to or shifts by a constant beyond :data:`MAX_SHIFT` is refused too
(:func:`growing_constants`): each call would compute it. The functions a node's ``source_fn_stack`` metadata names are
resolved the same way and stored in the node's
``meta``: each must stay text or be an operator, a ``torch.nn.Module`` class or a function of torch
(:func:`source_refusal`).
"""

from __future__ import annotations

import functools
import re
from typing import Any, Iterator

# what torch.export writes for control flow, autocast and no_grad regions, effects, mutation and attention;
# each takes subgraphs of the file (checked node by node), tensors, plain values or checked operators
HIGHER_ORDER_OPS = frozenset({
    "cond", "while_loop", "while_loop_stack_output", "map_impl", "scan", "associative_scan",
    "wrap_with_set_grad_enabled", "wrap_with_autocast", "auto_functionalized", "auto_functionalized_v2",
    "with_effects", "invoke_subgraph", "flex_attention", "flex_attention_backward", "hints_wrapper", "out_dtype",
})
_NAME = r"[A-Za-z_][A-Za-z0-9_]{0,127}"
_OPERATOR = re.compile(rf"torch\.ops\.({_NAME})\.({_NAME})\.({_NAME})")
_HIGHER_ORDER = re.compile(rf"torch\.ops\.higher_order\.({_NAME})")
MAX_SHIFT = 64  # a constant exponent or shift of torch's size arithmetic (_operator.pow(9, 10**9) hangs a call)
_GROWING = ("_operator.pow", "_operator.lshift")
_FILE_ARGUMENTS = ("file", "path")  # a str argument so named reads or writes a file (aten.from_file, aten.save)


def operator_refusal(text: Any, target: bool) -> str | None:
    """Why the operator name ``text`` is refused (module docstring), or None; ``target``: it is a node's target,
    where torch's arithmetic on sizes is allowed too."""
    return _refusal(text, target) if isinstance(text, str) and len(text) <= 512 else "is not an operator's name"


@functools.lru_cache(maxsize=4096)
def _refusal(text: str, target: bool) -> str | None:
    """:func:`operator_refusal` of a string (cached: a program names the same few operators many times)."""
    import torch

    if target and text in _size_arithmetic():
        return None
    found = _HIGHER_ORDER.fullmatch(text)
    if found is not None:
        if found.group(1) not in HIGHER_ORDER_OPS:
            return "is a higher-order op that amppass does not vouch for"
        op = getattr(torch.ops.higher_order, found.group(1), None)
        return None if isinstance(op, torch._ops.HigherOrderOperator) else "is not a higher-order op of this torch"
    found = _OPERATOR.fullmatch(text)
    if found is None:
        return "is not an operator of torch.ops (torch.ops.<namespace>.<op>.<overload>)"
    try:
        op = getattr(getattr(getattr(torch.ops, found.group(1)), found.group(2)), found.group(3))
    except (AttributeError, RuntimeError):
        return "is not an operator registered in this process"
    if not isinstance(op, torch._ops.OpOverload):
        return "is not an operator overload"
    if any(str(a.type).endswith("str") and any(w in a.name.lower() for w in _FILE_ARGUMENTS)
           for a in op._schema.arguments):
        return "reads or writes a file"
    return None


def source_refusal(text: Any) -> str | None:
    """Why a ``source_fn_stack`` entry's function (node metadata: what the node came from, which torch resolves
    as it resolves operators but from ``torch.nn`` too) is refused, or None: it must stay text, or be an
    operator, a ``torch.nn.Module`` class or a function of torch, ``operator`` or ``math``, never
    :func:`os.system` or a module."""
    if not isinstance(text, str) or len(text) > 512:
        return "is not a function's name"
    return None if operator_refusal(text, target=True) is None else _source_refusal(text)


@functools.lru_cache(maxsize=4096)
def _source_refusal(text: str) -> str | None:
    import math
    import operator

    import torch

    if text.startswith("#"):
        return "is an extension operator"
    # torch's GraphModuleDeserializer.deserialize_metadata: the same prefixes, the same getattr walk
    start = {"torch.nn": (torch.nn, 2), "torch": (torch, 1), "_operator": (operator, 1), "math": (math, 1)}
    prefix = next((p for p in start if text.startswith(p)), None)
    if prefix is None:
        return None  # torch keeps it as text
    found, skip = start[prefix]
    for name in text.split(".")[skip:]:
        if name.startswith("__") or not hasattr(found, name):
            return None if not name.startswith("__") else "reaches a dunder attribute"
        found = getattr(found, name)
    if isinstance(found, type):
        return None if issubclass(found, torch.nn.Module) else "is a class other than a torch.nn.Module"
    module = getattr(found, "__module__", None) or ""
    if callable(found) and module.partition(".")[0] in ("torch", "_operator", "operator", "math"):
        return None
    return f"resolves to {type(found).__name__} of {module or 'no module'!r}, not a function of torch"


@functools.cache
def _size_arithmetic() -> frozenset[str]:
    """The names torch's serializer writes for the arithmetic of symbolic sizes (``_operator.add``)."""
    from torch._export.serde.serialize import _SYM_OPS

    return frozenset(f"{op.__module__}.{op.__name__}" for op in _SYM_OPS)


def graph_operators(graph: Any) -> Iterator[tuple[str, Any, bool | None]]:
    """(node name, operator name, whether it is the node's target: None for the functions of its
    ``source_fn_stack``) for each node of ``graph`` (a serialised graph): its target, every ``as_operator`` of
    its arguments and the functions its metadata names; subgraphs left out (the caller walks each subgraph as a
    graph of its own)."""
    for name, node in _nodes(graph):
        yield name, node.get("target"), True
        metadata = node.get("metadata")
        stack = metadata.get("source_fn_stack") if isinstance(metadata, dict) else None
        for entry in stack.split(";") if isinstance(stack, str) else []:  # "name,function;name,function"
            yield name, entry.rpartition(",")[2], None
        pending = [node.get("inputs")]
        while pending:
            item = pending.pop()
            if isinstance(item, dict):
                if "as_operator" in item:
                    yield name, item["as_operator"], False
                pending.extend(v for k, v in item.items() if k != "graph")
            elif isinstance(item, list):
                pending.extend(item)


def growing_constants(graph: Any) -> Iterator[tuple[str, str]]:
    """(node name, target) of each node of ``graph`` that raises to or shifts by a constant beyond
    :data:`MAX_SHIFT` (``_operator.pow(s0, 10**9)``), which a call would compute."""
    for name, node in _nodes(graph):
        if node.get("target") in _GROWING and _constant_beyond(node.get("inputs"), MAX_SHIFT):
            yield name, node["target"]


def _nodes(graph: Any) -> Iterator[tuple[str, dict]]:
    """(name, node) of each node object of a serialised graph; a node without a name is named by its index."""
    nodes = graph.get("nodes") if isinstance(graph, dict) else None
    for index, node in enumerate(nodes if isinstance(nodes, list) else []):
        if isinstance(node, dict):
            yield (node["name"] if isinstance(node.get("name"), str) else f"#{index}"), node


def _constant_beyond(inputs: Any, limit: int) -> bool:
    """Whether the second argument of a size-arithmetic node is a constant (``as_int``, or a symbolic int
    written as one) beyond ``limit``."""
    if not isinstance(inputs, list) or len(inputs) < 2 or not isinstance(inputs[1], dict):
        return False
    argument = inputs[1].get("arg")
    argument = argument.get("as_sym_int", argument) if isinstance(argument, dict) else None
    value = argument.get("as_int") if isinstance(argument, dict) else None
    return isinstance(value, int) and abs(value) > limit
