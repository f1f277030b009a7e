"""fp8 training of the character-level GPT-2 of :mod:`benchmarks.train_gpt`: final loss against bf16's.

The model, text and batches are train_gpt's (:mod:`models.char_gpt`: GPT-2 over 128 characters, tied embedding and
output weights, the Python standard library's source, its last 5% held out). Every variant starts from the same
weights, reads the same batches with AdamW, and they take turns, one step each. Dropout is off. No loss scaler
anywhere: bf16 and fp8 (e5m2 gradients, each scaled by its own range) need none.

Variants:

- ``fp32``; ``amppass bf16``: ``convert(mode="train", plan_for="coverage")`` (coverage: on a CPU without bf16
  instructions a speed plan keeps fp32);
- ``amppass fp8 per node``: ``convert(mode="train", dtype="fp8", plan_for="coverage")``: GPT-2's products in fp8
  but the first and the last (the logits), attention in bf16 (:mod:`amppass.fx.runners.fp8_train`); in the full
  run also ``amppass fp8 per node, delayed`` (``fp8_recipe="delayed"``: amax histories of 16 steps in the graph);
- the all-Linear swap: every product in fp8, dynamic scales. GPT-2's block products are transformers' ``Conv1D``
  (``addmm``), which torchao's ``convert_to_float8_training`` does not swap (it swaps ``nn.Linear``, here only the
  output layer), so each ``Conv1D`` is first replaced by the ``nn.Linear`` computing the same (:func:`linearized`):
  ``torchao`` (``convert_to_float8_training``, where torchao is installed) and ``amppass Fp8Linear`` with the
  ``dynamic`` and ``delayed`` recipes (:func:`amppass.fx.rewrite.fp8_train.swap_linears`; delayed: an amax history
  of 16 steps, TransformerEngine's default).

``saved_MB``: the bytes autograd saves for backward in one training call on the first batch, before any step
(each storage once; the model's parameters and buffers left out: held anyway, and an fp8 product saves its fp32
master weight where bf16 saves a bf16 copy of it).

On a CPU every fp8 product is emulated (``torch._scaled_mm`` from fp8 values in fp32): step times say nothing of a
GPU's, and are not reported.

``python -m benchmarks.fp8_train [--quick]`` prints the table; ``python -m benchmarks run --full --only fp8_train``
writes it into RESULTS.md.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
from typing import Any

import torch
from torch import nn

import amppass
from amppass.fx.rewrite.fp8_train import swap_linears
from models.char_gpt import char_gpt, held_out_loss, next_char_loss, stdlib_corpus
from tests.helpers.saved_memory import saved_bytes

from .train_gpt import Setting

log = logging.getLogger(__name__)

QUICK = Setting(layers=1, width=32, heads=2, block=32, batch=4, steps=3, evals=1, text=100_000)
FULL = Setting(layers=2, width=64, heads=4, block=64, batch=16, steps=100, evals=2, text=None)

NOTES = ("Columns: `held@N` held-out loss (nats/char, eval mode, the same held-out batches) after N steps; "
         "`train_loss_last` mean training loss of the last 10% of steps; `gap_vs_bf16` (final held-out loss - "
         "amppass bf16's) / amppass bf16's (the goal: fp8 per node within 2%); `fp8_products` products in fp8 of "
         "all matrix products outside attention; `saved_MB` bytes autograd saves for backward in one call on the "
         "first batch before training, each storage once, parameters and buffers left out. Swaps: every `Conv1D` "
         "replaced by the equal `nn.Linear` first, then every `nn.Linear` in fp8 with dynamic (or delayed: amax "
         "history of 16) per-tensor scales; the "
         "torchao row is left out where torchao is not installed.")


def linearized(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every transformers ``Conv1D`` (``x @ W + b``, W stored in x out) replaced by the
    ``nn.Linear`` computing the same (its weight ``W.T``), so an all-Linear swap reaches every product."""
    from transformers.pytorch_utils import Conv1D

    copied = copy.deepcopy(model)
    for module in list(copied.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Conv1D):
                rows, cols = child.weight.shape
                linear = nn.Linear(rows, cols)
                with torch.no_grad():
                    linear.weight.copy_(child.weight.t())
                    linear.bias.copy_(child.bias)
                setattr(module, name, linear)
    return copied


