"""A train-mode converted model under DistributedDataParallel: two CPU processes (gloo) train with LossScaler."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import amppass
from tests.helpers.ddp_harness import run_ranks, same, train_steps

INIT_SCALE = 2.0**10
STEPS = 3
TIMEOUT_S = 120  # a run takes ~10 s (two captures per rank); this only stops a hang


def _train(rank: int, poison_rank1: str | None) -> dict:
    """Convert, wrap in DDP and train STEPS steps; on the last one optionally poison rank 1 only."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 1))
    converted = amppass.convert(net, (torch.randn(8, 4),), dtype=torch.float16, mode="train", plan_for="coverage")
    model = DistributedDataParallel(converted)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    # process_group: the "grad" case writes an inf after DDP's all-reduce, on rank 1 only
    scaler = amppass.LossScaler(init_scale=INIT_SCALE, process_group=dist.group.WORLD)
    record = train_steps(model, opt, scaler, rank, STEPS, poison_rank1)
    record["param_dtypes"] = {p.dtype for p in model.parameters()}
    record["running_mean"] = converted.state_dict()["1.running_mean"].clone()
    return record


def _rank_results(rank: int) -> dict:
    """What one rank records: its runs by case."""
    torch.set_num_threads(1)
    return {case: _train(rank, case) for case in (None, "loss", "grad")}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("ddp_train")
    return run_ranks(_rank_results, out_dir, TIMEOUT_S)


def test_converted_model_trains_under_ddp_with_fp32_master_state(ranks):
    rank0, rank1 = ranks[0][None], ranks[1][None]
    assert rank0["scales"] == rank1["scales"] == [INIT_SCALE] * STEPS
    assert rank0["param_dtypes"] == rank0["grad_dtypes"] == {torch.float32}
    assert not same(rank0["before"], rank0["after"])
    assert same(rank0["after"], rank1["after"])  # gradients averaged: ranks stay identical
    assert not torch.equal(rank0["running_mean"], torch.zeros(16))  # batch norm ran in train mode


@pytest.mark.parametrize("case", ["loss", "grad"])
def test_overflow_on_rank1_only_skips_the_step_on_both_ranks(ranks, case):
    rank0, rank1 = ranks[0][case], ranks[1][case]
    for record in (rank0, rank1):
        assert record["scales"] == [INIT_SCALE] * (STEPS - 1) + [INIT_SCALE / 2]
        assert same(record["after"], record["before"])
        assert all(torch.isfinite(p).all() for p in record["after"])
    assert same(rank0["after"], rank1["after"])
