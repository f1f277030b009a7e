"""amppass::fp8_linear and the fp8 lowering: numerics against fp32, scales, graph structure.

Tolerances come from e4m3 and bf16 themselves: rounding to e4m3 (3 significand bits) moves a value by at most 2^-4 of
itself, and the output's one rounding to bf16 (8 significand bits) by at most 2^-8.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from amppass.dtypes import E4M3
from amppass.fx.rewrite.fp8 import (
    ROW,
    TWO_ACTIVATIONS,
    Fp8Product,
    dequantize,
    fp8_linear,
    fp8_linear_rowwise,
    linear_weights,
    lower,
    not_lowered,
    operands,
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


class _Forms(nn.Module):
    """One product with a stored 2-D weight, written as ``form``: ``io`` is stored in x out, ``oi`` out x in."""

    FORMS = {
        "x @ io": lambda m, x: x @ m.io,
        "matmul(x, oi.t())": lambda m, x: torch.matmul(x, m.oi.t()),
        "x @ oi.T": lambda m, x: x @ m.oi.T,
        "x @ oi.mT": lambda m, x: x @ m.oi.mT,
        "x @ oi.transpose(0, 1)": lambda m, x: x @ m.oi.transpose(0, 1),
        "x @ oi.permute(1, 0)": lambda m, x: x @ m.oi.permute(1, 0),
        "einsum ...i,oi->...o": lambda m, x: torch.einsum("...i,oi->...o", x, m.oi),
        "einsum bsi,io->bso": lambda m, x: torch.einsum("bsi,io->bso", x, m.io),
        "einsum oi,bsi->bso": lambda m, x: torch.einsum("oi,bsi->bso", m.oi, x),
        "einsum implicit ...i,io": lambda m, x: torch.einsum("...i,io", x, m.io),
        "bmm(x, io.expand)": lambda m, x: torch.bmm(x, m.io.expand(x.shape[0], -1, -1)),
        "bmm(x, io.unsqueeze(0).expand)": lambda m, x: torch.bmm(x, m.io.unsqueeze(0).expand(x.shape[0], 32, 48)),
        "mm(x, oi.t())": lambda m, x: torch.mm(x.reshape(-1, 32), m.oi.t()).reshape(*x.shape[:-1], 48),
    }

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.io = nn.Parameter(torch.randn(32, 48))
        self.oi = nn.Parameter(torch.randn(48, 32))

    def forward(self, x):
        return self.FORMS[self.form](self, x)


@pytest.mark.parametrize("form", list(_Forms.FORMS))
def test_a_product_with_a_stored_weight_in_any_form_is_lowered_within_e4m3_rounding_of_float64(form):
    """matmul/bmm/einsum (and mm) with a stored 2-D weight, read in x out or out x in through a transpose: the weight
    comes out x in as a linear layer stores it, the product becomes ``amppass::fp8_linear``, the weight and the views
    that read it leave the graph, and every output element is within the bound e4m3's rounding of both operands
    gives against a float64 reference."""
    torch.manual_seed(5)
    model = _Forms(form).eval()
    gm = torch.export.export(model, (torch.randn(3, 8, 32),)).module()
    weights = linear_weights(gm)
    (name,) = weights
    expected = model.io.t() if "io" in form else model.oi
    assert torch.equal(weights[name], expected.detach())  # out x in
    lower(gm, {name: Fp8Product(name, weights[name], None)})  # dynamic input scale
    gm.graph.lint()
    ops = {n.target for n in gm.graph.nodes if n.op == "call_function"} - {torch.ops.aten.reshape.default}
    assert ops == {torch.ops.amppass.fp8_linear.default}  # no transpose, broadcast or einsum left
    read = "io" if "io" in form else "oi"
    assert not any(n.op == "get_attr" and n.target == read for n in gm.graph.nodes) and not hasattr(gm, read)
    x = torch.randn(3, 8, 32)
    with torch.no_grad():
        out = gm(x).double()
    w = expected.detach().double()
    ref = x.double() @ w.t()
    ex = _e4m3_bound(x.double(), torch.tensor(E4M3.scale_for(float(x.abs().amax())), dtype=torch.float64))
    ew = _e4m3_bound(w, torch.tensor(E4M3.scale_for(float(w.abs().amax())), dtype=torch.float64))
    bound = ex @ w.abs().t() + x.double().abs() @ ew.t() + ex @ ew.t()
    assert ((out - ref).abs() <= bound * (1 + 1e-6)).all()
    assert ((out - ref).abs() > 0).any()  # e4m3 did run


class _NotLowered(nn.Module):
    """Products with a stored operand that are not a linear layer's, one per ``form``."""

    FORMS = {
        "weight first": (lambda m, x: m.oi @ x.transpose(-1, -2), "is the first (weight @ activation)"),
        "3-D weight": (lambda m, x: torch.bmm(x, m.batched), "is 3-D (a matrix per batch), not one 2-D weight"),
        "broadcast batch": (lambda m, x: torch.matmul(x[0], m.io.expand(3, 32, 48)),
                            "broadcasts the activation's batch dimensions"),
        "output permuted": (lambda m, x: torch.einsum("bsi,oi->bos", x, m.oi),
                            "its output 'bos' is not the activation's other indices in order followed by the "
                            "weight's 'o' ('bso')"),
        "implicit output permuted": (lambda m, x: torch.einsum("bsi,io", x, m.io), "its output 'bos'"),
        "diagonal weight": (lambda m, x: torch.einsum("bsi,si->b", x, m.si),
                            "the activation's last index 'i' must be the only one it shares with the weight 'si'"),
        "contracts a batch index": (lambda m, x: torch.einsum("bsi,bo->sio", x, m.bo),
                                    "the only one it shares with the weight 'bo'"),
        "three operands": (lambda m, x: torch.einsum("bsi,io,o->bs", x, m.io, m.o), "'bsi,io,o->bs' has 3 operands"),
        "two stored": (lambda m, x: x + torch.einsum("ij,jk->ik", m.io, m.oi)[:8], "multiplies two stored tensors"),
        "two activations": (lambda m, x: torch.einsum("bsi,bti->bst", x, x), "a product of two activations"),
    }

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.io, self.oi = nn.Parameter(torch.randn(32, 48)), nn.Parameter(torch.randn(48, 32))
        self.batched, self.si = nn.Parameter(torch.randn(3, 32, 48)), nn.Parameter(torch.randn(8, 32))
        self.bo, self.o = nn.Parameter(torch.randn(3, 16)), nn.Parameter(torch.randn(48))

    def forward(self, x):
        return self.FORMS[self.form][0](self, x)


@pytest.mark.parametrize("form", list(_NotLowered.FORMS))
def test_a_product_that_is_not_a_linear_layers_says_exactly_why(form):
    torch.manual_seed(6)
    gm = torch.export.export(_NotLowered(form).eval(), (torch.randn(3, 8, 32),)).module()
    products = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (
        torch.ops.aten.matmul.default, torch.ops.aten.bmm.default, torch.ops.aten.einsum.default)]
    assert products and linear_weights(gm) == {}
    assert all(operands(n) is None or operands(n)[1] is None for n in products)
    why = not_lowered(products[-1])
    assert _NotLowered.FORMS[form][1] in why
    assert why.startswith(TWO_ACTIVATIONS if form == "two activations" else "not a linear layer's product: ")
