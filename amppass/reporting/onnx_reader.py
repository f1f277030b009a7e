"""Rebuild a :class:`Report` from a converted ONNX model's node and model ``metadata_props``."""

from __future__ import annotations

import os

import onnx

from ..analysis.record import META_KEY
from ..errors import InputError
from ..onnx.io import lazy_read, validate
from ..onnx.view import all_nodes
from . import stored_record
from .report import Report


def read_onnx(model: onnx.ModelProto | str | os.PathLike) -> Report:
    """The report stored in ``model`` (or the .onnx file at that path) by :func:`amppass.convert_onnx`."""
    where = "the ONNX model"
    if not isinstance(model, onnx.ModelProto):
        path = os.fspath(model)
        where = repr(path)
        if not os.path.isfile(path):
            raise InputError(f"{path!r} is not a file; pass the path of an .onnx model amppass converted")
        try:
            model = lazy_read.load(path)  # the decisions without the weights
        except InputError:  # the file is damaged: the message names it, the byte and the fix
            raise
        except Exception as err:  # protobuf's DecodeError and friends
            raise InputError(f"{path!r} could not be read as an ONNX model ({str(err)[:120]}); pass an .onnx "
                             "model amppass converted") from err
    text = {p.key: p.value for p in model.metadata_props}.get(META_KEY)
    if text is None:
        raise InputError(f"{where} carries no amppass decisions (no metadata_props['amppass']); "
                         "pass a model amppass.convert_onnx returned")
    info = stored_record.model_info(stored_record.parse(text, f"{where}: metadata_props['amppass']"),
                                    f"{where}: metadata")
    validate.check_size(model, where)
    validate.check_nesting(model, where)
    rows = []
    for node in all_nodes(model.graph):
        raw = {p.key: p.value for p in node.metadata_props}.get(META_KEY)
        if raw is not None:
            rows.append(stored_record.row(node.name,
                                          stored_record.parse(raw, f"node {node.name!r}: its amppass decision"),
                                          info["dtype"]))
    return Report([r for r in rows if r is not None], info)
