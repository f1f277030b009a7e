"""The transformers Trainer with AmpPassTrainer, end to end (tiny random BERT classifier, gradient accumulation)."""

import warnings

import pytest
import torch

import amppass
from amppass.errors import InputError

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState  # noqa: E402
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments  # noqa: E402

from amppass.integrations.routing import converted, unroute  # noqa: E402
from amppass.integrations.transformers import AmpPassTrainer  # noqa: E402

CONFIG = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                    max_position_embeddings=32, num_labels=2, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _data():
    g = torch.Generator().manual_seed(0)
    # "idx" is a column the model does not take: remove_unused_columns (default True) must drop it
    return [{"input_ids": torch.randint(0, 64, (10,), generator=g), "attention_mask": torch.ones(10, dtype=torch.long),
             "labels": i % 2, "idx": i} for i in range(32)]


def _model():
    torch.manual_seed(0)
    return BertForSequenceClassification(CONFIG)


def _args(out, **kwargs):
    settings = dict(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4,
                    learning_rate=1e-2, max_grad_norm=0.1, logging_steps=1, report_to=[], save_strategy="no",
                    use_cpu=True, seed=0, disable_tqdm=True)
    return TrainingArguments(**{**settings, **kwargs})


def _train(trainer, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(**kwargs)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    return [h["loss"] for h in logged], [h["grad_norm"] for h in logged]


def _scaler():
    return amppass.LossScaler(init_scale=256.0, growth_interval=3)


# the fp16 runs test low-precision training itself: a plan for coverage trains in fp16 on any CPU (a plan for speed
# keeps a CPU without fp16 instructions in fp32)
COVERAGE = {"plan_for": "coverage"}


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    trainer = Trainer(model=_model(), args=_args(tmp_path_factory.mktemp("fp32")), train_dataset=_data())
    losses, norms = _train(trainer)
    AcceleratorState._reset_state(reset_partial_state=True)
    return losses, norms


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp16")
    model = _model()
    trainer = AmpPassTrainer(model=model, args=_args(out, save_strategy="steps", save_steps=2),
                             train_dataset=_data(), amppass_dtype="fp16", amppass_scaler=_scaler(),
                             amppass_options=COVERAGE)
    losses, norms = _train(trainer)
    return out, model, trainer, losses, norms


def test_fp16_trains_like_fp32_with_gradients_unscaled_before_clipping(fp32, fp16_run):
    out, model, trainer, losses, norms = fp16_run
    ref_losses, ref_norms = fp32
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=1e-3)
    # the logged norm is the one clipped: the true gradients' (a scaled one would be 256x and up)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=3e-2, atol=1e-3)
    assert all(n > 0.1 for n in ref_norms)  # max_grad_norm=0.1 clipped every step
    assert trainer.accelerator.scaler.skipped_steps == 0
    # the signature the Trainer read is the model's own: the unused "idx" column was dropped, the rest kept
    assert {"input_ids", "attention_mask", "labels"} <= set(trainer._signature_columns)
    assert "idx" not in trainer._signature_columns
    rows = amppass.report(converted(model).train_graph).rows
    assert any(row.precision == "fp16" and row.op == "aten.linear" for row in rows)
    assert model.bert.embeddings.word_embeddings.weight.dtype == torch.float32  # the model itself was trained
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        evaluated = trainer.evaluate(eval_dataset=_data()[:8])  # eval mode: the converted eval graph
    reference = Trainer(model=model, args=_args(out), eval_dataset=_data()[:8])
    unroute(model)  # the same trained weights through the model's own fp32 forward
    plain = reference.evaluate()
    assert abs(evaluated["eval_loss"] - plain["eval_loss"]) < 2e-2 * abs(plain["eval_loss"])


def test_scaler_state_is_checkpointed_and_resumed(fp16_run, tmp_path):
    out, model, trainer, losses, norms = fp16_run
    saved = torch.load(out / "checkpoint-2" / "scaler.pt", weights_only=True)
    assert saved["scale"] == 256.0 and saved["_growth_tracker"] == 2
    resumed_model = _model()
    resumed = AmpPassTrainer(model=resumed_model, args=_args(tmp_path, save_strategy="steps", save_steps=2),
                             train_dataset=_data(), amppass_dtype="fp16", amppass_scaler=_scaler(),
                             amppass_options=COVERAGE)
    _train(resumed, resume_from_checkpoint=str(out / "checkpoint-2"))
    assert resumed.accelerator.scaler.state_dict() == trainer.accelerator.scaler.state_dict()
    assert resumed.accelerator.scaler.get_scale() == 512.0  # grew after the 3rd clean step, across the resume
    for a, b in zip(resumed_model.parameters(), model.parameters(), strict=False):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the checkpoint is the model's own format: the plain class loads it
    plain = BertForSequenceClassification.from_pretrained(tmp_path / "checkpoint-4")
    torch.testing.assert_close(plain.classifier.weight, resumed_model.classifier.weight)


@pytest.mark.parametrize("flag", ["fp16", "bf16"])
def test_autocast_flags_are_refused(tmp_path, flag):
    with pytest.raises(InputError, match=rf"TrainingArguments\({flag}=True\).*autocast"):
        AmpPassTrainer(model=_model(), args=_args(tmp_path, **{flag: True}), train_dataset=_data())


def test_bf16_trainer_has_no_scaler_and_keeps_the_signature(tmp_path):
    model = _model()
    trainer = AmpPassTrainer(model=model, args=_args(tmp_path), train_dataset=_data(), amppass_dtype="bf16")
    assert trainer.accelerator.scaler is None
    import inspect

    assert inspect.signature(model.forward) == inspect.signature(BertForSequenceClassification(CONFIG).forward)
