"""Property: amppass.convert on random torch modules gives a valid GraphModule that runs and matches fp32.

The modules are :class:`fuzz_graphs.ProgramModule` interpreters over random programs, captured with
torch.export. Tolerances and their justification are those of ``test_fuzz_onnx.py``: the norm-relative
error of each output, where fp32 is finite, within 3e-2 (fp16) and 6e-2 (bf16).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import amppass
from tests.helpers.fuzz_checks import DTYPES, check_fx
from tests.helpers.fuzz_graphs import (
    CALIBRATION_SCALES,
    CALIBRATION_SEEDS,
    TOLERANCES,
    Program,
    ProgramModule,
    check_calibrated_rows,
    check_calibration_info,
    programs,
)

_COMMON = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
FAST = settings(max_examples=25, **_COMMON)
SLOW = settings(max_examples=300, **_COMMON)
CALIBRATED = settings(max_examples=10, **_COMMON)


def check_calibrated_fx(program: Program, dtype: str, seeds: list[int], scale: float,
                        tolerance: float | None) -> None:
    """check_fx with ``calibration=`` on the feeds of ``seeds`` times ``scale`` (the outputs compared on
    held-out feeds) and ``tolerance``; then the metadata, the converted module's error on the calibration
    feeds (what the tolerance search measures), and the plan against the plain conversion's."""
    calibration = [tuple(torch.from_numpy(x) for x in program.feeds(seed, scale)) for seed in seeds]
    fast = check_fx(program, dtype, calibration=calibration, tolerance=tolerance)
    module = ProgramModule(program).eval()
    error = 0.0
    with torch.no_grad():
        for inputs in calibration if tolerance is not None else ():
            for want, got in zip(module(*inputs), fast(*inputs), strict=False):
                error = max(error, float((got.float() - want).norm() / want.norm()) if torch.isfinite(got).all()
                            else float("inf"))
    report = amppass.report(fast)
    check_calibration_info(report.info, len(seeds), tolerance, error)
    example = tuple(torch.from_numpy(x) for x in program.feeds(0))
    plain = amppass.report(amppass.convert(module, example, DTYPES[dtype], plan_for="coverage"))
    check_calibrated_rows(report.rows, plain.rows, dtype, report.info)


def draw_options(program: Program, dtype: str, data: st.DataObject) -> dict:
    """Overrides drawn from the plain conversion's report: ops forced low among those it kept fp32, ops
    kept fp32, and ``keep_io_types``."""
    module = ProgramModule(program).eval()
    example = tuple(torch.from_numpy(x) for x in program.feeds(0))
    rows = amppass.report(amppass.convert(module, example, DTYPES[dtype], plan_for="coverage")).rows
    fp32_ops = sorted({r.op for r in rows if r.precision == "fp32"})
    float_ops = sorted({r.op for r in rows if r.precision != "-"})
    return {
        "force_low": data.draw(st.lists(st.sampled_from(fp32_ops), unique=True), label="force_low")
        if fp32_ops else [],
        "keep_fp32": data.draw(st.lists(st.sampled_from(float_ops), unique=True, max_size=2), label="keep_fp32")
        if float_ops else [],
        "keep_io_types": data.draw(st.booleans(), label="keep_io_types"),
    }


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@FAST
@given(program=programs())
def test_converted_fx_lints_and_close(dtype, program):
    check_fx(program, dtype)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@FAST
@given(program=programs(), data=st.data())
def test_overridden_fx_lints_and_close(dtype, program, data):
    check_fx(program, dtype, **draw_options(program, dtype, data))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@CALIBRATED
@given(program=programs(), seeds=CALIBRATION_SEEDS, scale=CALIBRATION_SCALES, tolerance=TOLERANCES)
def test_calibrated_fx_lints_and_close(dtype, program, seeds, scale, tolerance):
    check_calibrated_fx(program, dtype, seeds, scale, tolerance)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@SLOW
@given(program=programs(max_steps=16))
def test_converted_fx_lints_and_close_slow(dtype, program):
    check_fx(program, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@SLOW
@given(program=programs(max_steps=16), data=st.data())
def test_overridden_fx_lints_and_close_slow(dtype, program, data):
    check_fx(program, dtype, **draw_options(program, dtype, data))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@settings(max_examples=100, **_COMMON)
@given(program=programs(max_steps=16), seeds=CALIBRATION_SEEDS, scale=CALIBRATION_SCALES, tolerance=TOLERANCES)
def test_calibrated_fx_lints_and_close_slow(dtype, program, seeds, scale, tolerance):
    check_calibrated_fx(program, dtype, seeds, scale, tolerance)
