"""FSDP2: a converted fp16 training model sharded with fully_shard, on two CPU processes (gloo).

The converted model has the original's module tree, each block an instance of its original class, so FSDP2's
usual pattern (``fully_shard`` on each block, then on the root) finds the blocks as it would on the original.
Leave ``MixedPrecisionPolicy(param_dtype=...)`` unset: amppass's casts do the low-precision work. The loss
scaler's skip decision is agreed across ranks with one all-reduce per step. Each rank trains on its half of
every batch; on a machine with GPUs, launch the same ``run(rank, world)`` with torchrun and NCCL instead.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard

import amppass
from models.char_gpt import char_gpt, next_char_loss, stdlib_corpus

WORLD, STEPS, BATCH, BLOCK = 2, 8, 8, 32


def run(rank: int, world: int) -> None:
    """Convert, shard, train STEPS loss-scaled steps on this rank's half of each batch, report from rank 0."""
    torch.set_num_threads(1)
    corpus, generator = stdlib_corpus(200_000), torch.Generator().manual_seed(0)   # the same batches on every rank
    batches = [corpus.batch(generator, BATCH, BLOCK) for _ in range(STEPS)]
    held_out = corpus.batch(generator, 4 * BATCH, BLOCK, held_out=True)
    net = char_gpt(layers=2, width=64, heads=4, block=BLOCK, dropout=0.0)
    model = amppass.convert(net, (batches[0][:, :-1],), dtype=torch.float16, mode="train", plan_for="coverage")
    for block in model.transformer.h:            # instances of GPT2Block, as in the original
        fully_shard(block)
    fully_shard(model)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = amppass.LossScaler(init_scale=2.0**10)
    for batch in batches:
        mine = batch.chunk(world)[rank]
        optimizer.zero_grad()
        loss = next_char_loss(model(mine[:, :-1]).logits, mine[:, 1:])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    model.eval()
    with torch.no_grad():
        held = next_char_loss(model(held_out[:, :-1]).logits, held_out[:, 1:]).item()
    if rank == 0:
        print(f"{world} ranks, {STEPS} steps: last training loss {loss.item():.3f}, held-out loss {held:.3f} "
              f"(random: {torch.log(torch.tensor(128.0)).item():.3f}), loss scale {scaler.get_scale():g}")
        assert held < 3.5


def _rank(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        run(rank, world)
    finally:
        dist.destroy_process_group()


def main() -> None:
    with socket.socket() as sock:                # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_rank, args=(WORLD, port), nprocs=WORLD)


if __name__ == "__main__":
    main()
