"""export_onnx of transformers' mixture-of-experts decoders: the grouped matrix multiply of their experts
(``transformers.grouped_mm_fallback``) has an ONNX translation of amppass's (:mod:`amppass.pipelines.onnx_ops`),
and a decoder that returns its cache by default exports (transformers' cache types are registered for the
exporter as for torch.export)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
import torch

import amppass

transformers = pytest.importorskip("transformers")


def _tiny_deepseek():
    from tests.helpers.decoders import deepseek_v3

    return deepseek_v3(hidden=32, layers=2, experts=4, groups=1)


def test_a_moe_decoder_exports_with_its_grouped_matrix_multiplies(tmp_path):
    model = _tiny_deepseek()
    ids = torch.randint(3, 127, (1, 8), generator=torch.Generator().manual_seed(1))
    path = tmp_path / "moe.onnx"
    amppass.export_onnx(model, (ids,), str(path), dtype="fp16")  # use_cache defaults on: a cache comes back
    onnx.checker.check_model(str(path), full_check=True)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    logits = torch.from_numpy(session.run(None, {"input_ids": ids.numpy()})[0]).float()
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        with torch.autocast("cpu", dtype=torch.float16):
            autocast = model(ids, use_cache=False).logits.float()
    error = float((logits - want).norm() / want.norm())
    assert error <= max(2.0**-8, 4 * float((autocast - want).norm() / want.norm())), error
    matmuls = [n for n in onnx.load(str(path)).graph.node if n.op_type == "MatMul"]
    assert len(matmuls) >= 2 * 4  # the MoE layer's up and down products, one per expert


def test_the_grouped_multiply_translation_computes_each_expert_s_rows():
    """Rows sorted by expert, an expert with no rows among them: ONNX's result is torch's."""
    from transformers.integrations import moe  # noqa: F401 - registers torch.ops.transformers

    class Grouped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0)))

        def forward(self, rows, offs):
            return torch.ops.transformers.grouped_mm_fallback(rows, self.weight, offs)

    from amppass.pipelines.onnx_ops import translations

    module, rows, offs = Grouped().eval(), torch.randn(6, 4), torch.tensor([2, 2, 6], dtype=torch.int32)
    program = torch.onnx.export(module, (rows, offs), dynamo=True, verbose=False,
                                custom_translation_table=translations())
    session = onnxruntime.InferenceSession(program.model_proto.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    got = session.run(None, dict(zip(names, (rows.numpy(), offs.numpy()), strict=False)))[0]
    with torch.no_grad():
        np.testing.assert_allclose(got, module(rows, offs).numpy(), rtol=1e-5, atol=1e-5)
