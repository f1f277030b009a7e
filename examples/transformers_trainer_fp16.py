"""transformers Trainer: ``AmpPassTrainer(..., amppass_dtype="fp16")`` in place of ``Trainer(...)``.

A tiny random BERT classifier (built from a config: nothing is downloaded) trained with gradient accumulation
and ``max_grad_norm`` clipping; the logged ``grad_norm`` is the true (unscaled) one. Leave
``TrainingArguments(fp16=...)`` / ``bf16=...`` False: amppass chooses the precision.
Run: ``python examples/transformers_trainer_fp16.py``.
"""

from __future__ import annotations

import tempfile

import torch
from transformers import BertConfig, BertForSequenceClassification, TrainingArguments
from transformers.utils import logging as hf_logging

from amppass.integrations.transformers import AmpPassTrainer


def main() -> None:
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = BertConfig(vocab_size=128, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=2)
    model = BertForSequenceClassification(config)
    data = [{"input_ids": torch.randint(0, 128, (16,)), "attention_mask": torch.ones(16, dtype=torch.long),
             "labels": i % 2} for i in range(32)]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                                 max_steps=4, learning_rate=5e-4, logging_steps=2, report_to=[], save_strategy="no",
                                 use_cpu=True, disable_tqdm=True)
        trainer = AmpPassTrainer(model=model, args=args, train_dataset=data, amppass_dtype="fp16")
        trainer.train()
        for entry in trainer.state.log_history:
            if "loss" in entry:
                print(f"step {entry['step']}: loss {entry['loss']:.4f}, grad_norm {entry['grad_norm']:.3f}")
        print(f"loss scale {trainer.accelerator.scaler.get_scale():g}; the model itself is trained "
              f"({next(model.parameters()).dtype}): model.save_pretrained(...) as usual")


if __name__ == "__main__":
    main()
