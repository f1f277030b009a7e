"""The calibration template of :mod:`amppass.analysis.calibration` against a tiny front end that implements its
runner protocol and trial hooks (:mod:`tests.helpers.chain_front_end`): the data pass, the trials' error and
perturbed copies, and the plan with the tolerance search, whose runs resume only from checkpoints before
their first change."""

from __future__ import annotations

import math

import numpy as np
import pytest

from amppass.analysis.calibration import PERTURBATIONS, max_runs, plan_from_calibration, record
from amppass.analysis.painting import paint
from amppass.analysis.plan import Precision, Source
from amppass.dtypes import FP16
from tests.helpers.chain_front_end import OPS, Chain, ChainRunner, ChainTrials, run_from, view


def _batches(count: int, size: int = 64) -> list[np.ndarray]:
    """``count`` batches of ``size`` values in (0.1, 1), where every op of the chain is defined."""
    rng = np.random.default_rng(1)
    return [rng.uniform(0.1, 1.0, size).astype(np.float32) for _ in range(count)]


def test_the_data_pass_keeps_batches_and_their_outputs_for_the_search():
    batches = _batches(3)
    runner = ChainRunner(Chain([1, 3, 5]))
    data = record(runner, batches, keep=True)
    assert runner.events == [("run", 0, 0), ("run", 1, 1), ("run", 2, 2), ("finish",)]
    assert data is runner.data and data.batches == 3 and data.seconds > 0
    assert all(np.array_equal(k, b) for k, b in zip(data.kept, batches, strict=False))
    assert all(np.array_equal(r[0], run_from(0, set(), b)) for r, b in zip(data.references, batches, strict=False))
    assert data.stats.get("v7").tensors == 3 and sorted(runner.chain.values) == [0, 1, 2]


def test_without_a_search_the_data_pass_keeps_nothing():
    runner = ChainRunner(Chain([1, 3, 5]))
    data = record(runner, _batches(2))
    assert runner.events == [("run", 0, None), ("run", 1, None), ("finish",)]
    assert data.kept == [] and data.references == [] and runner.chain.values == {}
    assert data.batches == 2 and data.stats.get("v0").tensors == 2


def test_a_trials_error_is_its_largest_relative_output_error_and_inf_where_it_did_not_run():
    data = record(ChainRunner(Chain([])), _batches(2), keep=True)
    trials = ChainTrials(data, None)
    plan = paint(view(), FP16, {})
    expected = max(float(np.linalg.norm(run_from(0, set(range(len(OPS))), x) - r[0]) / np.linalg.norm(r[0]))
                   for x, r in zip(data.kept, data.references, strict=False))
    assert trials.error(plan, {}, [0, 1]) == pytest.approx(expected) and expected > 0
    trials.run = lambda plan, decisions, batches: iter([(0, data.references[0]), (1, None)])
    assert trials.error(plan, {}, [0, 1]) == math.inf


def test_perturbed_copies_are_kept_with_their_outputs_or_not_at_all():
    x = _batches(1)[0]
    trials = ChainTrials(record(ChainRunner(Chain([])), [x], keep=True), None)
    trials.reject = True
    assert trials.perturbed(PERTURBATIONS) == [] and len(trials.data.kept) == 1, "a rejected copy keeps none"
    trials.reject = False
    added = trials.perturbed(PERTURBATIONS)
    assert added == list(range(1, 1 + len(PERTURBATIONS))) and trials.count() == 1
    assert np.array_equal(trials.data.kept[1], PERTURBATIONS[0].apply(x))
    assert np.array_equal(trials.data.references[2][0], run_from(0, set(), PERTURBATIONS[1].apply(x)))
    lone = ChainTrials(record(ChainRunner(Chain([])), [x[:1]], keep=True), None)
    assert lone.perturbed(PERTURBATIONS) == [], "a single value gets no noise"


def _search(checkpoints: list[int] | None):
    """The plan from 4 batches with a tolerance of 2e-4, the trials resuming from ``checkpoints`` or, without
    them, run whole: the chain, the plan, its metadata and the arguments of each trial run."""
    chain = Chain(checkpoints or [])
    data = record(ChainRunner(chain, replay=True), _batches(4), keep=True)
    trials = ChainTrials(data, chain if checkpoints is not None else None)
    runs = []
    error = trials.error
    trials.error = lambda *args: runs.append(args) or error(*args)
    plan, info = plan_from_calibration(view(), data, FP16, {}, trials=trials, tolerance=2e-4)
    return chain, plan, info, runs


def test_the_search_resumes_each_trial_from_the_last_kept_checkpoint_before_its_first_change():
    chain, plan, info, runs = _search([2, 5])
    assert info["tolerance_met"] and info["moved_by_tolerance"] > 0 and info["achieved_error"] <= 2e-4
    assert info["tolerance_runs"] == len(runs) <= max_runs(len(OPS))
    assert all(start == max((c for c in (2, 5) if c <= first), default=None) for start, first in chain.resumed)
    assert {start for start, _ in chain.resumed} == {None, 2, 5}, "trials changing n0 run whole, the others resume"
    assert info["tolerance_reused"] == round(chain.nodes_skipped / (chain.nodes_skipped + chain.nodes_run), 3) > 0


def test_checkpoints_change_no_decision_and_no_run():
    _, plan, info, runs = _search([2, 5])
    _, whole_plan, whole_info, whole_runs = _search(None)
    assert whole_info.pop("tolerance_reused") == 0 and info.pop("tolerance_reused") > 0
    for seconds in ("calibration_seconds", "tolerance_seconds"):
        info.pop(seconds), whole_info.pop(seconds)
    assert info == whole_info and len(runs) == len(whole_runs)
    assert {n: (d.precision, d.reason, d.rule) for n, d in plan.items()} == {
        n: (d.precision, d.reason, d.rule) for n, d in whole_plan.items()}
    moved = [n for n, d in plan.items() if d.source is Source.TOLERANCE]
    assert moved and all(plan[n].precision is Precision.FP32 and plan[n].rule == "tolerance"
                         and "moved back to fp32 to meet the output tolerance" in plan[n].reason for n in moved)


def test_range_rules_decide_from_the_data_pass_statistics():
    loud = _batches(2)
    loud[1][0] = 12.0  # n0 = exp: 162755, beyond fp16's 65504
    data = record(ChainRunner(Chain([])), loud)
    plan, info = plan_from_calibration(view(), data, FP16, {})
    assert plan["n0"].precision is Precision.FP32 and plan["n0"].source is Source.CALIBRATION
    assert plan["n0"].rule == "overflow" and plan["n0"].evidence["absmax"] == pytest.approx(np.exp(12.0), rel=1e-6)
    assert plan["n1"].precision is Precision.FP32 and plan["n1"].rule == "overflow-input", "it would read inf"
    assert plan["n2"].precision is Precision.LOW and plan["n2"].evidence["absmax"] <= 1, "its range is in evidence"
    assert info == {"calibrated": True, "calibration_batches": 2, "calibration_seconds": round(data.seconds, 3),
                    "calibration_decisions": 2}
