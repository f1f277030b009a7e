"""The dynamic-padding benchmark's rounds: every variant trains the same K steps per round, one at a time, the order
rotated each round, each turn timed on its own (a stub Trainer stands for transformers' here)."""

import pytest

from benchmarks.dynamic_padding import Paced

STEPS, PER_ROUND = 6, 2


def _stub(log: list[str], fail: bool = False):
    def build(paced: Paced):
        if fail:
            raise ValueError("no Trainer (this test)")

        class Trainer:
            def train(self) -> None:
                for step in range(1, STEPS + 1):
                    log.append(f"{paced.name}{step}")
                    paced.pause(step, STEPS)

        return Trainer()

    return build


def test_variants_take_turns_round_by_round_in_rotated_order():
    log: list[str] = []
    variants = [Paced(name, _stub(log), PER_ROUND) for name in "ab"]
    for round_index in range(STEPS // PER_ROUND):
        shift = round_index % len(variants)
        for paced in variants[shift:] + variants[:shift]:
            paced.turn()
    assert log == ["a1", "a2", "b1", "b2", "b3", "b4", "a3", "a4", "a5", "a6", "b5", "b6"]
    for paced in variants:
        paced.thread.join(timeout=10)
        assert not paced.thread.is_alive() and len(paced.wall) == len(paced.cpu) == STEPS // PER_ROUND
        assert all(seconds >= 0 for seconds in paced.wall + paced.cpu)


def test_a_variant_that_fails_raises_in_the_callers_turn():
    paced = Paced("broken", _stub([], fail=True), PER_ROUND)
    with pytest.raises(ValueError, match="no Trainer"):
        paced.turn()
