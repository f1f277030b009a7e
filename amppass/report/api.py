"""``amppass.report``: the report of any converted artifact."""

from __future__ import annotations

from typing import Any

from torch import fx

from ..errors import InputError
from .fx_reader import read_graph_module
from .report import Report


def report(converted: Any) -> Report:
    """Rebuild the per-node precision report from a model amppass converted.

    Accepts the ``torch.fx.GraphModule`` that :func:`amppass.convert` returned.
    """
    if isinstance(converted, fx.GraphModule):
        return read_graph_module(converted)
    raise InputError(
        f"amppass.report cannot read a {type(converted).__name__}; pass a GraphModule from amppass.convert"
    )
