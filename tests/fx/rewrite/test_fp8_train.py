"""amppass::fp8_train_linear and Fp8Linear: forward and gradients against float64, scales, delayed scaling's state.

Tolerances come from the formats themselves: rounding to e4m3 (3 significand bits) moves a value by at most 2^-4 of
itself, to e5m2 (2 bits) by at most 2^-3, to bf16 (8 bits) by at most 2^-8. A product of two rounded operands is
off by at most the sum of their steps, in norm, for operands without cancellation (random normal values).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amppass.dtypes import E4M3, E5M2
from amppass.errors import InputError
from amppass.fx.rewrite.fp8_train import HISTORY, Fp8Linear, fp8_train_linear, swap_linears

E4M3_STEP, E5M2_STEP, BF16_STEP = 2.0 ** -4, 2.0 ** -3, 2.0 ** -8


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.detach().double() - ref.detach().double()).norm() / ref.detach().double().norm())


def _qdq(t: torch.Tensor, fmt) -> torch.Tensor:
    """``t`` stored in ``fmt`` with its per-tensor scale and read back, in float64."""
    scale = fmt.scale_for(float(t.detach().abs().amax()))
    return (t.float() / scale).clamp(-fmt.max, fmt.max).to(fmt.torch).double() * scale


def _leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


def test_forward_and_gradients_are_within_the_formats_steps_of_float64():
    torch.manual_seed(0)
    x, w, b = _leaves(torch.randn(3, 10, 64).bfloat16(), torch.randn(48, 64), torch.randn(48))
    y = fp8_train_linear(x, w, b, None, None)
    grad = torch.randn(3, 10, 48)
    y.backward(grad.bfloat16())
    x64, w64, b64 = _leaves(x.double(), w.double(), b.double())
    y64 = F.linear(x64, w64, b64)
    y64.backward(grad.bfloat16().double())
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert _rel(y, y64) <= 2 * E4M3_STEP + BF16_STEP
    assert _rel(x.grad, x64.grad) <= E5M2_STEP + E4M3_STEP + BF16_STEP
    assert _rel(w.grad, w64.grad) <= E5M2_STEP + E4M3_STEP
    assert _rel(b.grad, b64.grad) <= 1e-6  # summed in fp32 from the unquantized gradient


def test_gradients_are_the_products_of_e5m2_and_e4m3_operands():
    """Not only close to float64: the backward multiplies the e5m2 gradient by the e4m3 weight and input (30 tokens:
    the inner size of dW's product is padded to 32, which adds nothing)."""
    torch.manual_seed(1)
    x, w = _leaves(torch.randn(30, 32).bfloat16(), torch.randn(16, 32))
    y = fp8_train_linear(x, w, None, None, None)
    grad = torch.randn(30, 16).bfloat16()
    y.backward(grad)
    g8, x8, w8 = _qdq(grad, E5M2), _qdq(x, E4M3), _qdq(w, E4M3)
    assert _rel(y, x8 @ w8.t()) <= BF16_STEP
    assert _rel(x.grad, g8 @ w8) <= BF16_STEP
    assert _rel(w.grad, g8.t() @ x8) <= 1e-6


def test_zero_and_constant_tensors_give_finite_values_and_gradients():
    for fill in (0.0, 3.0):
        x, w, b = _leaves(torch.full((4, 32), fill).bfloat16(), torch.full((16, 32), fill), torch.zeros(16))
        y = fp8_train_linear(x, w, b, None, None)
        y.backward(torch.zeros_like(y) if fill == 0 else torch.ones_like(y))
        for t in (y, x.grad, w.grad, b.grad):
            assert torch.isfinite(t).all()
        if fill:
            assert torch.allclose(y.float(), torch.full_like(y.float(), 9.0 * 32))
    for amax in (0.0, -1.0, float("inf"), float("nan")):
        assert float(E5M2.scales_for(torch.tensor(amax))) == 1.0
    for amax in (1e-30, 0.5, 448.0, 3e38):
        assert float(E4M3.scales_for(torch.tensor(amax))) == pytest.approx(E4M3.scale_for(amax), rel=1e-6)


def test_the_op_runs_under_torch_compile_with_its_backward():
    torch.manual_seed(2)
    x, w, b = _leaves(torch.randn(8, 32).bfloat16(), torch.randn(16, 32), torch.randn(16))
    eager = _leaves(x, w, b)
    compiled = torch.compile(lambda *a: fp8_train_linear(*a, None, None), backend="aot_eager", fullgraph=True)
    compiled(x, w, b).float().square().sum().backward()
    fp8_train_linear(*eager, None, None).float().square().sum().backward()
    for got, want in zip((x, w, b), eager, strict=True):
        assert torch.equal(got.grad, want.grad)


def test_delayed_scaling_keeps_an_amax_history_that_checkpoints_carry():
    torch.manual_seed(3)
    layer = Fp8Linear(nn.Linear(32, 16), recipe="delayed")
    dynamic = Fp8Linear(layer, recipe="dynamic")  # the same parameters
    x = torch.randn(8, 32)
    first = layer(x)
    assert torch.equal(first, dynamic(x))  # an empty history: the call's own range
    first.sum().backward()
    assert layer.amax_history.shape == (2, HISTORY)
    assert float(layer.amax_history[0, 0]) == float(x.abs().amax())
    assert float(layer.amax_history[1, 0]) == 1.0  # the gradient of a sum
    big = 4 * x
    clamped = layer(big)  # scaled by the history's range: values beyond it are clamped to e4m3's largest
    assert not torch.equal(clamped, dynamic(big)) and torch.isfinite(clamped).all()
    assert float(layer.amax_history[0, 0]) == float(big.abs().amax())
    restored = Fp8Linear(nn.Linear(32, 16), recipe="delayed")
    restored.load_state_dict(layer.state_dict())
    assert torch.equal(restored.amax_history, layer.amax_history)
    layer.eval()
    restored.eval()
    assert torch.equal(layer(x), restored(x))


def test_swap_linears_copies_the_model_and_refuses_an_unknown_recipe():
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 16))
    swapped = swap_linears(model, "delayed")
    assert [type(m).__name__ for m in swapped] == ["Fp8Linear", "ReLU", "Fp8Linear"]
    assert all(type(m) is not Fp8Linear for m in model)  # the caller's model is not changed
    with pytest.raises(InputError, match=r"recipe='tensorwise'.*'dynamic'.*'delayed'"):
        Fp8Linear(nn.Linear(32, 16), recipe="tensorwise")
