"""The low-precision dtype facts: parsing user spellings and the fp8 formats' per-tensor scales."""

import math

import pytest
import torch

from amppass.dtypes import BF16, E4M3, E5M2, FP16, low_type
from amppass.errors import InputError


@pytest.mark.parametrize("spelling, expected", [("fp16", FP16), ("Half", FP16), (torch.bfloat16, BF16),
                                                ("bfloat16", BF16)])
def test_user_spellings_name_one_low_type(spelling, expected):
    assert low_type(spelling) is expected


def test_auto_is_fp16_on_cuda_and_bf16_elsewhere():
    assert low_type("auto", "cuda") is FP16
    assert low_type("auto", "cpu") is BF16


def test_an_unknown_dtype_is_refused_with_the_spellings_that_work():
    with pytest.raises(InputError, match="'fp16', 'bf16'"):
        low_type("int8")


@pytest.mark.parametrize("fmt, top", [(E4M3, 448.0), (E5M2, 57344.0)])
def test_a_scale_maps_the_largest_magnitude_onto_the_format_max(fmt, top):
    x = torch.randn(64, 64) * 1000.0
    amax = float(x.abs().max())
    scale = fmt.scale_for(amax)
    stored = (x / scale).to(fmt.torch)
    assert fmt.max == top
    assert math.isclose(float(stored.float().abs().max()), top, rel_tol=1e-6)
    back = stored.float() * scale
    assert torch.isfinite(back).all()
    # the relative error of a round trip is bounded by the format's precision (3 or 2 mantissa bits)
    big = x.abs() > amax / 8
    rel = ((back - x).abs() / x.abs())[big].max()
    assert rel <= (2.0 ** -4 if fmt is E4M3 else 2.0 ** -3) + 1e-6


def test_a_margin_leaves_powers_of_two_of_headroom():
    assert math.isclose(E4M3.scale_for(448.0, margin=2), 4.0)


@pytest.mark.parametrize("amax", [0.0, -1.0, float("nan"), float("inf"), 1e-45])
def test_a_scale_is_finite_and_positive_for_any_range(amax):
    for fmt in (E4M3, E5M2):
        scale = fmt.scale_for(amax)
        assert math.isfinite(scale) and scale > 0.0
        zeros = torch.zeros(4)
        assert torch.equal((zeros / scale).to(fmt.torch).float() * scale, zeros)


@pytest.mark.parametrize("spelling", ["fp8", "FP8", "e4m3", torch.float8_e4m3fn])
def test_fp8_spellings_name_e4m3_and_other_dtypes_are_not_fp8(spelling):
    from amppass.dtypes import fp8_format

    assert fp8_format(spelling) is E4M3
    assert fp8_format("bf16") is None and fp8_format(torch.float16) is None and fp8_format([1]) is None


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_scales_for_gives_each_range_the_scale_scale_for_gives_it(fmt):
    """Row-wise scales: one per element of a tensor of ranges, by the same rules as the per-tensor scale, so a zero,
    negative, NaN or infinite row range gives 1.0 and none is zero, inf or NaN."""
    ranges = [0.0, -1.0, math.nan, math.inf, 1e-45, 1e-30, 1.0, 448.0, 3e38]
    scales = fmt.scales_for(torch.tensor(ranges).reshape(-1, 1))
    assert scales.shape == (len(ranges), 1) and scales.dtype == torch.float32
    assert torch.isfinite(scales).all() and (scales > 0).all()
    for got, amax in zip(scales.flatten().tolist(), ranges, strict=True):
        assert math.isclose(got, fmt.scale_for(amax), rel_tol=1e-6), amax
