"""Rebuild a :class:`Report` from a converted GraphModule's ``node.meta`` and ``meta``."""

from __future__ import annotations

from torch import fx

from ..errors import InputError
from ..fx.rewrite import META_KEY
from .report import Report, Row


def read_graph_module(gm: fx.GraphModule) -> Report:
    """The report stored in ``gm`` by :func:`amppass.convert`."""
    info = dict(getattr(gm, "meta", {}).get(META_KEY, {}))
    if not info:
        raise InputError(
            f"{type(gm).__name__} carries no amppass decisions; pass the module amppass.convert returned"
        )
    low = info["dtype"]
    rows = []
    for node in gm.graph.nodes:
        meta = node.meta.get(META_KEY)
        if not meta or meta.get("cast"):
            continue
        precision = {"low": low, "fp32": "fp32", "fp32-accumulate": "fp32", "keep": "-"}[meta["precision"]]
        evidence = dict(meta.get("evidence", {}))
        if meta["precision"] == "fp32-accumulate":
            evidence.setdefault("accumulate", "fp32 via dtype= on the low-precision input")
        rows.append(Row(node.name, meta["op"], precision, meta["reason"], meta["source"], list(meta["casts_in"]), evidence))
    return Report(rows, info)



