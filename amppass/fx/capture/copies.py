"""Copies of modules that own their module objects but share the tensors of the original."""

from __future__ import annotations

import copy
import warnings
from typing import TypeVar

from torch import nn

M = TypeVar("M", bound=nn.Module)


def shared_copy(module: M) -> M:
    """A deep copy of ``module`` whose parameters and buffers are the original's own tensors: replacing a
    submodule or weight of the copy, or switching its mode, never reaches the original."""
    memo = {id(t): t for t in list(module.parameters()) + list(module.buffers())}
    with warnings.catch_warnings():  # copying torch's pytree specs trips its own LeafSpec deprecation notice
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        return copy.deepcopy(module, memo)
