"""peft LoRA with train mode, in both orders: LoRA on a converted model, and a peft model converted.

Each trains (only the adapters and ``modules_to_save`` move), follows the fp32 peft model's loss, and its
adapters saved with ``save_pretrained`` load into the unconverted peft model and give its outputs.
"""

from __future__ import annotations

import pytest
import torch

import amppass

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning")

INPUTS = {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)),
          "labels": torch.tensor([0, 1])}


def _bert() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, num_labels=2, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config).train()


def _lora(saved: list[str] | None) -> "peft.LoraConfig":
    return peft.LoraConfig(r=4, target_modules=["query", "value"], modules_to_save=saved, init_lora_weights=False)


def _convert(model: torch.nn.Module) -> torch.nn.Module:
    return amppass.convert(model, (), example_kwargs=INPUTS, dtype=torch.float16, mode="train", plan_for="coverage")


def _train(model: torch.nn.Module, steps: int = 3) -> list[float]:
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(**INPUTS).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("saved", [None, ["classifier"]], ids=["lora", "lora+modules_to_save"])
@pytest.mark.parametrize("order", ["peft_on_converted", "converted_peft"])
def test_lora_trains_and_its_adapters_load_into_the_unconverted_peft_model(order, saved, tmp_path):
    reference = peft.get_peft_model(_bert(), _lora(saved))
    if order == "peft_on_converted":
        model = peft.get_peft_model(_convert(_bert()), _lora(saved))
    else:
        model = _convert(peft.get_peft_model(_bert(), _lora(saved)))
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    trained = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    assert frozen and any("lora_A" in name for name in trained)
    assert any("modules_to_save" in name for name in trained) == bool(saved)

    ours, theirs = _train(model), _train(reference)
    assert ours[-1] < ours[0]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=2e-2, atol=2e-2)
    after = dict(model.named_parameters())
    assert all(torch.equal(after[name], value) for name, value in frozen.items())
    assert all(not torch.equal(after[name], value) for name, value in trained.items())

    if order == "peft_on_converted":
        model.save_pretrained(tmp_path)
    else:  # the converted model holds the peft model's state under its names
        unconverted = peft.get_peft_model(_bert(), _lora(saved))
        unconverted.load_state_dict(model.state_dict())
        unconverted.save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(_bert(), tmp_path).eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**INPUTS).logits, loaded(**INPUTS).logits, rtol=1e-2, atol=1e-2)
        untrained = peft.get_peft_model(_bert(), _lora(saved)).eval()(**INPUTS).logits
    assert not torch.allclose(untrained, loaded(**INPUTS).logits, atol=1e-3)
