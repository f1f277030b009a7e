"""amppass in the tools' own training loops against each tool's own precision flag (CPU).

For each tool (Lightning ``Trainer``, transformers ``Trainer``, accelerate) one random BERT classifier and one list
of batches are trained from one seed six ways: fp32; the tool's own flag for bf16 and for fp16
(``precision="bf16-mixed"``/``"16-mixed"``, ``TrainingArguments(bf16=True)``/``fp16=True``,
``Accelerator(mixed_precision=...)``); and amppass fp16 and bf16 through :mod:`amppass.integrations` with the
default ``plan_for='speed'``, and bf16 with ``plan_for='coverage'``. The ``trained`` column says what each amppass
row trained in: on a CPU without bf16/fp16 instructions the default plan keeps the model fp32, which the warning
amppass logs says (:mod:`benchmarks.train_common`). One run each; ``--quick`` runs fp32 and amppass bf16 only.

``python -m benchmarks.integrations [--quick]`` prints the table; ``python -m benchmarks run --only integrations``
puts it in RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile

from .latency import peak_of
from .train_common import threads, watched

log = logging.getLogger(__name__)

NOTES = (
    "Each tool trains one random BERT classifier (transformers' BertForSequenceClassification, built from a config) "
    "on the same batches from one seed, with AdamW, gradient clipping at 1.0 and, for the transformers Trainer, 2 "
    "gradient-accumulation steps. `tool bf16`/`tool fp16` = the tool's own precision flag (torch.autocast; "
    "GradScaler for fp16); `amppass fp16`/`amppass bf16` = the amppass integration (Lightning "
    "`plugins=[AmpPassPrecision(...)]`, `AmpPassTrainer(..., amppass_dtype=...)`, "
    "`amppass.integrations.accelerate.prepare(...)`) with the default `plan_for='speed'`; `amppass bf16 coverage` "
    "the same with `plan_for='coverage'` (bf16 on any CPU). Columns: `trained` = what an amppass row trained in "
    "(read from the warning amppass logs where the device rule keeps a train-mode plan for speed fp32: the default "
    "plan on a CPU without bf16/fp16 instructions); `curve_dev` = the largest |loss - fp32's loss| / "
    "fp32's loss over the steps; `step_ms` = median wall time of a training step after the first two (the first "
    "amppass step converts the model: `first_step_s`); `vs_flag` = the tool's own flag's `step_ms` for the same "
    "dtype / this row's (above 1: amppass is faster); `peak_MB` = high-water mark of torch CPU allocations during "
    "the last step (torch.profiler memory events). One run each: timings on a busy machine are not results."
)

VARIANTS = ("fp32", "tool bf16", "tool fp16", "amppass bf16", "amppass fp16", "amppass bf16 coverage")
QUICK_VARIANTS = ("fp32", "amppass bf16")  # a smoke run of each tool's loop and integration


def _amppass(variant: str) -> tuple[str, dict[str, Any]]:
    """An amppass variant's dtype and convert options."""
    return variant.split()[1], {"plan_for": "coverage"} if variant.endswith("coverage") else {}


@dataclass
class Setting:
    """The model and data of one run."""

    hidden: int
    layers: int
    seq: int
    batch: int
    steps: int

    def config(self) -> Any:
        from transformers import BertConfig

        return BertConfig(vocab_size=512, hidden_size=self.hidden, num_hidden_layers=self.layers,
                          num_attention_heads=max(2, self.hidden // 64), intermediate_size=4 * self.hidden,
                          max_position_embeddings=self.seq, num_labels=2, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)

    def examples(self) -> list[dict[str, Any]]:
        """One dict per example; its label depends on the tokens, so the loss can fall."""
        g = torch.Generator().manual_seed(0)
        rows = []
        for _ in range(self.batch * self.steps * 2):  # two micro-batches a step for the transformers Trainer
            ids = torch.randint(0, 512, (self.seq,), generator=g)
            rows.append({"input_ids": ids, "attention_mask": torch.ones(self.seq, dtype=torch.long),
                         "labels": int(ids[0] < 256)})
        return rows

    def batches(self) -> list[dict[str, torch.Tensor]]:
        rows = self.examples()[: self.batch * self.steps]
        return [torch.utils.data.default_collate(rows[i:i + self.batch]) for i in range(0, len(rows), self.batch)]


def settings(quick: bool) -> Setting:
    return Setting(hidden=32, layers=1, seq=16, batch=4, steps=3) if quick else \
        Setting(hidden=256, layers=4, seq=128, batch=16, steps=20)


@dataclass
class Record:
    """What one run measured, step by step."""

    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    peak: int = 0
    note: str = ""
    trained: str | None = None  # what an amppass variant trained in
    _started: float = 0.0
    _profiler: Any = None

    def begin(self, last: bool) -> None:
        if last:
            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.__enter__()
        self._started = time.perf_counter()

    def end(self) -> None:
        self.times.append(time.perf_counter() - self._started)
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self.peak = peak_of(self._profiler)
            self._profiler = None


def _model(setting: Setting) -> Any:
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(setting.config())


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names = ("pytorch_lightning", "lightning_fabric", "transformers", "accelerate")
        levels = {name: logging.getLogger(name).level for name in names}
        for name in names:
            logging.getLogger(name).setLevel(logging.ERROR)
        try:
            yield
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)


# ---------------------------------------------------------------- the three tools


