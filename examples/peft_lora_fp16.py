"""peft LoRA in fp16: ``get_peft_model`` on a model amppass converted in train mode, trained with a
``LossScaler``; only the adapters move, and ``save_pretrained`` writes adapters the unconverted model loads.

Run: ``python -m examples.peft_lora_fp16``.
"""

from __future__ import annotations

import tempfile

import peft
import torch
import transformers

import amppass

INPUTS = {"input_ids": torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0)),
          "labels": torch.tensor([0, 1, 1, 0])}


def bert() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, num_labels=2)
    return transformers.BertForSequenceClassification(config)


def main() -> None:
    fast = amppass.convert(bert().train(), (), example_kwargs=INPUTS, dtype="fp16", mode="train")
    model = peft.get_peft_model(fast, peft.LoraConfig(r=4, target_modules=["query", "value"],
                                                      modules_to_save=["classifier"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scaler = amppass.LossScaler()
    for step in range(5):
        optimizer.zero_grad()
        loss = model(**INPUTS).loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step}: loss {loss.item():.4f}")
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        loaded = peft.PeftModel.from_pretrained(bert(), folder).eval()
        model.eval()
        with torch.no_grad():
            ours, theirs = model(**INPUTS).logits, loaded(**INPUTS).logits
    print(f"adapters loaded into the unconverted model: logits within {float((ours - theirs).abs().max()):.2e}")
    assert torch.allclose(ours, theirs, rtol=1e-2, atol=1e-2)


if __name__ == "__main__":
    main()
