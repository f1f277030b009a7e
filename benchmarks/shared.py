"""ONNX exports that several sections measure, made once per process.

``python -m benchmarks run`` runs every section in one process. Where sections convert the ONNX export of the
same zoo model (the small BERT of every ONNX section of ``--quick``), the dynamo exporter runs once, seconds even
for a small model, and each caller gets its own copy of the export to change.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import onnx

from models import ModelCase, build


def exported(name: str, size: str = "small", batch: int = 1, seq: int = 16) -> tuple[onnx.ModelProto, ModelCase]:
    """The fp32 ONNX export of zoo model ``name`` (:func:`amppass.pipelines.export_onnx.export_fp32` of its example
    inputs) and the zoo case it exports: a copy of this process's one export of it."""
    model, case = _exported(name, size, batch, seq)
    copied = onnx.ModelProto()
    copied.CopyFrom(model)
    return copied, case


@functools.cache
def _exported(name: str, size: str, batch: int, seq: int) -> tuple[onnx.ModelProto, ModelCase]:
    from amppass.pipelines.export_onnx import export_fp32

    case = build(name, size=size, batch=batch, seq=seq)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return export_fp32(case.model, case.example_inputs), case


def feed(model: onnx.ModelProto, inputs: tuple) -> dict[str, np.ndarray]:
    """``inputs`` (tensors, in the order of the graph's inputs) as a feed of ``model``."""
    return {i.name: t.numpy() for i, t in zip(model.graph.input, inputs, strict=False)}
