"""``amppass.report``: the report of any converted artifact."""

from __future__ import annotations

import os
from typing import Any

from torch import fx

from ..errors import InputError
from ..reporting.fx_reader import read_graph_module
from ..reporting.report import Report
from ..serving.artifact import record_of


def report(converted: Any) -> Report:
    """Rebuild the per-node precision report from a model amppass converted.

    Accepts the ``torch.fx.GraphModule`` that :func:`amppass.convert` returned, the module it returned for
    ``mode="train"`` (its train graph is reported; rows say which ops' gradients run in low precision), the
    original module it kept in fp32 where that measured faster (:mod:`amppass.serving.fp32_original`), the model it
    returned in its own class (:mod:`amppass.serving.dropin`: its converted graphs), a module
    :func:`amppass.load` returned, a module or function ``torch.compile(..., backend="amppass")`` returned
    (every graph dynamo captured, rows named ``g<i>.<node>``), a model converted by parts (every converted
    part, rows named ``<path>.<node>``; :mod:`amppass.pipelines.parts`), or an ``onnx.ModelProto`` (or .onnx
    path) that :func:`amppass.convert_onnx` returned.
    """
    if _compiled(converted):
        from .backend import compiled_with_amppass, session_of

        session = session_of(converted)
        if session is None and compiled_with_amppass(converted):
            raise InputError(f"{type(converted).__name__} was compiled with torch.compile(backend='amppass') but "
                             "has not been called yet: dynamo captures and converts its graphs on the first call; "
                             "call it once on an input, then ask for the report")
        if session is None:
            raise InputError(f"{type(converted).__name__} was not compiled with torch.compile(backend='amppass'); "
                             "compile it with that backend, call it once, then ask for the report")
        return session.report()
    found = record_of(converted)
    if found is not None:
        return found.report()  # each kind reads its own (serving.artifact)
    if isinstance(converted, fx.GraphModule):
        return read_graph_module(converted)  # says it carries no amppass decisions
    if isinstance(converted, (str, os.PathLike)) or type(converted).__name__ == "ModelProto":
        from ..reporting.onnx_reader import read_onnx  # onnx is imported only when an ONNX model is reported

        return read_onnx(converted)
    raise InputError(
        f"amppass.report cannot read a {type(converted).__name__}; pass a GraphModule from amppass.convert, "
        "or an ONNX model (or .onnx path) from amppass.convert_onnx"
    )


def _compiled(value: Any) -> bool:
    """Whether ``value`` is what ``torch.compile`` returned (a module wrapper or a function)."""
    return hasattr(value, "dynamo_ctx") or hasattr(value, "_torchdynamo_orig_callable")
