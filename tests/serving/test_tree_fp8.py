"""An fp8 train-mode converted model as the original's module tree: names, checkpoints, and shipping what it learned.

``dtype="fp8", mode="train"`` is bf16 training's conversion with some products trained in fp8 (docs/fp8.md), so its
module tree, state dict and checkpoints must be bf16 training's (``tests/serving/test_tree.py`` holds those for fp16),
and what it learned must ship as an fp8 model that ``amppass.save``/``amppass.load`` keep fp8.
``tests/serving/test_tree_fsdp_fp8.py`` runs it under FSDP2.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

import amppass
from amppass.errors import InputError
from amppass.fx.rewrite.fp8 import fp8_linear
from amppass.fx.rewrite.fp8_train import fp8_train_linear
from models.char_gpt import char_gpt, next_char_loss, stdlib_corpus

BATCH, BLOCK = 4, 16
TRAIN_OP, SERVE_OP = fp8_train_linear._opoverload, fp8_linear._opoverload

# deep copies of a converted model copy torch's pytree specs, which trips torch's own deprecation notice
pytestmark = pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning")


@pytest.fixture(scope="module", autouse=True)
def quiet():
    logging.disable(logging.WARNING)  # the CPU target's "testing only" warning
    yield
    logging.disable(logging.NOTSET)


def _gpt(dropout: float = 0.0) -> nn.Module:
    return char_gpt(layers=2, width=32, heads=2, block=BLOCK, dropout=dropout)


def _batch(seed: int) -> torch.Tensor:
    return stdlib_corpus(100_000).batch(torch.Generator().manual_seed(seed), BATCH, BLOCK)


def _fp8(model: nn.Module, mode: str = "train") -> nn.Module:
    return amppass.convert(model, (_batch(0)[:, :-1],), dtype="fp8", mode=mode, plan_for="coverage")


@pytest.fixture(scope="module")
def original() -> nn.Module:
    return _gpt(dropout=0.1)


@pytest.fixture(scope="module")
def converted(original) -> nn.Module:
    return _fp8(original)


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, seeds) -> list[float]:
    """One AdamW step per batch, no loss scaler (fp8 needs none); the losses."""
    losses = []
    for seed in seeds:
        batch = _batch(seed)
        loss = next_char_loss(model(batch[:, :-1]).logits, batch[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_the_fp8_model_has_the_originals_module_tree_and_state_dict_keys(original, converted):
    assert sum(n.target is TRAIN_OP for n in converted.train_graph.graph.nodes) > 0  # it does train in fp8
    assert [n for n, _ in converted.named_modules()] == [n for n, _ in original.named_modules()]
    assert list(converted.state_dict()) == list(original.state_dict())
    assert [n for n, _ in converted.named_parameters()] == [n for n, _ in original.named_parameters()]
    assert converted.transformer.wte.weight is converted.lm_head.weight  # tied, as GPT-2's
    assert sum(isinstance(m, GPT2Block) for m in converted.modules()) == 2  # wrap policies find the blocks
    assert all(p.dtype == torch.float32 for p in converted.parameters())  # fp32 masters, no fp8 state
    plain = _gpt()
    plain.load_state_dict(converted.state_dict(), strict=True)  # writes checkpoints the original loads
    copy.deepcopy(converted).load_state_dict(plain.state_dict(), strict=True)  # and loads the original's


def test_a_checkpoint_written_with_torch_save_resumes_fp8_training_bit_for_bit(converted, tmp_path):
    """Model, AdamW and the RNG (dropout) saved mid-run to a file, loaded (weights only) into a fresh copy of the
    conversion: the same losses and the same final state as the run that never stopped."""

    def fresh():
        model = copy.deepcopy(converted)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    torch.manual_seed(5)
    model, optimizer = fresh()
    straight = _steps(model, optimizer, range(4))
    final = {k: v.clone() for k, v in model.state_dict().items()}

    torch.manual_seed(5)
    model, optimizer = fresh()
    first = _steps(model, optimizer, range(2))
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state()}, path)
    checkpoint = torch.load(path, weights_only=True)
    model, optimizer = fresh()
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    torch.set_rng_state(checkpoint["rng"])
    assert first + _steps(model, optimizer, range(2, 4)) == straight
    for key, value in model.state_dict().items():
        assert torch.equal(value, final[key]), key


def test_saving_the_train_model_is_refused_naming_the_fp8_conversion_that_ships_it(converted, tmp_path):
    with pytest.raises(InputError, match="state_dict") as refused:
        amppass.save(converted, tmp_path / "trained.pt2")
    assert "dtype='fp8'" in str(refused.value) and "mode='inference'" in str(refused.value)
    assert not (tmp_path / "trained.pt2").exists()


def test_what_fp8_training_learned_ships_as_an_fp8_model_that_save_and_load_keep_fp8(converted, tmp_path):
    """The refusal's way: the trained state into the original, converted for inference in fp8, saved and loaded:
    the loaded program runs the same fp8 products (not bf16 ones) and computes the same outputs."""
    trained = copy.deepcopy(converted)
    torch.manual_seed(0)
    _steps(trained, torch.optim.AdamW(trained.parameters(), lr=1e-2), range(2))
    plain = _gpt().eval()
    plain.load_state_dict(trained.state_dict(), strict=True)
    serving = _fp8(plain, mode="inference")
    amppass.save(serving.converted, tmp_path / "served.pt2")  # the graph of a model that generates
    loaded = amppass.load(str(tmp_path / "served.pt2"))
    chosen = sum(n.target is SERVE_OP for n in serving.converted.graph.nodes)
    assert chosen > 0 and sum(n.target is SERVE_OP for n in loaded.graph.nodes) == chosen
    products = amppass.report(serving).info["fp8"]["products"]
    assert amppass.report(loaded).info["fp8"]["products"] == products and products["fp8"] == chosen
    ids = _batch(9)[:, :-1]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, serving(ids).logits)
