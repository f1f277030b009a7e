"""The compile backend hands inductor views it can trace again: GPT-NeoX-Japanese's rotary embedding cats permuted
slices, and inductor's own trace of the converted graph gave the cat other strides than the trace that recorded
the following ``view`` ("Cannot view a tensor with shape [s52, 4, s27, 8] and strides (32*s27, 8, 32, 1)"), so
``torch.compile(backend="amppass")`` failed where plain inductor compiles. Views reach inductor as reshapes,
which are those views wherever one exists.
"""

from __future__ import annotations

import pytest
import torch

from amppass.analysis.calibration import relative_error

transformers = pytest.importorskip("transformers")


def test_gpt_neox_japanese_compiles_with_the_plan_at_two_shapes():
    config = transformers.GPTNeoXJapaneseConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=4, intermediate_multiple_size=2,
                                                max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.GPTNeoXJapaneseForCausalLM(config).eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="amppass", options={"dtype": "bf16", "plan_for": "coverage"})
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for batch, length in ((1, 8), (2, 12)):
            ids = torch.randint(3, 128, (batch, length), generator=generator)
            want = model(input_ids=ids, use_cache=False).logits
            with torch.autocast("cpu", dtype=torch.bfloat16):
                autocast = model(input_ids=ids, use_cache=False).logits.float()
            got = compiled(input_ids=ids, use_cache=False).logits.float()
            assert relative_error(got, want) <= max(2 ** -5, 4 * relative_error(autocast, want))
