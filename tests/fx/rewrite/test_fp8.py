"""amppass::fp8_linear and the fp8 lowering: numerics against fp32, scales, graph structure.

Tolerances come from e4m3 and bf16 themselves: rounding to e4m3 (3 significand bits) moves a value by at most 2^-4 of
itself, and the output's one rounding to bf16 (8 significand bits) by at most 2^-8.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import fx, nn

from amppass.dtypes import E4M3
from amppass.fx.rewrite.fp8 import (
    ROW,
    Fp8Product,
    dequantize,
    fp8_linear,
    fp8_linear_rowwise,
    linear_weights,
    lower,
    quantize,
    row_scales,
)

E4M3_STEP = 2.0 ** -4  # largest relative rounding error of one e4m3 value
BF16_STEP = 2.0 ** -8  # of one bf16 value


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def test_fp8_linear_computes_the_quantize_dequantize_product():
    """The op is numerically dequantize(quantize(x)) @ dequantize(quantize(w)).T + b in fp32, rounded once to bf16:
    what the GPU kernel computes (e4m3 products summed in fp32, scaled, rounded to the output dtype)."""
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 5, 32).bfloat16(), torch.randn(48, 32), torch.randn(48)
    sx, sw = E4M3.scale_for(float(x.abs().amax())), E4M3.scale_for(float(w.abs().amax()))
    out = fp8_linear(x, quantize(w, sw), torch.tensor(sw), torch.tensor(sx), b.bfloat16())
    assert out.shape == (2, 5, 48) and out.dtype == torch.bfloat16
    ref = F.linear(dequantize(quantize(x, sx), sx), dequantize(quantize(w, sw), sw), b.bfloat16().float())
    # one bf16 rounding of the output, plus the bias's own bf16 rounding
    assert torch.allclose(out.float(), ref, rtol=2 * BF16_STEP, atol=2 * BF16_STEP * float(ref.abs().max()))


def test_fp8_linear_is_within_e4m3_rounding_of_fp32():
    torch.manual_seed(1)
    x, w = torch.randn(64, 128), torch.randn(96, 128)
    sw = E4M3.scale_for(float(w.abs().amax()))
    out = fp8_linear(x.bfloat16(), quantize(w, sw), torch.tensor(sw), None, None)  # dynamic input scale
    error = _rel(out, F.linear(x, w))
    # both operands rounded to e4m3: each product moves by at most about 2 * 2^-4 of itself
    assert 0 < error <= 2 * E4M3_STEP
    assert error > BF16_STEP  # e4m3 did run: bf16 alone moves it far less


def test_scales_are_finite_for_zero_and_constant_tensors():
    zeros, constant = torch.zeros(4, 16), torch.full((4, 16), 3.0)
    w = torch.randn(16, 16)
    sw = E4M3.scale_for(float(w.abs().amax()))
    for x in (zeros, constant):
        for scale in (None, torch.tensor(E4M3.scale_for(float(x.abs().amax())))):
            out = fp8_linear(x.bfloat16(), quantize(w, sw), torch.tensor(sw), scale, None)
            assert torch.isfinite(out).all()
    assert fp8_linear(zeros.bfloat16(), quantize(w, sw), torch.tensor(sw), None, None).abs().max() == 0
    zero_weight = torch.zeros(16, 16)
    sz = E4M3.scale_for(0.0)
    assert sz == 1.0 and torch.isfinite(quantize(zero_weight, sz).float()).all()
    # a constant input is stored exactly at e4m3's largest finite value: no NaN from out-of-range conversion
    sc = E4M3.scale_for(3.0)
    assert float(dequantize(quantize(constant, sc), sc).max()) == 3.0


def test_quantize_clamps_beyond_the_range_instead_of_making_nan():
    q = quantize(torch.tensor([1e6, -1e6, 1.0]), 1.0)
    assert q.float().tolist() == [E4M3.max, -E4M3.max, 1.0]


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 48), nn.Linear(48, 16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_lower_rewrites_chosen_linears_and_drops_their_weights():
    torch.manual_seed(2)
    model = _Two().eval()
    gm = torch.export.export(model, (torch.randn(4, 32),)).module()
    weights = linear_weights(gm)
    assert sorted(weights) == ["linear", "linear_1"]
    chosen = {"linear": Fp8Product("linear", weights["linear"], 3.0)}
    lower(gm, chosen)
    targets = {n.name: n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert targets["linear"] is torch.ops.amppass.fp8_linear.default
    assert targets["linear_1"] is torch.ops.aten.linear.default  # not chosen: unchanged
    attrs = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    assert "_fp8_linear_weight" in attrs and "_fp8_linear_input_scale" in attrs
    assert gm._fp8_linear_weight.dtype == torch.float8_e4m3fn
    assert math.isclose(float(gm._fp8_linear_input_scale), E4M3.scale_for(3.0), rel_tol=1e-6)
    x = torch.randn(4, 32)
    with torch.no_grad():
        assert _rel(gm(x), model(x)) <= 2 * E4M3_STEP
    assert isinstance(gm.graph, fx.Graph)
    gm.graph.lint()


def _e4m3_bound(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """How far rounding to e4m3 with ``scale`` can move each value: 2^-4 of itself where it is normal, half the
    smallest subnormal step (2^-10 of the scale) below; clamping does not arise (the scale maps the range to 448)."""
    return E4M3_STEP * v.abs() + 2.0 ** -10 * scale


def test_rowwise_linear_is_within_e4m3_rounding_of_a_float64_reference():
    """Rows of the input and channels of the weight spread over 8 decades: each row and channel keeps e4m3's relative
    precision with its own scale, elementwise within the bound derived from e4m3's and bf16's steps; one per-tensor
    scale instead loses the small rows to zero."""
    torch.manual_seed(3)
    x = torch.randn(16, 64) * torch.logspace(-4, 4, 16).reshape(-1, 1)
    w = torch.randn(32, 64) * torch.logspace(-4, 4, 32).reshape(-1, 1)
    b = torch.randn(32)
    w_scales = row_scales(w)
    x_low = x.bfloat16()
    out = fp8_linear_rowwise(x_low, quantize(w, w_scales), w_scales, b.bfloat16()).double()
    xs, ws = x_low.double(), w.double()
    ref = F.linear(xs, ws, b.bfloat16().double())
    ex, ew = _e4m3_bound(xs, row_scales(x_low).double()), _e4m3_bound(ws, w_scales.double())
    products = ex @ ws.abs().t() + xs.abs() @ ew.t() + ex @ ew.t()  # |x'w' - xw| <= ex|w| + |x|ew + ex ew, summed
    bound = products + BF16_STEP * (ref.abs() + products)  # and the output's one rounding to bf16
    assert ((out - ref).abs() <= bound).all()
    assert ((out - ref).abs() > 0).any()  # e4m3 did run
    small = F.linear(xs[:2], ws)  # the two smallest rows, scaled out of the per-tensor range
    sx, sw = E4M3.scale_for(float(x.abs().amax())), E4M3.scale_for(float(w.abs().amax()))
    per_tensor = fp8_linear(x_low[:2], quantize(w, sw), torch.tensor(sw), torch.tensor(sx), None).double()
    assert _rel(per_tensor, small) > 0.5 and _rel(out[:2] - b.bfloat16().double(), small) <= 2 * E4M3_STEP


def test_rowwise_scales_keep_zero_constant_and_extreme_rows_finite():
    """Scales computed per row on every call: an all-zero row (scale 1.0), a constant row (stored exactly at 448), a
    row near bf16's largest value and one of subnormal values all give finite outputs."""
    big = float(torch.finfo(torch.bfloat16).max) / 2
    x = torch.stack([torch.zeros(32), torch.full((32,), 3.0), torch.full((32,), big),
                     torch.full((32,), 1e-39), torch.randn(32)]).bfloat16()
    w = torch.randn(16, 32)
    w_scales = row_scales(w)
    out = fp8_linear_rowwise(x, quantize(w, w_scales), w_scales, None)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out[[0, 1, 3, 4]]).all()
    assert out[0].abs().max() == 0
    ref = F.linear(x[1:2].float(), dequantize(quantize(w, w_scales), w_scales))  # the constant row is read exactly
    assert torch.allclose(out[1:2].float(), ref, rtol=2 * BF16_STEP, atol=0)
    scales = row_scales(x)
    assert torch.isfinite(scales).all() and (scales > 0).all() and float(scales[0]) == 1.0
    assert not torch.isnan(out).any()  # the near-max row's sum may overflow bf16 to inf, never NaN


def test_lower_with_rowwise_granularity_stores_channel_scales_and_no_input_scale():
    torch.manual_seed(4)
    model = _Two().eval()
    gm = torch.export.export(model, (torch.randn(4, 32),)).module()
    weights = linear_weights(gm)
    lower(gm, {"linear": Fp8Product("linear", weights["linear"], 3.0, ROW)})
    targets = {n.name: n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert targets["linear"] is torch.ops.amppass.fp8_linear_rowwise.default
    assert gm._fp8_linear_weight_scale.shape == (48, 1) and not hasattr(gm, "_fp8_linear_input_scale")
    x = torch.randn(4, 32)
    with torch.no_grad():
        assert _rel(gm(x), model(x)) <= 2 * E4M3_STEP
    gm.graph.lint()
