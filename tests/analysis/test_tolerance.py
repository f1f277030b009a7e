"""The tolerance search's shared pieces: the bisection for the most products lowered whose output error stays within
it, and the bound on a new batch's error that judges a trial."""

import math

from amppass.analysis.tolerance import BOUND_SPREADS, batch_bound, longest_within


def test_longest_within_finds_the_last_count_that_holds_and_never_asks_zero():
    for count in range(0, 12):
        for edge in range(0, count + 1):
            asked = []

            def within(k, edge=edge, asked=asked):
                asked.append(k)
                return k <= edge

            assert longest_within(count, within) == edge
            assert 0 not in asked and len(asked) <= 1 + max(count - 1, 1).bit_length()


def test_batch_bound_adds_the_spread_of_the_batches_errors_and_never_falls_below_the_largest():
    errors = [0.010, 0.012, 0.014, 0.012]
    mean, deviation = 0.012, math.sqrt((0.002 ** 2 * 2) / 3)
    assert math.isclose(batch_bound(errors), mean + BOUND_SPREADS * deviation * math.sqrt(1 + 1 / 4))
    assert batch_bound(errors) > max(errors)
    assert batch_bound([0.02, 0.02, 0.02]) == 0.02  # no spread: the largest
    assert batch_bound([0.015]) == 0.015 and batch_bound([]) == 0.0  # one batch shows no spread
    assert batch_bound([0.0, 0.0, 1.0], spreads=0.0) == 1.0  # a bound below the largest error is the largest
