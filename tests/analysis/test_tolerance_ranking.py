"""The tolerance search's ranking: gains from linearised propagation, regions measured in runs
(logarithmic budget), the reference ranking and the strategy switch, on synthetic models whose output
error is known."""

from __future__ import annotations

import math

import pytest

from amppass.analysis import propagation, tolerance
from amppass.analysis.plan import Category, Decision, Precision, PrecisionPlan, Source
from amppass.analysis.policy import ADDITION, JOIN
from amppass.analysis.view import GraphView, OpView
from amppass.dtypes import FP16


def _plan(names):
    plan = PrecisionPlan()
    for name in names:
        plan[name] = Decision(Precision.LOW, "mm", Source.POLICY)
    return plan


def _additive(effects: dict[str, float]):
    """A measure whose squared output error is the sum of the squared effects of the nodes left low."""
    def measure(given):
        return math.sqrt(sum(e * e for n, e in effects.items() if n not in given))
    return measure


def test_gains_scale_errors_by_their_share_at_additions_and_joins():
    """x -> mm -> add(mm, skip) -> cat(add, w) -> out: a branch a tenth of the sum reaches it at a tenth."""
    view = GraphView(nodes=[
        OpView("skip", "mm", Category.LOW, "", ["x", "w"], ["skip"]),
        OpView("mm", "mm", Category.LOW, "", ["x", "w"], ["mm"]),
        OpView("add", "add", Category.FOLLOW, "", ["mm", "skip"], ["add"], facts=frozenset({ADDITION})),
        OpView("relu", "relu", Category.FOLLOW, "", ["add"], ["relu"]),
        OpView("cat", "cat", Category.FOLLOW, "", ["relu", "other"], ["cat"], facts=frozenset({JOIN})),
        OpView("unused", "mm", Category.LOW, "", ["x", "w"], ["unused"]),
    ], weights={"w": 1.0}, outputs=["cat"])
    norms = {"mm": 1.0, "skip": 9.0, "add": 10.0, "relu": 10.0, "cat": 20.0}
    found = propagation.gains(view, norms)
    assert found["cat"] == 1.0 and found["relu"] == pytest.approx(0.5)  # half of the concatenation
    assert found["mm"] == pytest.approx(0.05) and found["skip"] == pytest.approx(0.45)
    assert found["unused"] == 0.0  # reaches no output
    assert propagation.gains(view, {})["mm"] == 1.0  # without norms errors pass unchanged


def test_region_runs_find_the_nodes_that_matter_when_local_errors_cannot_tell():
    """32 nodes with equal local errors; two of them carry the output error. The default ranking finds
    them within its budget of runs, and the search moves exactly those two."""
    names = [f"n{i}" for i in range(32)]
    effects = {n: 0.01 for n in names} | {"n20": 1.0, "n27": 0.8}
    local = {n: 1e-3 for n in names}
    measure = _additive(effects)
    ranked = tolerance.by_region_effect(names, tolerance.Sensitivity(local), lambda moved: measure(set(moved)),
                                        measure(set()), FP16)
    assert ranked.order[0] == "n20" and "n27" in ranked.order[:8]  # n27's region of 8 is left unsplit
    found = tolerance.search(_plan(names), {}, local, 0.2, _additive(effects), FP16)
    assert found.met and set(found.moved) == {"n20", "n27"}
    assert found.runs <= tolerance.rank_runs(32) + 2 * 5 + 1 + tolerance.trim_runs(2)


def test_gains_the_runs_contradict_are_not_trusted():
    """Propagation says n3 matters most; the runs show n28 does: the estimate without gains is used."""
    names = [f"n{i}" for i in range(32)]
    effects = {n: 0.01 for n in names} | {"n28": 1.0}
    sensitivity = tolerance.Sensitivity({n: 1e-3 for n in names}, gain={n: 0.01 for n in names} | {"n3": 1.0})
    measure = _additive(effects)
    ranked = tolerance.by_region_effect(names, sensitivity, lambda moved: measure(set(moved)), measure(set()), FP16)
    assert ranked.order[0] == "n28" and "gain^0," in ranked.measure


def test_saturated_errors_ranked_by_regions_not_by_single_moves():
    """Like the sensor net: while either of two nodes is low the output is garbage (error 3.6), so moving
    one alone changes nothing: the reference's one run per candidate cannot tell them from the rest, the
    regions' runs (alone in low precision) can."""
    names = [f"n{i}" for i in range(16)]

    def measure(given):
        return 3.6 if "n13" not in given or "n14" not in given else 1e-4 * sum(n not in given for n in names)

    local = {n: 1e-3 for n in names}
    found = tolerance.search(_plan(names), {}, local, 1e-2, measure, FP16)
    assert found.met and set(found.moved) == {"n13", "n14"}
    assert {found.given[n].evidence["rank"] for n in found.moved} == {1, 2}
    alone = tolerance.by_error_alone(names, tolerance.Sensitivity(local), lambda moved: measure(set(moved)),
                                     measure(set()), FP16)
    assert set(alone.scores.values()) == {3.6}  # every single move leaves the output as wrong


def test_ranking_context_switches_the_strategy_and_restores_it():
    names = [f"n{i}" for i in range(8)]
    local = {n: 1.0 / (i + 1) for i, n in enumerate(names)}
    effects = {n: 0.01 for n in names} | {"n5": 1.0}
    with tolerance.ranking(tolerance.by_error_alone):
        found = tolerance.search(_plan(names), {}, local, 0.5, _additive(effects), FP16)
    assert found.moved == ["n5"] and "alone in fp32" in found.given["n5"].reason
    assert found.runs >= len(names)  # one run per candidate
    found = tolerance.search(_plan(names), {}, local, 0.5, _additive(effects), FP16)
    assert found.moved == ["n5"] and "x gain" in found.given["n5"].reason
    assert found.given["n5"].evidence["rank"] == 1
