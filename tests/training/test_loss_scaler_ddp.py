"""LossScaler across two CPU processes (gloo): DDP, FSDP2, and a scaler used on one rank only.

The found-inf all-reduce happens where ranks' gradients can differ and never where a rank may be absent:
sharded DTensor gradients agree over their mesh once per step; DDP's gradients are equal on every rank already;
``process_group=`` asks for the all-reduce explicitly.
"""

from __future__ import annotations

import contextlib
import functools
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from amppass.training.loss_scaler import LossScaler
from tests.helpers.ddp_harness import one_rank_group, params, run_ranks, same, train_steps

INIT_SCALE = 2.0**10
TIMEOUT_S = 60  # each run takes a few seconds; this only stops a hang


def _train(rank: int, scaler, poison_rank1: str | None = None, steps: int = 1) -> dict:
    """Train a fresh DDP model; on the last step optionally poison rank 1 only; return what happened."""
    torch.manual_seed(0)  # the same initial weights on both ranks (DDP broadcasts them anyway)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return train_steps(model, opt, scaler, rank, steps, poison_rank1)


class _Cast(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


def _count_collectives(fn) -> int:
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comms:
        fn()
    return comms.get_total_counts()


def _fsdp2(rank: int, make_scaler, poison_rank1: bool) -> dict:
    """FSDP2 (fully_shard per layer, then the root) on a model whose gradients come in two dtypes and two
    optimizer parameter groups; three steps, the last optionally poisoned in rank 1's shard only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), _Cast(torch.bfloat16), nn.Linear(8, 8).bfloat16(), _Cast(torch.float32),
                          nn.Linear(8, 1))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam([{"params": model[0].parameters()},
                            {"params": list(model[2].parameters()) + list(model[4].parameters()), "lr": 1e-3}],
                           lr=1e-2)
    scaler = make_scaler()
    torch.manual_seed(100 + rank)
    record: dict = {"scales": [], "collectives": []}
    for step in range(3):
        record["before"] = [p.to_local().clone() for p in model.parameters()]
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1))).backward()
        if poison_rank1 and rank == 1 and step == 2:
            model[0].weight.grad.to_local()[0, 0] = float("inf")
        record["grad_types"] = {type(p.grad).__name__ for p in model.parameters()}
        record["collectives"].append(_count_collectives(lambda: (scaler.step(opt), scaler.update())))
        record["scales"].append(scaler.get_scale())
    record["after"] = [p.to_local().clone() for p in model.parameters()]
    return record


def _rank_results(rank: int) -> dict:
    """What one rank records: its runs by case."""
    world = dist.group.WORLD
    return {
        "clean": _train(rank, LossScaler(init_scale=INIT_SCALE), steps=3),
        # DDP's all-reduce spreads rank 1's inf to rank 0: both skip without a collective of the scaler's.
        "loss_overflow": _train(rank, LossScaler(init_scale=INIT_SCALE), "loss", steps=3),
        # An inf written after DDP's all-reduce is rank 1's alone: agreeing needs process_group=.
        "grad_overflow_group": _train(rank, LossScaler(init_scale=INIT_SCALE, process_group=world), "grad", steps=3),
        # The default group spelt "world", looked up at each step.
        "grad_overflow_world": _train(rank, LossScaler(init_scale=INIT_SCALE, process_group="world"), "grad", steps=3),
        "grad_overflow_default": _train(rank, LossScaler(init_scale=INIT_SCALE), "grad", steps=3),
        "grad_overflow_grad_scaler": _train(rank, torch.amp.GradScaler("cpu", init_scale=INIT_SCALE), "grad", steps=3),
        "fsdp2": _fsdp2(rank, lambda: LossScaler(init_scale=INIT_SCALE), poison_rank1=True),
        "fsdp2_grad_scaler": _fsdp2(rank, lambda: torch.amp.GradScaler("cpu", init_scale=INIT_SCALE),
                                    poison_rank1=True),
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("ddp")
    return run_ranks(_rank_results, out_dir, TIMEOUT_S)


def test_clean_training_steps_and_keeps_ranks_identical(ranks):
    rank0, rank1 = ranks[0]["clean"], ranks[1]["clean"]
    assert rank0["scales"] == rank1["scales"] == [INIT_SCALE] * 3
    assert not same(rank0["before"], rank0["after"])
    assert same(rank0["after"], rank1["after"])


@pytest.mark.parametrize("case", ["loss_overflow", "grad_overflow_group", "grad_overflow_world"])
def test_overflow_on_rank1_skips_the_step_on_both_ranks(ranks, case):
    rank0, rank1 = ranks[0][case], ranks[1][case]
    for record in (rank0, rank1):
        assert record["scales"] == [INIT_SCALE, INIT_SCALE, INIT_SCALE / 2]
        assert same(record["after"], record["before"])  # the poisoned step was skipped
        for param in record["after"]:
            assert torch.isfinite(param).all()
    assert same(rank0["after"], rank1["after"])


@pytest.mark.parametrize("case", ["grad_overflow_default", "grad_overflow_grad_scaler"])
def test_by_default_an_inf_after_ddp_reduced_is_the_rank_own_as_with_grad_scaler(ranks, case):
    """Without process_group= LossScaler adds no collective to DDP, as GradScaler: rank 0 steps, rank 1 skips."""
    rank0, rank1 = ranks[0][case], ranks[1][case]
    assert same(rank1["after"], rank1["before"])
    assert not same(rank0["after"], rank0["before"])
    assert rank0["scales"][-1] == INIT_SCALE and rank1["scales"][-1] == INIT_SCALE / 2


def test_fsdp2_agrees_on_a_shard_overflow_with_one_all_reduce_per_step(ranks):
    rank0, rank1 = ranks[0]["fsdp2"], ranks[1]["fsdp2"]
    assert rank0["grad_types"] == {"DTensor"}
    for record in (rank0, rank1):
        assert record["collectives"] == [1, 1, 1]  # two dtypes, two parameter groups: still one
        assert record["scales"] == [INIT_SCALE, INIT_SCALE, INIT_SCALE / 2]
        assert all(torch.equal(a, b) for a, b in zip(record["after"], record["before"], strict=False))  # both skipped
    # GradScaler leaves it to DTensor's handler of the unscale kernel: one all-reduce per (device, dtype) batch.
    assert ranks[0]["fsdp2_grad_scaler"]["collectives"] == [2, 2, 2]
    assert ranks[0]["fsdp2_grad_scaler"]["scales"] == rank0["scales"]


def _one_rank_only(done_file: Path, rank: int) -> dict:
    """A process group exists, but only rank 0 trains (say, a small probe model) while rank 1 waits for a
    file, not a collective. An all-reduce in rank 0's scaler would wait for rank 1 until the group's timeout."""
    record: dict = {}
    if rank == 0:
        for name, scaler in (("grad_scaler", torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)),
                             ("loss_scaler", LossScaler(init_scale=INIT_SCALE))):
            torch.manual_seed(0)
            model = nn.Linear(4, 1)
            before = params(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for overflow in (False, True, False):
                opt.zero_grad()
                scaler.scale(model(torch.randn(8, 4)).sum() * (float("inf") if overflow else 1.0)).backward()
                scaler.step(opt)
                scaler.update()
            record[name] = {"scale": scaler.get_scale(), "trained": not same(before, params(model))}
        done_file.write_text("done")
    else:
        deadline = time.monotonic() + TIMEOUT_S
        while not done_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return record


def test_scaler_on_one_rank_finishes_like_grad_scaler(tmp_path):
    ranks = run_ranks(functools.partial(_one_rank_only, tmp_path / "done"), tmp_path, TIMEOUT_S)
    assert ranks[0]["loss_scaler"] == ranks[0]["grad_scaler"] == {"scale": INIT_SCALE / 2, "trained": True}


def test_process_group_must_be_a_group():
    with pytest.raises(ValueError, match="process_group='mesh' is not a torch.distributed process group.* 'world'"):
        LossScaler(process_group="mesh")


# ---------------------------------------------------------------- a scaler built before init_process_group


@pytest.fixture
def init_later():
    """Call the returned function to start a one-rank gloo group in this process; destroyed after the test."""
    with contextlib.ExitStack() as stack:
        yield lambda: stack.enter_context(one_rank_group())


def _one_step_all_reduces(scaler: LossScaler, monkeypatch) -> list:
    """One scaled step of a one-parameter model; the groups the scaler all-reduced its overflow flag over."""
    param = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    groups = []
    real = dist.all_reduce

    def recording(tensor, *args, group=None, **kwargs):
        groups.append(group)
        return real(tensor, *args, group=group, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", recording)
    scaler.scale(param.sum()).backward()
    scaler.step(opt)
    scaler.update()
    return groups


def test_group_world_given_before_init_raises_instead_of_dropping_the_all_reduce(init_later, monkeypatch):
    assert dist.group.WORLD is None  # what the user passes before init_process_group
    scaler = LossScaler(process_group=dist.group.WORLD)
    init_later()
    with pytest.raises(RuntimeError, match=r"built before torch.distributed.init_process_group.*process_group='world'"):
        _one_step_all_reduces(scaler, monkeypatch)


def test_world_spelling_given_before_init_all_reduces_over_the_default_group(init_later, monkeypatch):
    scaler = LossScaler(process_group="world")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        _one_step_all_reduces(scaler, monkeypatch)
    init_later()
    scaler = LossScaler(process_group="world")
    assert _one_step_all_reduces(scaler, monkeypatch) == [dist.group.WORLD]


def test_default_and_none_after_init_add_no_collective(init_later, monkeypatch):
    left_out = LossScaler()  # built before init: the default needs no group
    init_later()
    assert _one_step_all_reduces(left_out, monkeypatch) == []
    assert _one_step_all_reduces(LossScaler(process_group=None), monkeypatch) == []  # None after init: unambiguous
