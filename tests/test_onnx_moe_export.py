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
    config = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(config).eval()


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
    got = session.run(None, dict(zip(names, (rows.numpy(), offs.numpy()))))[0]
    with torch.no_grad():
        np.testing.assert_allclose(got, module(rows, offs).numpy(), rtol=1e-5, atol=1e-5)
