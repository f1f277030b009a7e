"""benchmarks/fp8_train.py: its Conv1D-to-Linear copy computes what GPT-2 computes, and its quick run stays small."""

import torch

from benchmarks import fp8_train
from models.char_gpt import char_gpt


def test_the_linearized_gpt_computes_the_same_logits_with_no_conv1d_left():
    model = char_gpt(1, 32, 2, 32, dropout=0.0).eval()
    linear = fp8_train.linearized(model).eval()
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, linear(ids).logits, atol=1e-5)
    assert not any(type(m).__name__ == "Conv1D" for m in linear.modules())
    assert any(type(m).__name__ == "Conv1D" for m in model.modules())  # the model itself is not changed


def test_the_quick_run_is_a_one_layer_gpt_of_a_few_steps():
    quick, full = fp8_train.QUICK, fp8_train.FULL
    assert quick.layers == 1 and quick.steps <= 3 and quick.width * quick.block <= 32 * 32
    assert full.steps >= 30 * quick.steps  # the full run trains long enough for the losses to separate from noise
