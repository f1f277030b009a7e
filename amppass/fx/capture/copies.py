"""Copies of modules that own their module objects but share the tensors of the original."""

from __future__ import annotations

import copy
import logging
import warnings
from typing import TypeVar

from torch import nn

log = logging.getLogger(__name__)

M = TypeVar("M", bound=nn.Module)


def shared_copy(module: M) -> M:
    """A deep copy of ``module`` whose parameters and buffers are the original's own tensors: replacing a
    submodule or weight of the copy, or switching its mode, never reaches the original."""
    memo = {id(t): t for t in list(module.parameters()) + list(module.buffers())}
    with warnings.catch_warnings():  # copying torch's pytree specs trips its own LeafSpec deprecation notice
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        return copy.deepcopy(module, memo)


def private_copy(model: M) -> M:
    """The module amppass traces or runs in the caller's place (torch.export, the ONNX exporters, the example call
    that checks a capture): a :func:`shared_copy`, so what the model's code stores on itself while it runs (fake
    tensors while traced: ultralytics' Detect head caches its anchors) lands on the copy; the model itself where it
    cannot be copied (logged)."""
    try:
        return shared_copy(model)
    except Exception as err:  # noqa: BLE001 - an attribute that refuses deepcopy: use the model itself
        log.info("%s cannot be copied (%s); the model itself is traced", type(model).__name__, err)
        return model
