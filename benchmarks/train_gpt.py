"""Training a character-level GPT-2 on real text: fp32, torch.autocast + GradScaler, amppass eager and compiled.

The text is the Python standard library's own source (:mod:`models.char_gpt`, about 13 M characters, the
last 5% held out); the model a GPT-2 over 128 characters with tied embedding and output weights, built from
one seed. Every variant starts from the same weights and reads the same batches; they take turns, one step
each, so load from other processes falls on all of them alike. Dropout is off so the variants differ by
their arithmetic only.

``run(quick)`` returns two tables:

- one row per variant: held-out loss (nats per character) at fixed steps, the mean training loss of the
  last steps, steps the loss scaler skipped (its scale went down), median step time and its ratio to fp32's
  and to autocast fp16's, peak memory of one step (torch CPU allocations, profiler memory events) and the
  bytes autograd saved for backward in one forward (each storage once);
- FSDP2 on two processes (gloo, loopback): the amppass fp16 model (``plan_for='coverage'``, so it is a converted
  model on any CPU) with ``fully_shard`` on each block and on the root, trained on halves of the batches one
  process trains on whole; held-out loss in eval mode after training on each rank against the single process's
  (``--full`` only: two processes each importing torch and converting are no smoke test).

The amppass rows use the default ``plan_for='speed'``, and one more bf16 row ``plan_for='coverage'``; the
``trained`` column says what each row trained in (on a CPU without bf16/fp16 instructions the default plan keeps
the model fp32, which the warning amppass logs says: :mod:`benchmarks.train_common`).

``python -m benchmarks.train_gpt [--quick]`` prints both; ``python -m benchmarks run --full --only train_gpt``
writes them into RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.multiprocessing as mp
from torch import nn

import amppass
from models.char_gpt import char_gpt, next_char_loss, stdlib_corpus, train_steps

from .latency import peak_alloc_bytes
from .train_common import threads, watched

log = logging.getLogger(__name__)

NOTES = ("Columns: `trained` what the row trained in (read from the warning amppass logs where profitability's "
         "device rule keeps a train-mode plan for speed fp32: the default plan on a CPU without bf16/fp16 "
         "instructions; the `coverage` row trains bf16 on any CPU); `held@N` held-out loss (nats/char, eval "
         "mode, the same held-out batches) after N steps; "
         "`train_loss_last` mean training loss of the last 10% of steps; `skipped` steps the loss scaler skipped; "
         "`step_ms` median step time (forward, scaled backward, optimizer step, scale update; the first steps of "
         "compiled variants excluded); `vs_fp32` / `vs_autocast_fp16` step time ratios (below 1: faster); "
         "`peak_MB` high-water mark of torch CPU allocations during one step; `saved_MB` bytes autograd saved for "
         "backward in one forward. FSDP2 table: held-out loss after training in eval mode, each rank against one "
         "process training on the whole batches; `param_MB` parameter storage the process holds after sharding "
         "(its shards and any whole copy).")


@dataclass(frozen=True)
class Setting:
    """The model and the run."""

    layers: int
    width: int
    heads: int
    block: int
    batch: int
    steps: int
    evals: int  # held-out evaluations, evenly spaced
    text: int | None  # characters of the standard library's source read (None: all)
    lr: float = 3e-3

    def describe(self) -> str:
        return (f"GPT-2 {self.layers} layers x {self.width}, {self.heads} heads, {self.block} characters, batch "
                f"{self.batch}, {self.steps} AdamW steps (lr {self.lr})")


QUICK = Setting(layers=1, width=32, heads=2, block=32, batch=4, steps=4, evals=1, text=100_000)
FULL = Setting(layers=4, width=256, heads=8, block=256, batch=16, steps=300, evals=3, text=None)


@dataclass
class Variant:
    """One way of training the model, with what it recorded."""

    name: str
    model: nn.Module
    scaler: Any
    context: Callable[[], Any]
    compiled: bool = False
    trained: str = "fp32"  # what it trains in (a compiled variant's is known at its first step)
    opt: torch.optim.Optimizer | None = None
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    held: dict[int, float] = field(default_factory=dict)
    skipped: int = 0


def _variants(setting: Setting, example: torch.Tensor, quick: bool) -> list[Variant]:
    """Every variant, each from the same initial weights."""
    def fresh() -> nn.Module:
        return char_gpt(setting.layers, setting.width, setting.heads, setting.block, dropout=0.0, seed=0)

    def autocast(dtype):
        return lambda: torch.autocast("cpu", dtype=dtype)

    def converted(name: str, dtype: torch.dtype, scaler: Any, plan_for: str = "speed") -> Variant:
        with watched() as rule:
            model = amppass.convert(fresh(), (example,), dtype=dtype, mode="train", plan_for=plan_for)
        return Variant(name, model, scaler, off, trained=rule.trained(str(dtype).removeprefix("torch.")))

    off = contextlib.nullcontext
    found = [
        Variant("fp32", fresh(), amppass.LossScaler(enabled=False), off),
        Variant("autocast fp16 + GradScaler", fresh(), torch.amp.GradScaler("cpu"), autocast(torch.float16),
                trained="float16 (autocast)"),
        converted("amppass bf16", torch.bfloat16, amppass.LossScaler(dtype=torch.bfloat16)),
    ]
    if not quick:  # a smoke run trains one of each kind; a capture (coverage) and inductor's compile of a train
        # graph are no smoke test (the training-step section's quick run converts its small CNN with coverage)
        found[2:2] = [Variant("autocast bf16", fresh(), amppass.LossScaler(enabled=False), autocast(torch.bfloat16),
                              trained="bfloat16 (autocast)"),
                      converted("amppass fp16 + LossScaler", torch.float16, amppass.LossScaler())]
        found.append(converted("amppass bf16 coverage", torch.bfloat16, amppass.LossScaler(dtype=torch.bfloat16),
                               "coverage"))
        found.append(Variant("amppass fp16 compiled + LossScaler",
                             torch.compile(fresh(), backend="amppass", options={"mode": "train",
                                                                                "dtype": torch.float16}),
                             amppass.LossScaler(), off, compiled=True, trained="float16"))
        found.append(Variant("autocast fp16 compiled (inductor) + GradScaler", torch.compile(fresh()),
                             torch.amp.GradScaler("cpu"), autocast(torch.float16), compiled=True,
                             trained="float16 (autocast)"))
    for variant in found:
        variant.opt = torch.optim.AdamW(variant.model.parameters(), lr=setting.lr)
    return found


def _step(variant: Variant, batch: torch.Tensor) -> float:
    """One training step; returns the loss."""
    variant.opt.zero_grad(set_to_none=True)
    with variant.context():
        loss = next_char_loss(variant.model(batch[:, :-1]).logits, batch[:, 1:])
    scale = variant.scaler.get_scale()
    variant.scaler.scale(loss).backward()
    variant.scaler.step(variant.opt)
    variant.scaler.update()
    variant.skipped += variant.scaler.get_scale() < scale
    return loss.item()


def _held_out(variant: Variant, batches: list[torch.Tensor]) -> float:
    variant.model.eval()
    with torch.no_grad(), variant.context():
        losses = [next_char_loss(variant.model(b[:, :-1]).logits, b[:, 1:]).item() for b in batches]
    variant.model.train()
    return statistics.fmean(losses)


def _saved_bytes(variant: Variant, batch: torch.Tensor) -> int:
    """Bytes autograd holds for backward after one forward, each storage counted once."""
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), variant.context():
        variant.model(batch[:, :-1])
    return sum(seen.values())


def single_process(setting: Setting, quick: bool) -> list[dict[str, Any]]:
    """Train every variant in turns; one row each."""
    corpus = stdlib_corpus(setting.text)
    data = torch.Generator().manual_seed(1)
    batches = [corpus.batch(data, setting.batch, setting.block) for _ in range(setting.steps)]
    held = [corpus.batch(torch.Generator().manual_seed(2), setting.batch, setting.block, held_out=True)
            for _ in range(2 if quick else 8)]
    variants = _variants(setting, batches[0][:, :-1], quick)
    marks = {round(setting.steps * (i + 1) / setting.evals) for i in range(setting.evals)}
    warmup = 3
    for step, batch in enumerate(batches, 1):
        for variant in variants:
            start = time.perf_counter()
            if step == 1 and variant.compiled and variant.name.startswith("amppass"):  # planned at the first call
                with watched() as rule:
                    variant.losses.append(_step(variant, batch))
                variant.trained = rule.trained(variant.trained)
            else:
                variant.losses.append(_step(variant, batch))
            if step > warmup or not variant.compiled:
                variant.times.append(time.perf_counter() - start)
            if step in marks:
                variant.held[step] = _held_out(variant, held)
        log.info("step %d/%d: %s", step, setting.steps, ", ".join(f"{v.name} {v.losses[-1]:.3f}" for v in variants))
    median = {v.name: statistics.median(v.times) for v in variants}
    tail = max(1, setting.steps // 10)
    rows = []
    for variant in variants:
        row: dict[str, Any] = {"variant": variant.name, "trained": variant.trained}
        row.update({f"held@{s}": f"{variant.held[s]:.4f}" for s in sorted(marks)})  # 4 decimals, as strings:
        row.update({  # the table would round floats to 3 significant digits
            "train_loss_last": f"{statistics.fmean(variant.losses[-tail:]):.4f}",
            "skipped": variant.skipped,
            "step_ms": round(median[variant.name] * 1e3, 2),
            "vs_fp32": round(median[variant.name] / median["fp32"], 3),
            "vs_autocast_fp16": round(median[variant.name] / median["autocast fp16 + GradScaler"], 3),
            "peak_MB": round(peak_alloc_bytes(lambda v=variant: _step(v, batches[-1])) / 2**20, 1),
            "saved_MB": round(_saved_bytes(variant, batches[-1]) / 2**20, 1),
        })
        rows.append(row)
    return rows


# ---------------------------------------------------------------- FSDP2 on two processes


def _fsdp_recipe(setting: Setting, rank: int | None, world: int) -> dict[str, float]:
    """Convert (fp16, train mode), shard per block and on the root when ``rank`` is given, train, evaluate."""
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    steps = max(4, setting.steps // 4)
    corpus = stdlib_corpus(setting.text)
    data = torch.Generator().manual_seed(1)
    batches = [corpus.batch(data, setting.batch, setting.block) for _ in range(steps)]
    held = corpus.batch(torch.Generator().manual_seed(2), setting.batch, setting.block, held_out=True)
    net = char_gpt(setting.layers, setting.width, setting.heads, setting.block, dropout=0.0, seed=0)
    model = amppass.convert(net, (batches[0][:, :-1],), dtype=torch.float16, mode="train", plan_for="coverage")
    if rank is not None:
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
    held_bytes = _param_bytes(model)
    opt = torch.optim.AdamW(model.parameters(), lr=setting.lr, foreach=False)
    scaler = amppass.LossScaler()
    start = time.perf_counter()
    train_steps(model, batches, opt, scaler, None if rank is None else (rank, world))
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        after = next_char_loss(model(held[:, :-1]).logits, held[:, 1:]).item()
    return {"steps": steps, "held_after": after, "train_s": seconds, "param_bytes": held_bytes}


def _param_bytes(model: nn.Module) -> int:
    """Bytes of parameter storage the process holds: the tree's parameters (this rank's shards, under FSDP2)
    and any whole copy the flat graphs keep (each storage once)."""
    from torch.distributed.tensor import DTensor

    tensors = list(model.parameters()) + [t for g in (model.train_graph, model.eval_graph) for t in g.parameters()]
    storages = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if not local.is_meta:
            storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def _rank(rank: int, setting: Setting, port: int, out: str, world: int) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    try:
        torch.save(_fsdp_recipe(setting, rank, world), os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def fsdp(setting: Setting, world: int = 2, timeout_s: float = 1800) -> list[dict[str, Any]]:
    """The sharded run on ``world`` processes against one process; one row each."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    threads = torch.get_num_threads()
    try:
        single = _fsdp_recipe(setting, None, world)  # one thread, as each rank has
    finally:
        torch.set_num_threads(threads)  # later sections of the run keep the machine's threads
    with tempfile.TemporaryDirectory() as out:
        context = mp.spawn(_rank, args=(setting, port, out, world), nprocs=world, join=False)
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"the {world}-process FSDP2 run did not finish within {timeout_s:.0f} s")
        ranks = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]
    rows = [{"run": "1 process, whole batches", "steps": single["steps"], "held_after": f"{single['held_after']:.5f}",
             "diff_vs_1_process": 0.0, "train_s": round(single["train_s"], 1),
             "param_MB": round(single["param_bytes"] / 2**20, 2)}]
    for r, found in enumerate(ranks):
        rows.append({"run": f"FSDP2 per block + root, rank {r} of {world}", "steps": found["steps"],
                     "held_after": f"{found['held_after']:.5f}",
                     "diff_vs_1_process": round(found["held_after"] - single["held_after"], 5),
                     "train_s": round(found["train_s"], 1), "param_MB": round(found["param_bytes"] / 2**20, 2)})
    return rows


def run(quick: bool) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """(what was trained, the per-variant table, the FSDP2 table)."""
    setting = QUICK if quick else FULL
    if quick:
        with threads(quick):
            rows = single_process(setting, quick)
        return setting.describe(), rows, [{"run": "skipped in --quick (`python -m benchmarks run --full --only "
                                                  "train_gpt` runs it)"}]
    return setting.describe(), single_process(setting, quick), fsdp(setting)


def main() -> None:
    """Run and print both tables."""
    from .results import markdown_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model for a few steps (a smoke test)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    described, rows, sharded = run(args.quick)
    print(described)
    print(markdown_table(rows))
    print(markdown_table(sharded))


if __name__ == "__main__":
    main()