def _torchao(model: nn.Module) -> nn.Module | None:
    """torchao's all-Linear swap of ``model`` (a copy), or None where torchao is not installed."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        return None
    return convert_to_float8_training(copy.deepcopy(model))


def _variants(setting: Setting, example: torch.Tensor, quick: bool) -> dict[str, nn.Module]:
    def fresh() -> nn.Module:
        return char_gpt(setting.layers, setting.width, setting.heads, setting.block, dropout=0.0, seed=0)

    def convert(dtype: str, recipe: str = "dynamic") -> nn.Module:
        return amppass.convert(fresh(), (example,), dtype=dtype, mode="train", plan_for="coverage",
                               fp8_recipe=recipe)

    found: dict[str, nn.Module | None] = {
        "fp32": fresh(), "amppass bf16": convert("bf16"), "amppass fp8 per node": convert("fp8"),
        "amppass fp8 per node, delayed": None if quick else convert("fp8", "delayed"),
        "all-Linear swap: torchao": _torchao(linearized(fresh())),
        "all-Linear swap: amppass Fp8Linear dynamic": swap_linears(linearized(fresh()), "dynamic"),
        "all-Linear swap: amppass Fp8Linear delayed": swap_linears(linearized(fresh()), "delayed"),
    }
    return {name: model for name, model in found.items() if model is not None}


def _fp8_products(name: str, model: nn.Module) -> str:
    """How many of the model's products (outside attention) run in fp8."""
    if name in ("fp32", "amppass bf16"):
        return "0"
    if name.startswith("amppass fp8"):
        rows = [r for r in amppass.report(model).fp8_rows() if "attention" not in r.name]
        return f"{sum('format' in r.evidence['fp8'] for r in rows)} of {len(rows)}"
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) or type(m).__name__ in
               ("Fp8Linear", "Float8Linear")]
    fp8 = sum(type(m).__name__ in ("Fp8Linear", "Float8Linear") for m in linears)
    return f"{fp8} of {len(linears)}"


def run(quick: bool) -> list[dict[str, Any]]:
    """Train every variant in turns; one row each."""
    setting = QUICK if quick else FULL
    corpus = stdlib_corpus(setting.text)
    data = torch.Generator().manual_seed(1)
    batches = [corpus.batch(data, setting.batch, setting.block) for _ in range(setting.steps)]
    held = [corpus.batch(torch.Generator().manual_seed(2), setting.batch, setting.block, held_out=True)
            for _ in range(2 if quick else 8)]
    models = _variants(setting, batches[0][:, :-1], quick)
    # on copies: a call in train mode records delayed scaling's ranges, which would move the trained models
    saved = {name: saved_bytes(copy.deepcopy(model), batches[0][:, :-1]) for name, model in models.items()}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=setting.lr) for name, m in models.items()}
    losses: dict[str, list[float]] = {name: [] for name in models}
    marks = sorted({round(setting.steps * (i + 1) / setting.evals) for i in range(setting.evals)})
    held_at: dict[str, dict[int, float]] = {name: {} for name in models}
    for step, batch in enumerate(batches, 1):
        for name, model in models.items():
            optimizers[name].zero_grad(set_to_none=True)
            loss = next_char_loss(model(batch[:, :-1]).logits, batch[:, 1:])
            loss.backward()
            optimizers[name].step()
            losses[name].append(loss.item())
            if step in marks:
                held_at[name][step] = statistics.fmean(held_out_loss(model, b) for b in held)
        log.info("step %d/%d: %s", step, setting.steps, ", ".join(f"{n} {v[-1]:.3f}" for n, v in losses.items()))
    final = {name: held_at[name][marks[-1]] for name in models}
    tail = max(1, setting.steps // 10)

    def gap(name: str) -> str:
        return f"{(final[name] - final['amppass bf16']) / final['amppass bf16']:+.2%}"

    return [{"variant": name, **{f"held@{s}": f"{held_at[name][s]:.4f}" for s in marks},
             "train_loss_last": f"{statistics.fmean(losses[name][-tail:]):.4f}", "gap_vs_bf16": gap(name),
             "fp8_products": _fp8_products(name, model), "saved_MB": f"{saved[name] / 2**20:.2f}"}
            for name, model in models.items()]


def title(quick: bool) -> str:
    """The table's title: the run's setting."""
    return f"Character GPT-2 trained in fp8 on the standard library's source: {(QUICK if quick else FULL).describe()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    quick = parser.parse_args().quick
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("amppass").setLevel(logging.ERROR)
    print(title(quick))
    for row in run(quick):
        print(row)


if __name__ == "__main__":
    main()
