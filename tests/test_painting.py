"""Painting rules on hand-built neutral views (front-end independent)."""

from __future__ import annotations

from amppass.dtypes import FP16
from amppass.analysis.painting import paint
from amppass.analysis.plan import Category, Decision, Precision, Source
from amppass.analysis.view import GraphView, OpView

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
