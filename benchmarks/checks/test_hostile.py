"""Hostile fp16 models: calibrated amppass stays finite and close to fp32 where .half() and autocast break."""

from __future__ import annotations

import math

import pytest

from benchmarks.hostile import CASES, run_case


@pytest.fixture(scope="module", params=CASES, ids=[c.name for c in CASES])
def rows(request):
    return {r["method"]: r for r in run_case(request.param)}


def test_calibrated_amppass_is_finite_and_within_1e_2(rows):
    calibrated = rows["amppass fp16 + calibration"]
    assert calibrated["finite"]
    assert calibrated["rel_error"] < 1e-2


def test_harmless_matrix_products_stay_fp16(rows):
    calibrated = rows["amppass fp16 + calibration"]
    assert calibrated["low_matmuls"] >= calibrated["harmless_matmuls"]
    assert calibrated["note"], "a calibration rule fired and is named in the report"


def test_plain_half_breaks_and_uncalibrated_plan_breaks_or_is_rescued_by_the_example(rows):
    # what calibration fixes: every hostile case breaks (inf, or >10% error) under .half(); the uncalibrated plan
    # either breaks too, or its example call went non-finite and the conversion's check kept the node fp32
    half, plain = rows[".half()"], rows["amppass fp16"]
    assert half["rel_error"] > 0.1 or math.isinf(half["rel_error"])
    if "non-finite" in plain["note"]:
        assert plain["finite"] and plain["rel_error"] < 1e-2
        assert plain["low_matmuls"] >= plain["harmless_matmuls"]
    else:
        assert plain["rel_error"] > 0.1 or math.isinf(plain["rel_error"])
