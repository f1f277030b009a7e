"""The tolerance search's shared pieces: the bisection for the most products lowered whose output error stays within
it, and the bound on a new batch's error that judges a trial."""

import math

import pytest

from amppass.analysis import tolerance
from amppass.analysis.tolerance import JudgedTrials, batch_bound, longest_within, spreads


def test_longest_within_finds_the_last_count_that_holds_and_never_asks_zero():
    for count in range(0, 12):
        for edge in range(0, count + 1):
            asked = []

            def within(k, edge=edge, asked=asked):
                asked.append(k)
                return k <= edge

            assert longest_within(count, within) == edge
            assert 0 not in asked and len(asked) <= 1 + max(count - 1, 1).bit_length()


def test_batch_bound_is_the_95_percent_prediction_bound_for_a_new_batch_and_never_below_the_largest():
    errors = [0.010, 0.012, 0.014, 0.012]
    mean, deviation = 0.012, math.sqrt((0.002 ** 2 * 2) / 3)
    assert math.isclose(batch_bound(errors), mean + 2.353 * deviation * math.sqrt(1 + 1 / 4))
    assert batch_bound(errors) > max(errors)
    assert batch_bound([0.02, 0.02, 0.02]) == 0.02  # no spread: the largest
    assert batch_bound([0.015]) == 0.015 and batch_bound([]) == 0.0  # one batch shows no spread
    assert batch_bound([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]) == 1.0  # an outlier batch


def test_spreads_are_students_t_quantiles_and_fall_towards_the_normal_one():
    assert [spreads(n) for n in (2, 4, 8)] == [6.314, 2.353, 1.895]
    many = [spreads(n) for n in range(2, 200)]
    assert all(a >= b for a, b in zip(many, many[1:], strict=False)) and 1.645 < many[-1] < 1.66
    assert abs(spreads(12) - 1.796) < 0.02 and abs(spreads(31) - 1.697) < 0.02  # t(0.95, 11) and t(0.95, 30)


# per trial (the set of products in fp8), its error on each of 8 judged batches; batch 5 is each trial's worst
ERRORS = {frozenset(): [0.010, 0.011, 0.012, 0.010, 0.011, 0.013, 0.010, 0.012],
          frozenset({"a"}): [0.015, 0.016, 0.015, 0.017, 0.015, 0.018, 0.016, 0.015],
          frozenset({"a", "b"}): [0.019, 0.019, 0.020, 0.019, 0.019, 0.031, 0.019, 0.019],
          frozenset({"b"}): [0.012, 0.012, 0.012, 0.012, 0.012, 0.025, 0.012, 0.012]}


def _counting() -> tuple[JudgedTrials, list[tuple[frozenset, int]], list[frozenset]]:
    """Judged trials over :data:`ERRORS`, with the batches run and the trials started, in order."""
    runs, started = [], []

    def start(names):
        started.append(names)

        def error(batch):
            runs.append((names, batch))
            return ERRORS[names][batch]

        return error

    return JudgedTrials(start, 8, 0.02), runs, started


def test_judged_trials_run_a_trial_within_the_tolerance_on_every_batch_once_and_judge_it_by_the_bound():
    trials, runs, started = _counting()
    assert trials.error(["a"]) == batch_bound(ERRORS[frozenset({"a"})]) <= 0.02
    assert sorted(b for _, b in runs) == list(range(8)) and started == [frozenset({"a"})]
    assert trials.error(["a"]) == trials.error(("a",)) and len(runs) == 8  # the memo: never run twice
    assert trials.known(["a"]) and trials.words(["a"]) == f"{batch_bound(ERRORS[frozenset({'a'})]):.3g}"
    assert trials.runs == 8 and len(trials.seen) == 1


def test_judged_trials_stop_a_trial_at_its_first_batch_beyond_the_tolerance_running_the_worst_batch_first():
    trials, runs, _ = _counting()
    trials.error([])  # every batch: batch 5 was the worst
    assert runs[-1] == (frozenset(), 7)
    del runs[:]
    assert trials.error(["b", "a"]) == 0.031 > 0.02  # batch 5 first, beyond: a lower bound on the bound
    assert runs == [(frozenset({"a", "b"}), 5)]
    assert not trials.known(["a", "b"]) and trials.words(["a", "b"]) == "at least 0.031 on one batch of 8"
    assert trials.error(["a", "b"]) == 0.031 and len(runs) == 1  # rejected: not run again
    assert trials.measured(["a", "b"]) == ERRORS[frozenset({"a", "b"})] and len(runs) == 8  # the rest, on demand
    assert trials.known(["a", "b"]) and trials.error(["a", "b"]) == batch_bound(ERRORS[frozenset({"a", "b"})])


def test_judged_trials_decide_as_judging_every_batch_does(monkeypatch):
    trials = ([], ["a"], ["b"], ["a", "b"])
    early, _, _ = _counting()
    stopped = [early.error(names) for names in trials]
    monkeypatch.setattr(tolerance, "STOP_EARLY", False)
    full, runs, _ = _counting()
    for names, lower in zip(trials, stopped, strict=True):
        assert (full.error(names) <= 0.02) == (lower <= 0.02) and full.error(names) >= lower
    assert len(runs) == 32 and early.runs == 8 + 8 + 1 + 1  # b is beyond on batch 5, the worst so far


@pytest.mark.parametrize("first_beyond", [0, 2])
def test_judged_trials_start_a_trial_once_and_stop_where_a_batch_is_beyond(first_beyond):
    started, runs = [], []

    def start(names):
        started.append(names)
        return lambda batch: runs.append(batch) or (0.05 if batch == first_beyond else 0.01)

    trials = JudgedTrials(start, 4, 0.02)
    assert trials.error(["x"]) == 0.05 and runs == list(range(first_beyond + 1)) and len(started) == 1
