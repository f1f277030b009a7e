"""amppass.analysis.precedence and amppass.analysis.options: the order in which decisions win, one test per level,
and the options of a conversion checked once where it starts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import amppass
from amppass import InputError
from amppass.analysis import precedence
from amppass.analysis.options import PlanOptions
from amppass.analysis.plan import Decision, Precision, Source
from tests.helpers.aliasing_models import FilledKey, filled_key_model, key_input


def _decision(precision: Precision, source: Source) -> Decision:
    return Decision(precision, f"{source.value} says {precision.value}", source)


LOW_BY_USER = _decision(Precision.LOW, Source.OVERRIDE)
FP32_BY_USER = _decision(Precision.FP32, Source.OVERRIDE)
FINITE = Decision(Precision.FP32, "goes inf in bf16 on the example where fp32 does not", Source.CALIBRATION,
                  rule="non-finite")
CALIBRATED = _decision(Precision.FP32, Source.CALIBRATION)
SLOW = _decision(Precision.FP32, Source.PROFITABILITY)


def test_level_2_the_user_wins_over_the_finite_check():
    """The finite check never moves a node the user forced low (fx.finite.keep_finite); were both given, the user's
    stands."""
    assert precedence.pinned(user={"mm": LOW_BY_USER}, finite={"mm": FINITE})["mm"] is LOW_BY_USER


def test_level_3_the_finite_check_wins_over_carried_decisions():
    assert precedence.pinned(user={}, finite={"mm": FINITE}, carried={"mm": CALIBRATED})["mm"] is FINITE


def test_level_4_carried_decisions_win_over_profitability():
    chosen = precedence.pinned(user={}, carried={"mm": CALIBRATED}, profitability={"mm": SLOW})
    assert chosen["mm"] is CALIBRATED


def test_level_5_profitability_wins_over_what_this_capture_measured():
    chosen = precedence.pinned(user={}, profitability={"mm": SLOW}, measured={"mm": CALIBRATED, "exp": CALIBRATED})
    assert chosen == {"mm": SLOW, "exp": CALIBRATED}


def test_the_user_wins_over_every_level_given():
    chosen = precedence.pinned(user={"mm": LOW_BY_USER}, finite={"exp": FINITE}, carried={"mm": CALIBRATED},
                               profitability={"mm": SLOW}, measured={"mm": CALIBRATED})
    assert chosen == {"mm": LOW_BY_USER, "exp": FINITE}


def test_level_1_an_aliasing_group_that_must_run_fp32_overrides_force_low():
    """force_low means low where correctness allows: the buffer's second slice is kept fp32, so the whole group runs
    fp32, the user's force_low of both writes included (a write through a cast copy would never reach the buffer);
    with no member fp32 the forced writes run low, and the group with them."""
    model, x = filled_key_model(FilledKey), key_input()
    fast = amppass.convert(model, (x,), "bf16", plan_for="coverage", force_low=["copy_"], keep_fp32=["slice_2"])
    rows = {r.name: r for r in amppass.report(fast).rows}
    assert rows["copy_"].precision == rows["copy__1"].precision == "fp32"
    assert "aliasing group" in rows["copy_"].reason and "slice_2 runs fp32" in rows["copy_"].reason
    low = amppass.convert(model, (x,), "bf16", plan_for="coverage", force_low=["copy_"])
    assert {r.precision for r in amppass.report(low).rows if r.op == "aten.copy_"} == {"bf16"}
    with torch.no_grad():
        for converted in (fast, low):
            assert (converted(x) - model(x)).norm() / model(x).norm() < 3e-2


def test_level_7_the_policy_decides_what_no_level_above_did():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Softmax(-1)).eval()
    rows = {r.op: r for r in amppass.report(amppass.convert(model, (torch.randn(2, 8),), "bf16",
                                                             plan_for="coverage")).rows}
    assert rows["aten.linear"].precision == "bf16" and rows["aten.softmax"].precision == "fp32"
    assert rows["aten.linear"].source == "policy"


@pytest.mark.parametrize("changes, words", [
    ({"plan_for": "fast"}, "plan_for='fast' is not one of"),
    ({"keep_io_types": "yes"}, "keep_io_types='yes' must be True or False"),
    ({"keep_fp32": [3]}, "keep_fp32: 3 is a int, not a string"),
    ({"force_low": ["linear[("]}, "not a valid regular expression"),
    ({"costs": [1.0]}, "costs must be the table"),
    ({"tolerance": 1e-3}, "needs calibration data"),
    ({"tolerance": -1.0, "calibration": []}, "must be a positive number"),
])
def test_options_are_checked_once_where_a_conversion_starts(changes, words):
    with pytest.raises(InputError, match=words):
        PlanOptions(**changes)


def test_one_pattern_is_one_pattern_and_replace_checks_again():
    options = PlanOptions(keep_fp32="linear", force_low=("softmax",))
    assert options.keep_fp32 == ("linear",) and options.force_low == ("softmax",)
    with pytest.raises(InputError, match="plan_for"):
        options.replace(plan_for="nope")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.plan_for = "coverage"  # frozen
