"""The tolerance search's shared pieces: the bisection for the most products lowered whose output error stays within
it, and the bound on a new batch's error that judges a trial."""

import math

from amppass.analysis.tolerance import batch_bound, longest_within, spreads


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
