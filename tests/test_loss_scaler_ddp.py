"""LossScaler under DistributedDataParallel: two CPU processes (gloo) agree on every skipped step."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from amppass.training.loss_scaler import LossScaler
from tests.ddp_harness import run_ranks, same, train_steps

INIT_SCALE = 2.0**10
TIMEOUT_S = 60  # the whole run takes a few seconds; this only stops a hang


def _train(rank: int, scaler: LossScaler, poison_rank1: str | None = None, steps: int = 1) -> dict:
    """Train a fresh DDP model; on the last step optionally poison rank 1 only; return what happened."""
    torch.manual_seed(0)  # the same initial weights on both ranks (DDP broadcasts them anyway)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return train_steps(model, opt, scaler, rank, steps, poison_rank1)


def _rank_results(rank: int) -> dict:
    """What one rank records: its runs by case."""
    results = {
        "clean": _train(rank, LossScaler(init_scale=INIT_SCALE), steps=3),
        "loss_overflow": _train(rank, LossScaler(init_scale=INIT_SCALE), "loss", steps=3),
        "grad_overflow": _train(rank, LossScaler(init_scale=INIT_SCALE), "grad", steps=3),
    }
    # Control: the same rank-1-only overflow without the found-inf all-reduce makes the ranks disagree.
    unsynced = LossScaler(init_scale=INIT_SCALE)
    unsynced._distributed = lambda: False
    results["grad_overflow_unsynced"] = _train(rank, unsynced, "grad", steps=3)
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("ddp")
    return run_ranks(_rank_results, out_dir, TIMEOUT_S)


def test_clean_training_steps_and_keeps_ranks_identical(ranks):
    rank0, rank1 = ranks[0]["clean"], ranks[1]["clean"]
    assert rank0["scales"] == rank1["scales"] == [INIT_SCALE] * 3
    assert not same(rank0["before"], rank0["after"])
    assert same(rank0["after"], rank1["after"])


@pytest.mark.parametrize("case", ["loss_overflow", "grad_overflow"])
def test_overflow_on_rank1_skips_the_step_on_both_ranks(ranks, case):
    rank0, rank1 = ranks[0][case], ranks[1][case]
    for record in (rank0, rank1):
        assert record["scales"] == [INIT_SCALE, INIT_SCALE, INIT_SCALE / 2]
        assert same(record["after"], record["before"])  # the poisoned step was skipped
        for param in record["after"]:
            assert torch.isfinite(param).all()
    assert same(rank0["after"], rank1["after"])


def test_without_the_all_reduce_ranks_would_diverge(ranks):
    """Shows the grad_overflow case tests the all-reduce: without it rank 0 steps while rank 1 skips."""
    rank0, rank1 = ranks[0]["grad_overflow_unsynced"], ranks[1]["grad_overflow_unsynced"]
    assert same(rank1["after"], rank1["before"])
    assert not same(rank0["after"], rank0["before"])
    assert not same(rank0["after"], rank1["after"])
    assert rank0["scales"][-1] == INIT_SCALE and rank1["scales"][-1] == INIT_SCALE / 2
