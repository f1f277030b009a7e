"""Shared harness for the 2-process DistributedDataParallel tests: gloo on loopback, a hard deadline."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

WORLD_SIZE = 2


def params(model: nn.Module) -> list[torch.Tensor]:
    """Detached copies of the model's parameters."""
    return [p.detach().clone() for p in model.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether two parameter lists are bit-identical."""
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=False))


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, scaler, rank: int, steps: int,
                poison_rank1: str | None) -> dict:
    """Train ``model`` (DDP-wrapped) ``steps`` steps on this rank's own random data with ``scaler``; on the
    last step optionally poison rank 1 only: "loss" (DDP's all-reduce spreads the inf to rank 0) or "grad"
    (after the all-reduce, so only rank 1 sees it, as with sharded FSDP/ZeRO gradients).

    Returns the scales after each step, the parameters before the last step and after it, and the
    gradient dtypes seen.
    """
    torch.manual_seed(100 + rank)  # each rank its own data
    record: dict = {"scales": [], "grad_dtypes": set()}
    for step in range(steps):
        poison = poison_rank1 if (rank == 1 and step == steps - 1) else None
        record["before"] = params(model)
        opt.zero_grad()
        loss = F.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1))
        if poison == "loss":
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if poison == "grad":
            next(model.parameters()).grad[0, 0] = float("inf")
        record["grad_dtypes"] |= {p.grad.dtype for p in model.parameters()}
        scaler.step(opt)
        scaler.update()
        record["scales"].append(scaler.get_scale())
    record["after"] = params(model)
    return record


@contextlib.contextmanager
def one_rank_group():
    """A one-process gloo group in this process (an in-memory store, no port), destroyed on the way out."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, body: Callable[[int], dict], port: int, out_dir: str, timeout_s: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=timeout_s))
    try:
        torch.save(body(rank), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(body: Callable[[int], dict], out_dir: Path, timeout_s: int) -> list[dict]:
    """Run module-level ``body(rank)`` in WORLD_SIZE processes; return each rank's result dict.

    Fails the test (killing the workers) if the run does not finish within ``timeout_s``.
    """
    context = mp.spawn(_rank_main, args=(body, _free_port(), str(out_dir), timeout_s), nprocs=WORLD_SIZE, join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):  # raises if a worker raised
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {WORLD_SIZE}-process DDP run did not finish within {timeout_s} s")
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD_SIZE)]
