"""``amppass.save``: a converted model written to a file in the format of its kind, whole or not at all.

An ``onnx.ModelProto`` (what :func:`amppass.convert_onnx` returns, or any ONNX model) is written as an ONNX file,
streamed tensor by tensor with its weights in a data file beside it where needed (:mod:`amppass.onnx.io.save`); a
torch model :func:`amppass.convert` returned is written as a torch.export program, ``.pt2``
(:mod:`amppass.pipelines.serialize`). The kind of model decides the format, so a path whose suffix names the other
format (a ModelProto to ``.pt2``, a torch model to ``.onnx``) is refused before anything is written: such a file
would not load as what its name says.
"""

from __future__ import annotations

import os
from typing import Any

import onnx

from ..errors import InputError
from ..onnx.io import save as onnx_files
from . import serialize


def save(model: Any, path: str | os.PathLike, external_data: bool | None = None) -> None:
    """Write ``model`` to ``path``, whole or not at all: a failure leaves the file there as it was.

    Args:
        model: an ``onnx.ModelProto``, written as an ONNX model (``onnx.load`` reads it, ``amppass.report`` reads
            its decisions), or a module :func:`amppass.convert` returned, written as a torch.export program
            (``torch.export.load`` reads it, :func:`amppass.load` also restores the report). ``model`` is only read.
        path: the file: ``.onnx`` for an ONNX model, ``.pt2`` for a torch model (a name with neither suffix is
            taken as it is).
        external_data: ONNX only. True writes the weights to a fresh data file beside the model
            (``<name>.<random>.data``, named by the model alone), False keeps them inside it; None (the default)
            keeps them inside unless the model is over protobuf's 2 GB limit.
    """
    suffix = _suffix(path)
    if isinstance(model, onnx.ModelProto):
        if suffix == ".pt2":
            raise InputError(f"amppass.save(model, path): model is an onnx.ModelProto, written as an ONNX model, but "
                             f"path {os.fsdecode(path)!r} names a torch.export program (.pt2); name the file .onnx")
        onnx_files.save(model, path, external_data)
        return
    if suffix == ".onnx":
        raise InputError(f"amppass.save(model, path): model is a {type(model).__name__}, not an onnx.ModelProto, "
                         f"written as a torch.export program, but path {os.fsdecode(path)!r} names an ONNX model "
                         "(.onnx); name the file .pt2, or write an ONNX model with amppass.export_onnx(original_model, "
                         "example_inputs, path, dtype=...)")
    if external_data is not None:
        raise InputError(f"amppass.save(model, path, external_data={external_data!r}): external_data is for ONNX "
                         f"models, and model is a {type(model).__name__}, not an onnx.ModelProto, written as one "
                         ".pt2 file; leave external_data out")
    serialize.save(model, path)


def _suffix(path: Any) -> str:
    """The lower-case suffix of ``path`` ("" for anything that is not a path: the writer names what it is)."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        return ""
    return os.path.splitext(os.fsdecode(path))[1].lower()
