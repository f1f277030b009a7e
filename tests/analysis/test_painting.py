"""Painting rules on hand-built neutral views (front-end independent)."""

from __future__ import annotations

from amppass.analysis.painting import paint
from amppass.analysis.plan import Category, Decision, Precision, Source
from amppass.analysis.view import GraphView, OpView
from amppass.dtypes import BF16, FP16

FP16_MAX = 65504.0


def _op(name, category, inputs, outputs=None):
    return OpView(name, name, category, f"{name} policy", list(inputs), list(outputs or [name]))


def test_cast_moves_before_data_movement_whose_readers_all_run_fp32():
    """mm (low) -> transpose -> reshape -> norm (fp32): both movers run fp32, so one cast sits after mm."""
    view = GraphView(nodes=[
        _op("mm", Category.LOW, ["x", "w"]),
        _op("transpose", Category.FOLLOW, ["mm"]),
        _op("reshape", Category.FOLLOW, ["transpose"]),
        _op("norm", Category.FP32, ["reshape"]),
    ], weights={"w": 1.0}, outputs=["norm"])
    plan = paint(view, FP16)
    assert [plan[n].precision for n in ("mm", "transpose", "reshape", "norm")] == [
        Precision.LOW, Precision.FP32, Precision.FP32, Precision.FP32]
    assert "every reader runs fp32" in plan["transpose"].reason


def test_cast_stays_where_moving_it_would_not_be_free():
    """A follower with a low reader, two low inputs, a graph output or a user decision keeps its paint."""
    view = GraphView(nodes=[
        _op("mm", Category.LOW, ["x", "w"]),
        _op("mm2", Category.LOW, ["x", "w"]),
        _op("relu", Category.FOLLOW, ["mm"]),        # read by a low matmul and an fp32 op
        _op("add", Category.FOLLOW, ["mm", "mm2"]),  # two low inputs: two casts instead of one
        _op("out", Category.FOLLOW, ["mm2"]),        # a graph output
        _op("forced", Category.FOLLOW, ["mm2"]),     # the user asked for it low
        _op("mm3", Category.LOW, ["relu", "w"]),
        _op("norm", Category.FP32, ["relu", "add", "forced"]),
    ], weights={"w": 1.0}, outputs=["norm", "out"])
    given = {"forced": Decision(Precision.LOW, "user", Source.OVERRIDE)}
    plan = paint(view, FP16, given)
    assert all(plan[n].precision is Precision.LOW for n in ("relu", "add", "out", "forced"))


def _weights_view(constant, facts: frozenset = frozenset()) -> GraphView:
    """mm (low) -> op(mm, c) -> mm2 (low): the op reads the constant c beside a low activation."""
    import numpy as np

    values = {"w": np.full((4, 4), 0.5, np.float32), "c": np.broadcast_to(np.float32(constant), 4)}
    op = OpView("op", "op", Category.FOLLOW, "op policy", ["mm", "c"], ["op"], facts=facts)
    return GraphView(nodes=[_op("mm", Category.LOW, ["x", "w"]), op, _op("mm2", Category.LOW, ["op", "w"])],
                     weights={"w": 0.5, "c": float(np.abs(values["c"]).max())}, outputs=["mm2"],
                     weight_values=values.__getitem__)


def test_weight_beside_a_low_activation_runs_low_when_it_fits():
    plan = paint(_weights_view(0.25), FP16)
    assert plan["op"].precision is Precision.LOW and "weights it reads fit fp16" in plan["op"].reason


def test_weight_that_rounds_away_keeps_its_reader_fp32_with_the_measure():
    plan = paint(_weights_view(1e-12), FP16)
    decision = plan["op"]
    assert decision.precision is Precision.FP32 and decision.source is Source.STATIC
    assert decision.evidence["rule"] == "weight-fit" and decision.evidence["rounding_error"] == 1.0
    assert "does not fit fp16" in decision.reason
    # bf16 has fp32's range: the same constant fits it
    assert paint(_weights_view(1e-12), BF16)["op"].precision is Precision.LOW


