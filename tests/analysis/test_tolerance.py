"""The tolerance search's shared bisection: the most products lowered whose output error stays within it."""

from amppass.analysis.tolerance import longest_within


def test_longest_within_finds_the_last_count_that_holds_and_never_asks_zero():
    for count in range(0, 12):
        for edge in range(0, count + 1):
            asked = []

            def within(k, edge=edge, asked=asked):
                asked.append(k)
                return k <= edge

            assert longest_within(count, within) == edge
            assert 0 not in asked and len(asked) <= 1 + max(count - 1, 1).bit_length()
