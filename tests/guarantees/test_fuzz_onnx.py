"""Property: convert_onnx on random ONNX graphs gives a valid model that runs and matches fp32.

The graphs come from :mod:`fuzz_graphs`. Tolerances are on the norm-relative error of each output
(elements where fp32 is finite): fp16 rounds to 2**-11 ~ 4.9e-4 and bf16 to 2**-8 ~ 3.9e-3 relative;
a program of up to ~25 nodes with values of scale 0.05..30 makes a few dozen roundings on the path to an
output, each amplified at most a few times (matmuls over at most 16 terms, clipped exps, LayerNorm),
so 3e-2 (about 60 fp16 ulps) and 6e-2 (about 15 bf16 ulps) are loose enough for accurate conversions and
still catch a value computed in the wrong precision where it matters (an fp16 Exp, a dropped Cast, an
overflowing sum), a wrong axis or a swapped input, which give errors of order 1.

Calibrated conversions (``calibration=`` on 2-3 feeds other than the compared ones, sometimes scaled to
under- or overflow fp16, and sometimes ``tolerance=``) must pass the same checks, record what they did,
report as ``achieved_error`` the error the test measures on the calibration feeds (``tolerance_met``
exactly when it is within the tolerance), and run low only nodes the plain conversion runs low. There is
no property "calibration never makes the error worse by more than a factor k": moving a node to fp32
removes a rounding, and roundings can cancel (x rounded, then x * c rounded again, may land nearer x * c than
one rounding does), so a calibrated error above k times a lucky plain error is not a bug, for any k.
``programs(control_flow=True)`` adds If branches and Loop bodies (outer-scope captures, a loop-carried
float state) to the ONNX graphs.

A program with a float32 MatMul, Gemm or Conv is refused in bf16 (onnxruntime's CPU provider has no bf16 kernel
for them, so nothing heavy would run bf16 and the file would be all fp32); the property then is the refusal, naming
dtype and target.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import amppass
from amppass.pipelines.convert_onnx import missing_low_kernels
from tests.helpers.fuzz_checks import check_onnx, converted_session, onnx_feed
from tests.helpers.fuzz_graphs import (
    CALIBRATION_SCALES,
    CALIBRATION_SEEDS,
    TOLERANCES,
    Program,
    check_calibrated_rows,
    check_calibration_info,
    programs,
    relative_error,
    to_onnx,
)
from tests.helpers.onnx_graphs import session

_COMMON = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
FAST = settings(max_examples=40, **_COMMON)
SLOW = settings(max_examples=400, **_COMMON)
CALIBRATED = settings(max_examples=15, **_COMMON)


def check_calibrated_onnx(program: Program, dtype: str, seeds: list[int], scale: float,
                          tolerance: float | None) -> None:
    """check_onnx with ``calibration=`` on the feeds of ``seeds`` times ``scale`` (the outputs compared on
    held-out feeds) and ``tolerance``; then the metadata, the error on the calibration feeds as the default
    CPU target computes it (the converted model itself in onnxruntime's CPU provider: what the tolerance
    search measures), and the plan against the plain conversion's."""
    calibration = [onnx_feed(program, seed, scale) for seed in seeds]
    converted = check_onnx(program, dtype, calibration=calibration, tolerance=tolerance)
    if converted is None:
        return
    report = amppass.report(converted)
    error = 0.0
    if tolerance is not None:
        ref, low = session(to_onnx(program)), converted_session(converted)
        for feeds in calibration:
            for want, got in zip(ref.run(None, feeds), low.run(None, feeds), strict=False):
                error = max(error, relative_error(got, want) if np.isfinite(got).all() else np.inf)
    check_calibration_info(report.info, len(seeds), tolerance, error)
    plain = amppass.report(amppass.convert_onnx(to_onnx(program), dtype=dtype))
    check_calibrated_rows(report.rows, plain.rows, dtype, report.info)


def draw_options(program: Program, dtype: str, data: st.DataObject) -> dict:
    """Overrides drawn from the plain conversion's report: op types forced low among those it kept fp32,
    op types kept fp32, and ``keep_io_types`` (fp16 only: onnxruntime's Python API returns no bfloat16)."""
    if missing_low_kernels(to_onnx(program), "cpu", dtype) is not None:
        return {}  # refused whatever the options (check_onnx)
    rows = amppass.report(amppass.convert_onnx(to_onnx(program), dtype=dtype)).rows
    fp32_ops = sorted({r.op for r in rows if r.precision == "fp32"})
    float_ops = sorted({r.op for r in rows if r.precision != "-"})
    return {
        "force_low": data.draw(st.lists(st.sampled_from(fp32_ops), unique=True), label="force_low")
        if fp32_ops else [],
        "keep_fp32": data.draw(st.lists(st.sampled_from(float_ops), unique=True, max_size=2), label="keep_fp32")
        if float_ops else [],
        "keep_io_types": dtype == "bf16" or data.draw(st.booleans(), label="keep_io_types"),
    }


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@FAST
@given(program=programs())
def test_converted_onnx_valid_and_close(dtype, program):
    check_onnx(program, dtype)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@FAST
@given(program=programs(), data=st.data())
def test_overridden_onnx_valid_and_close(dtype, program, data):
    check_onnx(program, dtype, **draw_options(program, dtype, data))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@CALIBRATED
@given(program=programs(), seeds=CALIBRATION_SEEDS, scale=CALIBRATION_SCALES,
       tolerance=TOLERANCES)
def test_calibrated_onnx_valid_and_close(dtype, program, seeds, scale, tolerance):
    check_calibrated_onnx(program, dtype, seeds, scale, tolerance)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@FAST
@given(program=programs(control_flow=True))
def test_control_flow_onnx_valid_and_close(dtype, program):
    check_onnx(program, dtype)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@CALIBRATED
@given(program=programs(control_flow=True), seeds=CALIBRATION_SEEDS, scale=CALIBRATION_SCALES,
       tolerance=TOLERANCES)
def test_calibrated_control_flow_onnx_valid_and_close(dtype, program, seeds, scale, tolerance):
    check_calibrated_onnx(program, dtype, seeds, scale, tolerance)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@SLOW
@given(program=programs(max_steps=16))
def test_converted_onnx_valid_and_close_slow(dtype, program):
    check_onnx(program, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@SLOW
@given(program=programs(max_steps=16), data=st.data())
def test_overridden_onnx_valid_and_close_slow(dtype, program, data):
    check_onnx(program, dtype, **draw_options(program, dtype, data))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@SLOW
@given(program=programs(max_steps=16, control_flow=True))
def test_control_flow_onnx_valid_and_close_slow(dtype, program):
    check_onnx(program, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@settings(max_examples=150, **_COMMON)
@given(program=programs(max_steps=16, control_flow=True), seeds=CALIBRATION_SEEDS, scale=CALIBRATION_SCALES,
       tolerance=TOLERANCES)
def test_calibrated_onnx_valid_and_close_slow(dtype, program, seeds, scale, tolerance):
    check_calibrated_onnx(program, dtype, seeds, scale, tolerance)
