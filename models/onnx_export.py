"""ONNX exports of zoo models, as a user's exporter would write them (TorchScript exporter, opset 17)."""

from __future__ import annotations

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
        torch.onnx.export(model, inputs, buffer, dynamo=False, opset_version=17, input_names=input_names,
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
