"""Rebuild a :class:`Report` from a converted GraphModule's ``node.meta`` and ``meta``."""

from __future__ import annotations

from torch import fx

from ..analysis.record import META_KEY
from ..errors import InputError
from . import stored_record
from .report import Report


def read_graph_module(gm: fx.GraphModule) -> Report:
    """The report stored in ``gm`` by :func:`amppass.convert`."""
    raw = dict(getattr(gm, "meta", {}).get(META_KEY, {}))
    if not raw:
        raise InputError(
            f"{type(gm).__name__} carries no amppass decisions; pass the module amppass.convert returned"
        )
    info = stored_record.model_info(raw, f"{type(gm).__name__}.meta['amppass']")
    rows = [stored_record.row(node.name, node.meta[META_KEY], info["dtype"]) for node in gm.graph.nodes
            if META_KEY in node.meta]
    return Report([r for r in rows if r is not None], info)
