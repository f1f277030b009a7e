"""Rebuild a :class:`Report` from a converted ONNX model's node and model ``metadata_props``."""

from __future__ import annotations

import json
import os

import onnx

from ..errors import InputError
from ..onnx.rewrite import META_KEY
from ..onnx.view import all_nodes
from .report import Report, Row


def read_onnx(model: onnx.ModelProto | str | os.PathLike) -> Report:
    """The report stored in ``model`` (or the .onnx file at that path) by :func:`amppass.convert_onnx`."""
    if not isinstance(model, onnx.ModelProto):
        path = os.fspath(model)
        if not os.path.isfile(path):
            raise InputError(f"{path!r} is not a file; pass the path of an .onnx model amppass converted")
        model = onnx.load(path, load_external_data=False)
    info = {p.key: p.value for p in model.metadata_props}.get(META_KEY)
    if info is None:
        raise InputError("the ONNX model carries no amppass decisions (no metadata_props['amppass']); "
                         "pass a model amppass.convert_onnx returned")
    info = json.loads(info)
    low = info["dtype"]
    rows = []
    for node in all_nodes(model.graph):
        raw = {p.key: p.value for p in node.metadata_props}.get(META_KEY)
        if raw is None:
            continue
        meta = json.loads(raw)
        if meta.get("cast"):
            continue
        precision = {"low": low, "fp32": "fp32", "fp32-accumulate": "fp32", "keep": "-"}[meta["precision"]]
        rows.append(Row(node.name, meta["op"], precision, meta["reason"], meta["source"],
                        list(meta.get("casts_in", [])), dict(meta.get("evidence", {}))))
    return Report(rows, info)
