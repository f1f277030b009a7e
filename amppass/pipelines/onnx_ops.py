"""ONNX translations for ops torch's ONNX exporter has none for, passed to it as ``custom_translation_table``.

A mixture of experts multiplies each expert's rows by that expert's weights in one grouped matrix multiply:
``aten._grouped_mm`` and transformers' own ``transformers.grouped_mm_fallback`` (Mixtral, DeepSeek-V3, Qwen-MoE
and the other MoE decoders of transformers 5). Torch's exporter translates neither, so :func:`export_onnx`
failed on every such model.

Rules:

1. ``out[r] = input[r] @ weight[e]`` for the rows ``r`` of expert ``e``: the rows are sorted by expert and
   ``offs[e]`` is where expert ``e``'s rows end. The number of experts is the weight's first dimension, known
   when the graph is translated, so each expert is one ``Slice`` of the rows, one ``Gather`` of its weight and
   one ``MatMul``, and a ``Concat`` joins them in order: no ``(rows, in, out)`` tensor of gathered weights.
2. Only the forms a model's forward uses are translated: a 2-D input, 3-D weights and ``offs``; another form of
   ``aten._grouped_mm`` (no ``offs``, a bias, an ``out_dtype``) raises at translation, and the exporter says so.
"""

from __future__ import annotations

from typing import Any

import torch


def translations() -> dict[Any, Any]:
    """The table for ``torch.onnx.export(..., custom_translation_table=...)``: each op this module translates
    that this process has (transformers registers its op when its MoE code is imported); empty without
    onnxscript."""
    try:
        import onnxscript  # noqa: F401 - the dynamo exporter's own dependency
    except ImportError:
        return {}
    table: dict[Any, Any] = {torch.ops.aten._grouped_mm.default: _aten_grouped_mm}
    if hasattr(torch.ops, "transformers") and hasattr(torch.ops.transformers, "grouped_mm_fallback"):
        table[torch.ops.transformers.grouped_mm_fallback.default] = _grouped_mm
    return table


def _grouped_mm(input: Any, weight: Any, offs: Any) -> Any:
    """Rule 1."""
    from onnxscript import INT64
    from onnxscript.onnx_opset import opset18 as op

    experts = weight.shape[0]
    if not isinstance(experts, int):
        raise ValueError("grouped matrix multiply: the number of experts (the weight's first dimension) must be "
                         "known when the graph is translated")
    ends = op.Cast(offs, to=INT64.dtype)
    rows_axis = op.Constant(value_ints=[0])
    start = op.Constant(value_ints=[0])
    products = []
    for expert in range(experts):
        end = op.Slice(ends, op.Constant(value_ints=[expert]), op.Constant(value_ints=[expert + 1]), rows_axis)
        rows = op.Slice(input, start, end, rows_axis)
        products.append(op.MatMul(rows, op.Gather(weight, op.Constant(value_int=expert), axis=0)))
        start = end
    return op.Concat(*products, axis=0)


def _aten_grouped_mm(mat_a: Any, mat_b: Any, offs: Any = None, bias: Any = None, out_dtype: Any = None) -> Any:
    """Rule 2: the MoE form of ``aten._grouped_mm`` through rule 1."""
    if offs is None or bias is not None or out_dtype is not None or len(mat_a.shape) != 2:
        raise ValueError("aten._grouped_mm: only a 2-D input grouped by offs, without bias or out_dtype, is "
                         "translated to ONNX")
    return _grouped_mm(mat_a, mat_b, offs)
