"""ONNX exports of zoo models, as a user's exporter would write them (TorchScript exporter, opset 17)."""

from __future__ import annotations

import copy
import io
import os
import warnings

import onnx
import torch
from torch import nn


def export(model: nn.Module, inputs: tuple, input_names: list[str], output_names: list[str],
           path: str | os.PathLike | None = None) -> onnx.ModelProto:
    """Export ``model`` on ``inputs`` with a dynamic batch axis; also save the model at ``path`` if given.

    The file is written whole or not at all (a temporary name, then a rename).
    """
    buffer = io.BytesIO()
    axes = {name: {0: "batch"} for name in input_names + output_names}
    with warnings.catch_warnings():  # the TorchScript exporter warns that it is deprecated in favour of dynamo
        warnings.simplefilter("ignore")
        torch.onnx.export(_positional(model), inputs, buffer, dynamo=False, opset_version=17, input_names=input_names,
                          output_names=output_names, dynamic_axes=axes)
    proto = onnx.load_from_string(buffer.getvalue())
    if path is not None:
        tmp = f"{os.fspath(path)}.tmp"
        try:
            onnx.save(proto, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return proto


def _positional(model: nn.Module) -> nn.Module:
    """A shallow copy of ``model`` (same submodules and weights) whose ``forward`` takes positional inputs alone.

    The TorchScript exporter passes every parameter of ``forward`` after the given inputs as well, filled with
    its default, positionally; transformers 5 models also set some of them (``use_cache``) as keywords, and
    the call fails with "got multiple values for argument". Seeing ``forward(*inputs)`` the exporter passes
    the inputs as they are. The copy is the traced root, so node and weight names are the model's own.
    """
    proxy = copy.copy(model)
    proxy.forward = lambda *inputs: type(model).forward(proxy, *inputs)
    return proxy
