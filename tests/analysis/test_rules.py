"""amppass.analysis.rules: the range rules on hand-built neutral views: which node each rule decides, the rule id,
reason and evidence it records, where each stops, and which apply to which low dtype."""

from __future__ import annotations

import pytest
import torch

from amppass.analysis.plan import Category, Precision, Source
from amppass.analysis.policy import DIVISION, NORMALISATION, POWER, REDUCTION, SINGULAR
from amppass.analysis.rules import UNDERFLOW_SHARE, range_decisions
from amppass.analysis.stats import HEADROOM, CalibrationStats
from amppass.analysis.view import GraphView, OpView
from amppass.dtypes import BF16, FP16, FP16_MAX

LIMIT = FP16_MAX / HEADROOM


def _stats(**values: torch.Tensor) -> CalibrationStats:
    stats = CalibrationStats()
    for name, tensor in values.items():
        stats.update(name, tensor)
    return stats


def _node(name, category, inputs, facts=(), scalars=(), op=None):
    return OpView(name, op or f"aten.{name}", category, "table", list(inputs), [name], facts=frozenset(facts),
                  scalars=list(scalars))


def test_overflow_of_an_output_runs_fp32_and_propagates():
    view = GraphView([_node("mm", Category.LOW, ["x", "w"])], weights={"w": 1.0})
    found = range_decisions(view, _stats(x=torch.ones(2), mm=torch.tensor([1.0, -5e4])), FP16)
    decision = found["mm"]
    assert decision.precision is Precision.FP32 and decision.source is Source.CALIBRATION
    assert decision.rule == "overflow" and decision.evidence["rule"] == "overflow"
    assert decision.evidence["propagates"] is True and decision.evidence["limit"] == LIMIT
    assert decision.evidence["value"] == "mm" and decision.evidence["absmax"] == 5e4
    assert decision.evidence["batches"] == 1
    assert decision.reason.startswith("output reaches 5e+04 on calibration data, within a factor 2 of fp16's "
                                      "largest 65504")


def test_overflow_starts_beyond_the_headroom():
    view = GraphView([_node("mm", Category.LOW, ["x"])])
    at = range_decisions(view, _stats(x=torch.ones(1), mm=torch.tensor([LIMIT])), FP16)
    beyond = range_decisions(view, _stats(x=torch.ones(1), mm=torch.tensor([LIMIT * 1.001])), FP16)
    assert at == {} and beyond["mm"].rule == "overflow"


def test_a_reduction_result_out_of_range_is_named_so():
    view = GraphView([_node("sum", Category.FP32, ["x"], facts=[REDUCTION])])
    decision = range_decisions(view, _stats(x=torch.ones(4), sum=torch.tensor([1e5])), FP16)["sum"]
    assert decision.rule == "reduction-overflow" and decision.reason.startswith("reduction result reaches 1e+05")
    assert decision.evidence["propagates"] is True


def test_ops_with_no_float_work_or_fp32_results_are_not_decided():
    view = GraphView([_node("shape", Category.KEEP, ["x"]), _node("softmax", Category.FP32_ACCUM, ["x"])])
    stats = _stats(x=torch.tensor([1e5]), shape=torch.tensor([1e5]), softmax=torch.tensor([1e5]))
    assert range_decisions(view, stats, FP16) == {}


def test_a_low_op_reading_an_out_of_range_activation_runs_fp32():
    view = GraphView([_node("mm", Category.LOW, ["x", "w"]), _node("add", Category.FOLLOW, ["x"])],
                     weights={"w": 1e6})
    found = range_decisions(view, _stats(x=torch.tensor([1e5, 1.0]), w=torch.tensor([1e6]), mm=torch.ones(2),
                                         add=torch.ones(2)), FP16)
    assert list(found) == ["mm"]  # a FOLLOW op reading it is painted from its producer, not by this rule
    decision = found["mm"]
    assert decision.rule == "overflow-input" and decision.evidence["value"] == "x"
    assert "propagates" not in decision.evidence
    assert decision.reason.startswith("input 'x' reaches 1e+05 on calibration data, beyond what fp16 holds")


def test_a_weight_read_is_left_to_the_weight_rules():
    view = GraphView([_node("mm", Category.LOW, ["x", "w"])], weights={"w": 1e6})
    assert range_decisions(view, _stats(x=torch.ones(2), w=torch.tensor([1e6]), mm=torch.ones(2)), FP16) == {}


def _underflow_view(reader: OpView) -> GraphView:
    # x -> scale (FOLLOW) -> small (FOLLOW) -> reader
    return GraphView([_node("scale", Category.FOLLOW, ["x"]), _node("small", Category.FOLLOW, ["scale"]), reader],
                     outputs=[reader.name])


TINY = torch.tensor([1e-9, 3e-9, 2e-8])