def lightning(variant: str, setting: Setting) -> Record:
    import pytorch_lightning as pl

    from amppass.integrations.lightning import AmpPassPrecision

    record = Record()
    batches = setting.batches()

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model(setting)

        def training_step(self, batch: dict, index: int) -> torch.Tensor:
            return self.model(**batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Timer(pl.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, index: int) -> None:
            record.begin(index == len(batches) - 1)

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, index: int) -> None:
            record.end()
            record.losses.append(float(outputs["loss"]))

    flags: dict[str, Any] = {"fp32": {}, "tool bf16": {"precision": "bf16-mixed"},
                             "tool fp16": {"precision": "16-mixed"}}
    if variant.startswith("amppass"):
        dtype, options = _amppass(variant)
        flags[variant] = {"plugins": [AmpPassPrecision(dtype, **options)]}
    flags = flags[variant]
    trainer = pl.Trainer(max_steps=len(batches), accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
                         callbacks=[Timer()], **flags)
    with _quiet():
        trainer.fit(Classifier(), torch.utils.data.DataLoader(batches, batch_size=None))
    if variant == "tool fp16" and trainer.precision != "16-mixed":
        record.note = f"Lightning runs precision={trainer.precision!r} for '16-mixed' on a CPU"
    return record


def transformers_trainer(variant: str, setting: Setting) -> Record:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from amppass.integrations.transformers import AmpPassTrainer

    record = Record()

    class Timer(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            record.begin(state.global_step == setting.steps - 1)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            record.end()

    flag = {"tool bf16": {"bf16": True}, "tool fp16": {"fp16": True}}.get(variant, {})
    with tempfile.TemporaryDirectory() as out, _quiet():
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=setting.batch,
                                 gradient_accumulation_steps=2, max_steps=setting.steps, learning_rate=1e-3,
                                 max_grad_norm=1.0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                                 disable_tqdm=True, seed=0, optim="adamw_torch", **flag)
        common = dict(model=_model(setting), args=args, train_dataset=setting.examples(), callbacks=[Timer()])
        if variant.startswith("amppass"):
            dtype, options = _amppass(variant)
            trainer = AmpPassTrainer(**common, amppass_dtype=dtype, amppass_options=options or None)
        else:
            trainer = Trainer(**common)
        if variant == "tool fp16" and trainer.accelerator.scaler is None:
            record.note = "fp16=True on a CPU turns on neither autocast nor a scaler: it trains fp32"
        trainer.train()
    record.losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return record


def accelerate_loop(variant: str, setting: Setting) -> Record:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from amppass.integrations.accelerate import prepare

    record = Record()
    AcceleratorState._reset_state(reset_partial_state=True)
    mixed = {"tool bf16": "bf16", "tool fp16": "fp16"}.get(variant, "no")
    accelerator = Accelerator(cpu=True, mixed_precision=mixed)
    if mixed != "no" and not accelerator.native_amp:
        record.note = f"mixed_precision={mixed!r} on a CPU turns on neither autocast nor a scaler: it trains fp32"
    model = _model(setting)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if variant.startswith("amppass"):
        dtype, options = _amppass(variant)
        model, optimizer = prepare(accelerator, model, optimizer, dtype=dtype, **options)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
    batches = setting.batches()
    for index, batch in enumerate(batches):
        record.begin(index == len(batches) - 1)
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        record.end()
        record.losses.append(loss.item())
    AcceleratorState._reset_state(reset_partial_state=True)
    return record


TOOLS: dict[str, Callable[[str, Setting], Record]] = {
    "Lightning Trainer": lightning,
    "transformers Trainer": transformers_trainer,
    "accelerate": accelerate_loop,
}


def run(quick: bool) -> list[dict[str, Any]]:
    """One row per tool and variant (module docstring)."""
    with threads(quick):
        return _run(settings(quick), QUICK_VARIANTS if quick else VARIANTS)


def _run(setting: Setting, variants: tuple[str, ...]) -> list[dict[str, Any]]:
    rows = []
    for tool, train in TOOLS.items():
        records: dict[str, Record] = {}
        for variant in variants:
            try:
                with watched() as rule:
                    records[variant] = train(variant, setting)
            except Exception as error:  # noqa: BLE001 - a variant the tool cannot run here is a row saying so
                log.warning("%s %s failed: %s", tool, variant, error)
                records[variant] = Record(note=f"failed: {type(error).__name__}: {str(error)[:120]}")
            if variant.startswith("amppass"):
                records[variant].trained = rule.trained(_amppass(variant)[0])
        rows.extend(_rows(tool, records))
    return rows


def _rows(tool: str, records: dict[str, Record]) -> list[dict[str, Any]]:
    reference = records["fp32"].losses
    found = []
    for variant, record in records.items():
        step = statistics.median(record.times[2:]) * 1e3 if len(record.times) > 2 else None
        flag = records.get(f"tool {variant.split()[1]}") if variant.startswith("amppass") else None
        flag_step = statistics.median(flag.times[2:]) * 1e3 if flag is not None and len(flag.times) > 2 else None
        found.append({
            "tool": tool,
            "variant": variant,
            "trained": "fp32" if variant == "fp32" else record.trained,
            "steps": len(record.losses),
            "final_loss": round(record.losses[-1], 4) if record.losses else None,
            "curve_dev": _deviation(record.losses, reference),
            "first_step_s": round(record.times[0], 2) if record.times else None,
            "step_ms": round(step, 1) if step is not None else None,
            "vs_flag": round(flag_step / step, 2) if variant.startswith("amppass") and step and flag_step else None,
            "peak_MB": round(record.peak / 2**20, 1) if record.peak else None,
            "note": record.note,
        })
    return found


def _deviation(losses: list[float], reference: list[float]) -> float | None:
    if not losses or len(losses) != len(reference):
        return None
    return round(max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=False)), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer steps")
    from .results import markdown_table

    print(markdown_table(run(parser.parse_args().quick)))


if __name__ == "__main__":
    main()