def test_division_by_a_subnormal_weight_keeps_fp32_and_concatenating_a_weight_keeps_fp32():
    from amppass.analysis.policy import DIVISION, JOIN

    one_small = [2.0, 2.0, 2.0, 3e-6]  # fits as an addend: the norm barely moves
    assert paint(_weights_view(one_small), FP16)["op"].precision is Precision.LOW
    divided = paint(_weights_view(one_small, frozenset({DIVISION})), FP16)["op"]
    assert divided.precision is Precision.FP32 and "divides by it" in divided.reason
    joined = paint(_weights_view(0.25, frozenset({JOIN})), FP16)["op"]
    assert joined.precision is Precision.FP32 and "joins weight 'c'" in joined.reason


def test_bias_add_whose_readers_run_fp32_moves_its_cast_before_it():
    """mm (low) -> add(mm, b) -> norm (fp32): one cast either way; the add runs fp32, b stays fp32."""
    view = GraphView(nodes=[
        _op("mm", Category.LOW, ["x", "w"]),
        _op("add", Category.FOLLOW, ["mm", "b"]),
        _op("norm", Category.FP32, ["add"]),
    ], weights={"w": 1.0, "b": 1.0}, outputs=["norm"])
    plan = paint(view, FP16)
    assert plan["add"].precision is Precision.FP32 and "every reader runs fp32" in plan["add"].reason


def test_constant_in_the_op_that_rounds_to_zero_keeps_fp32():
    clamp = OpView("clamp", "clamp", Category.FOLLOW, "clamp policy", ["mm"], ["clamp"], scalars=[1e-12])
    view = GraphView(nodes=[_op("mm", Category.LOW, ["x", "w"]), clamp, _op("mm2", Category.LOW, ["clamp", "w"])],
                     weights={"w": 1.0}, outputs=["mm2"])
    decision = paint(view, FP16)["clamp"]
    assert decision.precision is Precision.FP32 and "rounds to zero in fp16" in decision.reason
    assert paint(view, BF16)["clamp"].precision is Precision.LOW


def test_weight_only_op_whose_weights_do_not_fit_stays_fp32_under_low_consumers():
    import numpy as np

    values = {"w": np.full((4, 4), 0.5, np.float32), "t": np.full((4, 4), 1e-9, np.float32)}
    view = GraphView(nodes=[
        _op("transpose", Category.FOLLOW, ["t"]),  # reads weights only
        _op("mm", Category.LOW, ["x", "transpose"]),
    ], weights={"w": 0.5, "t": 1e-9}, outputs=["mm"], weight_values=values.__getitem__)
    plan = paint(view, FP16)
    assert plan["transpose"].precision is Precision.FP32 and "does not fit fp16" in plan["transpose"].reason


def test_an_in_place_relu_whose_readers_run_fp32_leaves_its_convolution_low():
    """RAFT's encoder: conv -> ReLU(inplace=True) -> a norm that runs fp32. Rule 8 would run the ReLU fp32 to put
    the cast before it; the ReLU writes into the convolution's output, so that fp32 must not pull the aliasing
    group (and the convolution, 10% of RAFT's multiply-adds) to fp32: the cast goes after the ReLU instead."""
    import torch

    import amppass

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(inplace=True),
                                torch.nn.GroupNorm(2, 8)).eval()
    x = torch.randn(1, 3, 16, 16)
    fast = amppass.convert(model, (x,), "bf16", plan_for="coverage")
    rows = {row.op: row for row in amppass.report(fast).rows}
    assert rows["aten.conv2d"].precision == "bf16" and rows["aten.relu_"].precision == "bf16"
    with torch.no_grad():
        assert (fast(x) - model(x)).norm() / model(x).norm() < 3e-2
