"""Shared harness for the 2-process DistributedDataParallel tests: gloo on loopback, a hard deadline."""

from __future__ import annotations

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
from torch import nn

WORLD_SIZE = 2


def params(model: nn.Module) -> list[torch.Tensor]:
    """Detached copies of the model's parameters."""
    return [p.detach().clone() for p in model.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether two parameter lists are bit-identical."""
    return all(torch.equal(x, y) for x, y in zip(a, b))


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
