"""Inputs a model changes in place without returning them: a write a captured graph cannot repeat.

torch.export flattens an input object of a registered pytree type (transformers' ``DynamicCache``) into its
tensors and traces the model on a copy rebuilt from them. A model that appends to such an object and returns
it hands the graph's output the new tensors, and the converted model returns an equal object. A model that
appends to it and returns something else (an encoder-only checkpoint such as XLM-RoBERTa-XL run with a
cache, whose ``past_key_values`` output is None) leaves the write in the discarded copy: the converted model
would return the same logits while the caller's cache stayed empty, and every later step of ``generate()``
would read a cache without the earlier tokens, a silently wrong result. So, before capture, the model runs
once on a deep copy of the example; an input object whose tensors it changed, and that the output does not
hold, is named in a :class:`~amppass.errors.CaptureError`.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

_PLAIN = (list, tuple, dict)


def unreturned_write(model: nn.Module, args: tuple, kwargs: dict) -> str | None:
    """Describe the first input object ``model`` changes in place but does not return (None when none)."""
    objects = [(f"positional input {i}{path}", obj) for i, arg in enumerate(args) for path, obj in _objects(arg)]
    objects += [(f"{name}{path}", obj) for name, value in kwargs.items() for path, obj in _objects(value)]
    if not objects:
        return None
    copied = copy.deepcopy((args, kwargs, [obj for _, obj in objects]))
    call_args, call_kwargs, copies = copied
    before = [_shape(obj) for obj in copies]
    with torch.no_grad():
        out = model(*call_args, **call_kwargs)
    returned = {id(obj) for _, obj in _objects(out)}
    for (path, _), obj, was in zip(objects, copies, before, strict=True):
        now = _shape(obj)
        if now != was and id(obj) not in returned:
            return (f"{type(model).__name__} writes into its input {path!r} ({type(obj).__name__}: {_told(was)} -> "
                    f"{_told(now)}) without returning it; a captured graph cannot write into the caller's object, "
                    "so the converted model would leave it unchanged")
    return None


def _objects(tree: Any) -> list[tuple[str, Any]]:
    """(path, object) of every object in ``tree`` of a registered pytree type other than list, tuple, dict."""
    found: list[tuple[str, Any]] = []

    def is_object(value: Any) -> bool:
        return type(value) in pytree.SUPPORTED_NODES and not isinstance(value, _PLAIN)

    leaves = pytree.tree_flatten_with_path(tree, is_leaf=is_object)[0]
    for path, value in leaves:
        if is_object(value):
            found.append((pytree.keystr(path), value))
    return found


def _shape(obj: Any) -> tuple:
    """The object's tensors as (shape) tuples, in flattening order: what a write in place changes."""
    return tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else repr(t) for t in pytree.tree_leaves(obj))


def _told(shape: tuple) -> str:
    tensors = [s for s in shape if isinstance(s, tuple)]
    return f"{len(tensors)} tensors" + (f", the first {list(tensors[0])}" if tensors else "")
