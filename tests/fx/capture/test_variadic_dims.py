"""Dimensions stay dynamic through a forward that takes inputs through ``**kwargs``.

transformers 5.x models take their inputs through ``**kwargs`` beside the named ones, and the Trainer passes
``num_items_in_batch`` (a 0-d tensor) that way. torch.export's non-strict trace lays such a call out otherwise
than the ``dynamic_shapes`` mirroring it, so amppass captured every dimension static ("could not keep any input
dimension dynamic") and converted again for every padded length. Now the tensors reaching ``**kwargs`` are
captured as keyword inputs of their own, and one plan takes every batch and sequence length.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import amppass
from amppass.fx.capture.export import capture
from amppass.fx.capture.guards import GUARDS_KEY
from tests.helpers.capture_count import counted_captures


class KwargsNet(nn.Module):
    """A forward like transformers 5.x's: named inputs, the rest through ``**kwargs``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, input_ids, attention_mask=None, **kwargs):
        hidden = self.proj(self.embed(input_ids)) * attention_mask.unsqueeze(-1)
        total = hidden.sum()
        scale = kwargs.get("num_items_in_batch")
        out = total / scale if scale is not None else total
        return {"loss": out} if kwargs.get("return_dict", True) else (out,)


def _call(batch: int, length: int) -> dict:
    g = torch.Generator().manual_seed(batch * 100 + length)
    return {"input_ids": torch.randint(0, 50, (batch, length), generator=g),
            "attention_mask": torch.ones(batch, length, dtype=torch.long),
            "num_items_in_batch": torch.tensor(float(batch * length)), "return_dict": True}


def test_tensors_through_kwargs_leave_batch_and_length_dynamic(caplog):
    torch.manual_seed(0)
    model = KwargsNet()
    with caplog.at_level(logging.WARNING, logger="amppass"):
        gm = capture(model, None, _call(3, 7))
    assert not [r for r in caplog.records if "could not keep any input dimension dynamic" in r.getMessage()]
    specs = {spec.name: spec.dims for spec in gm.meta[GUARDS_KEY].inputs}
    assert not any(isinstance(d, int) for d in specs["input_ids"]), specs  # batch and length both dynamic
    assert not any(isinstance(d, int) for d in specs["attention_mask"]), specs
    for batch, length in ((2, 11), (5, 3)):
        call = _call(batch, length)
        with torch.no_grad():
            # return_dict is fixed in the graph (its guards hold it); the converted module takes it, the raw graph not
            got = gm(**{k: v for k, v in call.items() if k != "return_dict"})["loss"]
            want = model(**call)["loss"]
        torch.testing.assert_close(got, want)
    assert "forward" not in model.__dict__  # the caller's model is not changed


@pytest.fixture
def captures(monkeypatch):
    """The ``train`` flag of every capture amppass makes (tests/helpers/capture_count.py)."""
    return counted_captures(monkeypatch)


def test_bert_with_num_items_in_batch_converts_once_for_every_length(captures, caplog):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=64, num_labels=2,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).train()

    def batch(size: int, length: int) -> dict:
        call = _call(size, length)
        del call["return_dict"]
        return {**call, "labels": torch.arange(size) % 2}

    with caplog.at_level(logging.WARNING, logger="amppass"):
        fast = amppass.convert(model, example_kwargs=batch(4, 9), dtype=torch.bfloat16, mode="train",
                               plan_for="coverage")
        for size, length in ((4, 17), (3, 5), (4, 30), (2, 12)):
            call = batch(size, length)
            loss = fast(**call).loss
            loss.backward()
            with torch.no_grad():
                want = model(**call).loss
            assert torch.isfinite(loss)
            torch.testing.assert_close(loss.detach(), want, atol=0.03, rtol=0.03)
    assert captures.count(True) == 1, captures  # one train-mode capture, never again for a new length
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "capturing and converting it again" in m or "could not keep" in m], messages


class FixedLengthNet(KwargsNet):
    """Flattens the sequence into the features of one Linear: the length cannot vary, the batch can."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(7 * 8, 2)

    def forward(self, input_ids, attention_mask=None, **kwargs):
        hidden = self.proj(self.embed(input_ids)) * attention_mask.unsqueeze(-1)
        return self.head(hidden.flatten(1)).sum() / kwargs["num_items_in_batch"]


def test_a_dimension_that_cannot_vary_stays_static_and_the_log_names_it(caplog):
    torch.manual_seed(0)
    call = _call(3, 7)
    del call["return_dict"]
    with caplog.at_level(logging.WARNING, logger="amppass"):
        gm = capture(FixedLengthNet(), None, call)
    specs = {spec.name: spec.dims for spec in gm.meta[GUARDS_KEY].inputs}
    assert specs["input_ids"][1] == 7 and not isinstance(specs["input_ids"][0], int), specs
    notes = " ".join(r.getMessage() for r in caplog.records)
    assert "input_ids dim 1 is fixed at 7" in notes and "could not keep any" not in notes, notes
