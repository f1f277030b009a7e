"""Calibration: streaming stats, range rules on a neutral view, FX calibration errors, tolerance search."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import amppass
from amppass.analysis.plan import Category, Decision, Precision, Source
from amppass.analysis.policy import DIVISION, NORMALISATION
from amppass.analysis.rules import range_decisions
from amppass.analysis.stats import CalibrationStats, ValueStats
from amppass.analysis.view import GraphView, OpView
from amppass.dtypes import BF16, FP16
from models import build


def test_stats_stream_torch_and_numpy_with_sentinels_apart():
    stats = ValueStats()
    stats.update(torch.tensor([0.0, 1e-9, 3e-5, 2.0, -1e5, -3.4e38]))
    stats.update(np.array([5e-8, 7.0], dtype=np.float32))
    assert stats.absmax == 1e5 and stats.sentinels == 1 and stats.zeros == 1
    assert stats.below_normal == 3 and stats.flush == 1 and stats.above_max == 1
    assert stats.min_nonzero == pytest.approx(1e-9)
    assert stats.tensors == 2 and stats.numel == 2


def test_stats_memory_does_not_grow_with_batches():
    collected = CalibrationStats()
    for seed in range(50):
        collected.update("x", torch.randn(64, generator=torch.Generator().manual_seed(seed)))
    assert len(collected) == 1 and collected.get("x").count == 50 * 64


def _view():
    # x -> linear (LOW) -> add (FOLLOW) -> layer_norm (FP32); y -> mul -> div
    nodes = [
        OpView("linear", "aten.linear", Category.LOW, "mm", ["x", "w"], ["linear"]),
        OpView("add", "aten.add", Category.FOLLOW, "ew", ["linear"], ["add"]),
        OpView("norm", "aten.layer_norm", Category.FP32, "norm", ["add"], ["norm"], facts=frozenset({NORMALISATION})),
        OpView("mul", "aten.mul", Category.FOLLOW, "ew", ["y", "y"], ["mul"]),
        OpView("div", "aten.div", Category.FOLLOW, "ew", ["norm", "mul"], ["div"], facts=frozenset({DIVISION})),
    ]
    return GraphView(nodes, weights={"w": 1.0}, outputs=["div"])


def _stats(values):
    stats = CalibrationStats()
    for name, tensor in values.items():
        stats.update(name, tensor)
    return stats


def test_rules_overflow_propagates_and_underflow_walks_up():
    stats = _stats({"x": torch.ones(4), "linear": torch.tensor([1e5, 1.0]), "add": torch.tensor([1e5, 1.0]),
                    "norm": torch.ones(2), "y": torch.tensor([1e-5, 1e-6]), "mul": torch.tensor([1e-10, 1e-12]),
                    "div": torch.ones(2)})
    decisions = range_decisions(_view(), stats, FP16)
    assert decisions["linear"].precision is Precision.FP32
    assert decisions["linear"].evidence["propagates"] and decisions["linear"].evidence["rule"] == "overflow"
    assert decisions["linear"].evidence["absmax"] == 1e5
    assert decisions["mul"].evidence["rule"] == "underflow" and decisions["mul"].evidence["feeds"] == "div"
    assert "norm" not in decisions
    # bf16 has fp32's range: no range rules
    assert range_decisions(_view(), stats, BF16) == {}


def _case():
    return build("mlp")


def test_uncalibrated_plan_says_so():
    case = _case()
    fast = amppass.convert(case.model, case.example_inputs, torch.float16, plan_for="coverage")
    assert fast.meta["amppass"]["calibrated"] is False
    assert "uncalibrated" in amppass.report(fast).summary()


def test_calibrated_plan_records_batches_and_overrides_win():
    case = _case()
    model = case.model
    with torch.no_grad():
        model.fc1.weight.mul_(1e5)  # fc1's output now overflows fp16
    try:
        batches = [case.make_inputs(s) for s in (1, 2)]
        fast = amppass.convert(model, case.example_inputs, torch.float16, calibration=batches, plan_for="coverage")
        meta = fast.meta["amppass"]
        assert meta["calibrated"] and meta["calibration_batches"] == 2 and meta["calibration_decisions"] >= 1
        rows = {r.name: r for r in amppass.report(fast).rows}
        assert rows["linear"].precision == "fp32" and rows["linear"].source == "calibration"
        forced = amppass.convert(model, case.example_inputs, torch.float16, calibration=batches,
                                 force_low=["linear"], plan_for="coverage")
        rows = {r.name: r for r in amppass.report(forced).rows}
        assert rows["linear"].source == "override"
    finally:
        with torch.no_grad():
            model.fc1.weight.div_(1e5)


@pytest.mark.parametrize("bad, message", [
    ([], "empty"),
    ([(torch.full((2, 64), math.nan),)], "batch 0, input 'x': holds NaN"),
    ([(torch.randn(2, 64),), (torch.randn(2, 64).double(),)], "batch 1, input 'x': dtype torch.float64"),
    ([(torch.randn(2, 64), torch.randn(2, 64))], "batch 0"),
    ([(torch.randn(2, 32),)], "batch 0: the fp32 model failed on it (mat1 and mat2 shapes cannot be multiplied"),
    (torch.randn(2, 64), "iterable of input tuples"),
])
def test_bad_calibration_data_is_named(bad, message):
    case = _case()
    with pytest.raises(amppass.CalibrationError, match=re.escape(message)):
        amppass.convert(case.model, case.example_inputs, torch.float16, calibration=bad, plan_for="coverage")


def test_tolerance_needs_calibration_and_a_positive_number():
    case = _case()
    with pytest.raises(amppass.InputError, match="tolerance=0.001 needs calibration"):
        amppass.convert(case.model, case.example_inputs, torch.float16, tolerance=1e-3, plan_for="coverage")
    with pytest.raises(amppass.InputError, match="positive number"):
        amppass.convert(case.model, case.example_inputs, torch.float16, calibration=[case.example_inputs],
                        tolerance=-1, plan_for="coverage")


def _held_out_error(case, fast, seed=10):
    inputs = case.make_inputs(seed)
    with torch.no_grad():
        ref, out = case.model(*inputs), fast(*inputs)
    return float((out.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("name, dtype", [("cnn", torch.float16), ("cnn", torch.bfloat16)])
def test_tolerance_met_on_held_out_inputs(name, dtype):
    case = build(name)
    batches = [case.make_inputs(s) for s in (1, 2, 3, 4)]
    fast = amppass.convert(
        case.model, case.example_inputs, dtype, calibration=batches, tolerance=1e-3, plan_for="coverage"
    )
    meta = fast.meta["amppass"]
    assert meta["tolerance_met"] and meta["achieved_error"] <= 1e-3
    assert _held_out_error(case, fast) <= 1e-3
    moved = [r for r in amppass.report(fast).rows if r.source == Source.TOLERANCE.value]
    assert len(moved) == meta["moved_by_tolerance"]
    if dtype is torch.bfloat16:  # bf16's output error (~4e-3) is above the tolerance: nodes must move
        assert meta["initial_error"] > 1e-3 and meta["moved_by_tolerance"] >= 1
        assert all("bf16 error x gain" in r.reason and r.evidence["local_error"] is not None for r in moved)
    else:  # fp16 already meets 1e-3 on this model: nothing moves
        assert meta["moved_by_tolerance"] == 0


def test_tolerance_search_is_logarithmic():
    from amppass.analysis.painting import paint
    from amppass.analysis.plan import PrecisionPlan
    from amppass.analysis.tolerance import by_local_error, rank_runs, search, trim_runs

    plan = PrecisionPlan()
    for i in range(64):
        plan[f"n{i}"] = Decision(Precision.LOW, "mm", Source.POLICY)
    local = {f"n{i}": 1.0 / (i + 1) for i in range(64)}

    def measure(given):  # error falls as the first 37 nodes (the most sensitive) move
        return 1.0 if sum(f"n{i}" in given for i in range(37)) < 37 else 0.1

    found = search(plan, {}, local, 0.5, measure, FP16, rank_with=by_local_error)
    assert found.met and len(found.moved) == 37 and found.moved[0] == "n0"
    assert found.runs <= 2 * math.ceil(math.log2(64)) + 1 + trim_runs(37)
    found = search(plan, {}, local, 0.5, measure, FP16)  # the default ranking spends its own runs first
    assert found.met and set(found.moved) >= {f"n{i}" for i in range(37)}
    assert found.runs <= rank_runs(64) + 2 * math.ceil(math.log2(64)) + 1 + trim_runs(37)
    assert paint  # painting consumes found.given in convert


def test_tolerance_search_gives_back_nodes_the_ranking_overrated():
    """Local error ranks n0..n4 above n5, but only n5 matters for the output: the trim gives them back."""
    from amppass.analysis.plan import PrecisionPlan
    from amppass.analysis.tolerance import by_local_error, search, trim_runs

    plan = PrecisionPlan()
    for i in range(8):
        plan[f"n{i}"] = Decision(Precision.LOW, "mm", Source.POLICY)
    local = {f"n{i}": 1.0 / (i + 1) for i in range(8)}
    found = search(plan, {}, local, 0.5, lambda given: 0.1 if "n5" in given else 1.0, FP16,
                   rank_with=by_local_error)
    assert found.met and found.moved == ["n5"] and found.achieved_error == 0.1
    assert found.given["n5"].evidence["rank"] == 6, "the reason keeps the node's place in the ranking"
    assert found.runs <= 2 * math.ceil(math.log2(8)) + 1 + trim_runs(6)


def test_every_calibrated_row_carries_its_observed_range():
    from models import build

    case = build("cnn")
    fast = amppass.convert(case.model, case.example_inputs, torch.float16,
                           calibration=[case.make_inputs(s) for s in (1, 2)], plan_for="coverage")
    rows = [r for r in amppass.report(fast).rows if r.precision != "-"]
    assert rows and all(r.evidence["absmax"] > 0 for r in rows if r.op in ("aten.conv2d", "aten.linear"))
    assert sum("min_nonzero" in r.evidence for r in rows) >= len(rows) // 2
