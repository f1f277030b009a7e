"""Reading an FX node's arguments by name: what its target (an ATen overload or a Python function) calls them, and
the value the node passes, its default where it leaves one out. Capture, graph preparation and the policy view
all ask, so it lives above them."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import fx


def argument_names(node: fx.Node) -> list[str]:
    """The names of the positional arguments of ``node``'s target (an ATen overload or a Python function);
    [] where its signature is unknown."""
    return [name for name, _ in _parameters(node.target)]


def argument(node: fx.Node, name: str) -> Any:
    """The value ``node`` passes for its target's argument ``name`` (its default when left out); None if the
    target's signature is unknown or has no such argument."""
    if name in node.kwargs:
        return node.kwargs[name]
    for index, (param, default) in enumerate(_parameters(node.target)):
        if param == name:
            return node.args[index] if index < len(node.args) else default
    return None


def _parameters(target: Any) -> list[tuple[str, Any]]:
    """(name, default or None) of the positional parameters of an ATen overload or a Python function."""
    if isinstance(target, torch._ops.OpOverload):
        return [(a.name, a.default_value if a.has_default_value() else None)
                for a in target._schema.arguments if not a.kwarg_only]
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    return [(p.name, None if p.default is p.empty else p.default) for p in signature.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
