"""Training with amppass: step time against torch.autocast + GradScaler, and digits learning curves.

``run(quick)`` returns one dict per measurement:

- ``kind="step_time"``: median milliseconds per training step (forward, scaled backward, optimizer step,
  scale update) of the same model and batch in fp32, under ``torch.autocast`` (bf16, fp16) with
  ``torch.amp.GradScaler``, and converted by ``amppass.convert(..., mode="train")`` (bf16, fp16, the default
  ``plan_for='speed'``; and bf16 with ``plan_for='coverage'``) with ``amppass.LossScaler``. ``trained`` says what
  each row trained in: on a CPU without bf16/fp16 instructions the default plan returns the original fp32 model
  (:mod:`benchmarks.train_common` reads the warning that says so).
- ``kind="curve"``: per epoch, the training loss and test accuracy of a small CNN on scikit-learn's
  bundled digits data (no download), trained from one seed in fp32 and with amppass fp16 / bf16
  (``plan_for='coverage'``, so the curves are low-precision training on any CPU).

``python benchmarks/train_step.py [--quick] [--threads N]`` prints both and writes
``benchmarks/digits_curves.md`` and ``benchmarks/digits_curves.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

import amppass
from models.digits import digits_cnn, train_digits

from .train_common import threads, watched

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
NOTES = ("Step-time rows (`kind` step_time): the median of interleaved rounds, one step per variant each round. "
         "`amppass fp16`/`amppass bf16` = `amppass.convert(..., mode='train')` with its default `plan_for='speed'`, "
         "`amppass bf16 coverage` with `plan_for='coverage'`; `trained` = what the row trained in, read from the "
         "warning amppass logs where the device rule keeps a train-mode plan for speed fp32 (the default plan on a "
         "CPU without bf16/fp16 instructions). Curve rows (`kind` curve): the digits CNN per epoch, amppass "
         "`plan_for='coverage'` (low-precision training on any CPU), `--full` only; `--quick` times 3 rounds at batch "
         "16.")
PRECISIONS = ("fp32", "fp16", "bf16")  # amppass train mode for the low ones
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


# ---------------------------------------------------------------- step time


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10))


def _models(quick: bool) -> dict[str, tuple[Callable[[], nn.Module], torch.Tensor]]:
    batch = 16 if quick else 64
    models = {f"digits_cnn (batch {batch})": (digits_cnn, torch.randn(batch, 1, 8, 8))}
    if not quick:
        models["mlp 512-1024-1024-10 (batch 256)"] = (_mlp, torch.randn(256, 512))
    return models


def _variants(build: Callable[[], nn.Module], x: torch.Tensor) -> Iterator[tuple[str, str, nn.Module, Any, Any]]:
    """(name, what it trains in, model, scaler, autocast context factory) for each way of training the same
    model."""
    torch.manual_seed(0)
    yield "fp32", "fp32", build(), amppass.LossScaler(enabled=False), contextlib.nullcontext
    for name, dtype in _DTYPES.items():
        torch.manual_seed(0)
        yield (f"torch.autocast {name} + GradScaler", f"{name} (autocast)", build(), torch.amp.GradScaler("cpu"),
               lambda dtype=dtype: torch.autocast("cpu", dtype=dtype))
    for name, dtype, plan_for in [(n, d, "speed") for n, d in _DTYPES.items()] + [("bf16", torch.bfloat16,
                                                                                    "coverage")]:
        torch.manual_seed(0)
        with watched() as rule:
            model = amppass.convert(build(), (x,), dtype=dtype, mode="train", plan_for=plan_for)
        label = f"amppass {name}" + (" coverage" if plan_for == "coverage" else "")
        yield (f"{label} + LossScaler", rule.trained(name), model, amppass.LossScaler(dtype=dtype),
               contextlib.nullcontext)


def step_times(quick: bool) -> list[dict[str, Any]]:
    """Median step time of every variant of every model, measured in one run.

    The variants take turns, one step each per round, so load from other processes on a shared machine
    falls on all of them alike instead of on whichever ran at the time.
    """
    warmup, rounds = (1, 3) if quick else (5, 40)
    rows = []
    for model_name, (build, x) in _models(quick).items():
        y = torch.randint(0, 10, (x.shape[0],), generator=torch.Generator().manual_seed(0))
        made = list(_variants(build, x))
        variants = [(name, model, scaler, autocast, torch.optim.SGD(model.parameters(), lr=1e-3))
                    for name, _, model, scaler, autocast in made]
        trained = {name: what for name, what, *_ in made}
        times: dict[str, list[float]] = {name: [] for name, *_ in variants}
        for i in range(warmup + rounds):
            for name, model, scaler, autocast, opt in variants:
                start = time.perf_counter()
                opt.zero_grad()
                with autocast():
                    loss = F.cross_entropy(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                if i >= warmup:
                    times[name].append(time.perf_counter() - start)
        for name, samples in times.items():
            rows.append({"kind": "step_time", "model": model_name, "variant": name, "trained": trained[name],
                         "median_ms": 1e3 * statistics.median(samples), "steps": rounds,
                         "threads": torch.get_num_threads()})
            log.info("%s / %s: %.2f ms", model_name, name, rows[-1]["median_ms"])
    return rows


def run(quick: bool) -> list[dict[str, Any]]:
    """Step times side by side, then the digits curves (not when ``quick``: a smoke run)."""
    with threads(quick):
        rows = step_times(quick)
        for precision in PRECISIONS if not quick else ():  # whole epochs of three trainings are no smoke test
            rows += train_digits(precision, epochs=12, plan_for="coverage")
    return rows


# ---------------------------------------------------------------- output


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    """The step-time table and the digits curves as Markdown."""
    lines = ["# Training with amppass: step time and digits curves", "", f"Reproduce: `{command}`", "",
             "## Step time (median ms per step, CPU)", "", "| model | variant | trained | median ms | threads |",
             "| --- | --- | --- | ---: | ---: |"]
    for r in (r for r in rows if r["kind"] == "step_time"):
        lines.append(f"| {r['model']} | {r['variant']} | {r['trained']} | {r['median_ms']:.2f} | {r['threads']} |")
    curves = [r for r in rows if r["kind"] == "curve"]
    lines += ["", "## Digits CNN: test accuracy (%) per epoch, same seed (amppass: plan_for='coverage')", "",
              "| epoch | " + " | ".join(PRECISIONS) + " |", "| ---: |" + " ---: |" * len(PRECISIONS)]
    by = {(r["precision"], r["epoch"]): r for r in curves}
    for epoch in sorted({r["epoch"] for r in curves}):
        cells = [f"{by[(p, epoch)]['test_accuracy']:.2f} (loss {by[(p, epoch)]['train_loss']:.3f})"
                 if (p, epoch) in by else "" for p in PRECISIONS]
        lines.append(f"| {epoch} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Test accuracy and training loss per epoch, one line per precision."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for precision in PRECISIONS:
        curve = [r for r in rows if r["kind"] == "curve" and r["precision"] == precision]
        epochs = [r["epoch"] for r in curve]
        label = precision if precision == "fp32" else f"amppass {precision}"
        acc_ax.plot(epochs, [r["test_accuracy"] for r in curve], marker="o", label=label)
        loss_ax.plot(epochs, [r["train_loss"] for r in curve], marker="o", label=label)
    acc_ax.set(xlabel="epoch", ylabel="test accuracy (%)", title="digits CNN, same seed")
    loss_ax.set(xlabel="epoch", ylabel="training loss", yscale="log")
    acc_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    """Run, print, and write ``digits_curves.md`` / ``digits_curves.png`` beside this file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and epochs, one model")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: stable "
                        "timings on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = run(args.quick)
    command = f"python benchmarks/train_step.py --threads {args.threads}" + (" --quick" if args.quick else "")
    text = markdown(rows, command)
    (HERE / "digits_curves.md").write_text(text, encoding="utf-8")
    plot(rows, HERE / "digits_curves.png")
    print(text)


if __name__ == "__main__":
    main()