def test_underflow_walks_up_through_producers_as_small():
    view = _underflow_view(_node("div", Category.FOLLOW, ["one", "small"], facts=[DIVISION]))
    stats = _stats(x=torch.ones(3), scale=TINY, small=TINY, one=torch.ones(3), div=torch.ones(3))
    found = range_decisions(view, stats, FP16)
    assert set(found) == {"scale", "small"}  # x is not small: the walk stops at it
    decision = found["small"]
    assert decision.rule == "underflow" and decision.evidence["feeds"] == "div"
    assert decision.evidence["feeds_op"] == "aten.div" and decision.evidence["value"] == "small"
    assert decision.evidence["share_below_normal"] == 1.0
    assert "below fp16's smallest normal" in decision.reason and "'div', which divides by them" in decision.reason


def test_underflow_stops_at_a_producer_with_no_float_work():
    view = GraphView([_node("scale", Category.KEEP, ["x"]), _node("small", Category.FOLLOW, ["scale"]),
                      _node("log", Category.FOLLOW, ["small"], facts=[SINGULAR])])
    found = range_decisions(view, _stats(x=TINY, scale=TINY, small=TINY, log=torch.ones(3)), FP16)
    assert set(found) == {"small"}


def test_values_mostly_normal_are_not_small():
    mostly_normal = torch.cat([torch.ones(1000), torch.full((5,), 1e-6)])  # 0.5% below normal, none flush
    assert 5 / 1005 < UNDERFLOW_SHARE
    view = _underflow_view(_node("log", Category.FOLLOW, ["small"], facts=[SINGULAR]))
    stats = _stats(x=torch.ones(3), scale=mostly_normal, small=mostly_normal, log=torch.ones(3))
    assert range_decisions(view, stats, FP16) == {}


@pytest.mark.parametrize("facts, scalars, inputs, decided", [
    ([DIVISION], [], ["small", "other"], {"small", "other"}),  # both sides of a ratio
    ([SINGULAR], [], ["other", "small"], {"other"}),  # only the first input of a log
    ([NORMALISATION], [], ["small", "other"], {"small"}),
    ([POWER], [-0.5], ["small", "other"], {"small"}),  # a negative power of a small value
    ([POWER], [], ["small", "other"], {"small"}),  # a tensor exponent may be negative
    ([POWER], [2.0], ["small", "other"], set()),  # a positive power does not blow up
    ([], [], ["small", "other"], set()),  # an op that is not sensitive
])
def test_which_inputs_are_sensitive(facts, scalars, inputs, decided):
    view = GraphView([_node("small", Category.FOLLOW, ["x"]), _node("other", Category.FOLLOW, ["x"]),
                      _node("reader", Category.FOLLOW, inputs, facts=facts, scalars=scalars)])
    stats = _stats(x=torch.ones(3), small=TINY, other=TINY, reader=torch.ones(3))
    assert set(range_decisions(view, stats, FP16)) == decided


@pytest.mark.parametrize("low", [FP16, BF16])
def test_reduction_depth_beyond_the_significand_runs_fp32(low):
    bits = low.significand_bits
    deep, shallow = 2 ** bits * 2, 2 ** bits
    view = GraphView([_node("pool", Category.FOLLOW, ["x"], facts=[REDUCTION]),
                      _node("pool2", Category.FOLLOW, ["y"], facts=[REDUCTION]),
                      _node("relu", Category.FOLLOW, ["x"])])
    stats = _stats(x=torch.ones(3, deep), pool=torch.ones(3), y=torch.ones(3, shallow), pool2=torch.ones(3),
                   relu=torch.ones(3, deep))
    found = range_decisions(view, stats, low)
    assert list(found) == ["pool"]
    assert found["pool"].rule == "reduction-depth"
    assert found["pool"].evidence == {"rule": "reduction-depth", "depth": deep, "limit": 2 ** bits, "value": "x"}
    assert found["pool"].reason.startswith(f"reduces {deep} terms per result; summed in {low} that loses all {bits}")


def test_bf16_keeps_fp32_range_so_only_the_depth_rule_applies():
    view = GraphView([_node("mm", Category.LOW, ["x"]), _node("log", Category.FOLLOW, ["mm"], facts=[SINGULAR])])
    stats = _stats(x=torch.tensor([1e30]), mm=TINY, log=torch.ones(3))
    assert set(range_decisions(view, stats, FP16)) == {"mm"}
    assert range_decisions(view, stats, BF16) == {}


def test_a_node_keeps_the_first_decision_it_gets():
    """An output that overflows and also feeds a divisor small elsewhere keeps the overflow decision."""
    values = torch.cat([torch.tensor([1e5]), torch.full((99,), 1e-9)])
    view = GraphView([_node("mm", Category.LOW, ["x"]), _node("div", Category.FOLLOW, ["y", "mm"], facts=[DIVISION])])
    stats = _stats(x=torch.ones(100), mm=values, y=torch.ones(100), div=torch.ones(100))
    found = range_decisions(view, stats, FP16)
    assert list(found) == ["mm"] and found["mm"].rule == "overflow"


def test_values_never_seen_decide_nothing():
    view = GraphView([_node("mm", Category.LOW, ["x"]), _node("div", Category.FOLLOW, ["mm"], facts=[DIVISION]),
                      _node("pool", Category.FOLLOW, ["mm"], facts=[REDUCTION])])
    assert range_decisions(view, CalibrationStats(), FP16) == {}
