"""The checkpoint rules of :mod:`amppass.analysis.checkpoints` against a tiny front end of its own
(:mod:`tests.helpers.chain_front_end`): a chain of numpy ops, each reading the value before it, whose trial
plans round some ops' outputs to fp16."""

from __future__ import annotations

import numpy as np

from amppass.analysis import checkpoints
from amppass.analysis.checkpoints import CHECKPOINTS, Checkpoints, place
from tests.helpers.chain_front_end import OPS, Chain, run_from


def _batches(count: int = 3) -> list[np.ndarray]:
    """``count`` batches of 64 values in (0.1, 1), where every op of the chain is defined."""
    rng = np.random.default_rng(0)
    return [rng.uniform(0.1, 1.0, 64).astype(np.float32) for _ in range(count)]


def test_placement_spreads_at_most_the_limit_evenly_over_the_candidates():
    assert place(list("abcde")) == list("abcde")
    spread = place(list(range(40)))
    assert len(spread) == CHECKPOINTS and spread[:3] == [1, 3, 5], "every second candidate, from the middle of a step"
    assert place(list(range(100))) == list(range(3, 100, 6))[:CHECKPOINTS]


def test_a_trial_resumes_from_the_last_checkpoint_at_or_before_its_first_change():
    chain = Chain([1, 3, 5])
    for batch, x in enumerate(_batches()):
        chain.record(batch, x)
    cases = {frozenset(): 5, frozenset({7}): 5, frozenset({5, 6}): 5, frozenset({4}): 3, frozenset({3, 6}): 3,
             frozenset({2}): 1, frozenset({0, 6}): None}
    for low, start in cases.items():
        assert chain.cut((i not in low for i in range(len(OPS))), {i: i for i in chain.order}) == start, sorted(low)
        assert chain.resume(0, start) == start


def test_the_cut_reads_the_trial_only_up_to_its_first_change():
    read = []

    def unchanged():
        for i in range(len(OPS)):
            read.append(i)
            yield i != 4

    assert Chain([1, 3, 5]).cut(unchanged(), {1: 1, 3: 3, 5: 5}) == 3
    assert read == [0, 1, 2, 3, 4], "no node after the first change is compared"


def test_a_checkpoint_the_trial_lost_is_never_its_cut():
    chain = Chain([1, 3, 5])
    assert chain.cut(iter([True] * 8), {1: 1, 5: 6}) == 5  # checkpoint 3 is no node of this trial
    assert chain.cut(iter([True] * 8), {1: 1, 3: 2, 5: 9}) == 3  # the trial grew: 5 now stands past its end


def test_runs_from_checkpoints_give_the_whole_trials_outputs_and_count_what_they_skip():
    chain, batches = Chain([1, 3, 5]), _batches()
    references = [chain.record(batch, x) for batch, x in enumerate(batches)]
    for low in ({4, 6}, {0}, set(), {6, 7}):
        for batch, x in enumerate(batches):
            assert np.array_equal(chain.run(low, batch, x), run_from(0, low, x)), sorted(low)
    assert np.array_equal(chain.run(set(), 0, batches[0]), references[0]), "no change: the fp32 run itself"
    assert (chain.nodes_skipped, chain.nodes_run) == (3 * (3 + 0 + 5 + 5) + 5, 3 * (5 + 8 + 3 + 3) + 3)


def test_resuming_after_the_first_change_would_miss_it():
    """Why rule 3 stops at the first change: a run from a later checkpoint reads fp32 values the trial changes."""
    chain, x = Chain([1, 3, 5]), _batches(1)[0]
    chain.record(0, x)
    low = {2}
    whole = run_from(0, low, x)
    assert np.array_equal(chain.run(low, 0, x), whole)
    assert not np.array_equal(run_from(3, low, chain.values[0][3]["in"]), whole)


def test_the_budget_is_shared_over_batches_and_counts_a_value_once_per_batch(monkeypatch):
    monkeypatch.setattr(checkpoints, "CACHE_BYTES", 100)
    kept = Checkpoints(["a", "b", "c", "d"])
    assert kept.keep(0, "a", {"v": 1}, {"v": 60})
    assert kept.keep(0, "b", {"v": 1, "w": 2}, {"v": 60, "w": 30}), "v is kept for batch 0 already: 30 new bytes"
    assert kept.bytes == 90
    assert not kept.keep(0, "c", {"u": 3}, {"u": 20}), "90 + 20 passes 100"
    assert kept.keep(0, "d", {"w": 2, "t": 4}, {"w": 30, "t": 10}), "a later checkpoint that fits is still kept"
    assert not kept.keep(1, "a", {"v": 5}, {"v": 60}), "batch 1's v is another value, and the budget is spent"
    assert kept.bytes == 100 and list(kept.values) == [0] and list(kept.values[0]) == ["a", "b", "d"]
    assert kept.resume(0, "c") == "b" and kept.resume(1, "d") is None and kept.resume(0, None) is None


def test_a_batch_beyond_the_budget_runs_whole_while_the_others_resume(monkeypatch):
    monkeypatch.setattr(checkpoints, "CACHE_BYTES", 2 * 64 * 4 + 64 * 4)
    chain, batches = Chain([1, 3, 5]), _batches()
    for batch, x in enumerate(batches):
        chain.record(batch, x)
    assert {b: list(c) for b, c in chain.values.items()} == {0: [1, 3, 5]}, "three values of 256 bytes fit"
    low = {6}
    for batch, x in enumerate(batches):
        assert np.array_equal(chain.run(low, batch, x), run_from(0, low, x))
    assert (chain.nodes_skipped, chain.nodes_run) == (5, 3 + 8 + 8)
