"""record_of: which converted artifact an object is, and the record and graph it answers with, for every module
amppass.convert returns, and None for what it did not convert."""

import pytest
import torch
from torch import fx, nn

import amppass
from amppass.serving.artifact import Kind, record_of
from amppass.serving.fp32_original import keep_original


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        return self.body(x)


class Encoder(Mlp):
    """A class with more than forward to offer: convert returns it in its own class (a drop-in)."""

    def encode(self, x):
        return self(x).argmax(-1)


class BranchesOnData(Mlp):
    """Branches on a value (torch.export cannot capture it whole): converted by parts."""

    def forward(self, x):
        if x.sum().item() > 0:
            x = x * 2
        return self.body(x)


X = (torch.randn(2, 8),)


def test_a_captured_graph_holds_its_own_record():
    fast = amppass.convert(Mlp(), X, "bf16", plan_for="coverage")
    found = record_of(fast)
    assert found.kind is Kind.SERVING and found.graph is fast and found.module is fast
    assert found.record["dtype"] == "bf16" and found.record["mode"] == "inference"


def test_a_symbolic_trace_is_a_graph_that_cannot_serve_other_shapes():
    traced = amppass.convert(Mlp(), dtype="fp16", plan_for="coverage")
    found = record_of(traced)
    assert found.kind is Kind.GRAPH and found.graph is traced and found.record["dtype"] == "fp16"


def test_a_drop_in_answers_with_its_converted_graph():
    model = amppass.convert(Encoder(), X, "bf16", plan_for="coverage")
    assert type(model).__name__ == "Encoder" and hasattr(model, "encode")
    found = record_of(model)
    assert found.kind is Kind.DROP_IN and found.module is model
    assert found.inner.kind is Kind.SERVING and found.graph is found.inner.graph is model.converted
    assert found.record is model.converted.meta["amppass"]


def test_a_train_mode_model_answers_with_its_train_graph():
    trained = amppass.convert(Mlp(), X, "bf16", mode="train", plan_for="coverage")
    found = record_of(trained)
    assert found.kind is Kind.TRAIN and found.graph is trained.train_graph
    assert found.record["mode"] == "train"


def test_a_kept_original_holds_its_measurement():
    info = {"whole_model": {"converted_ms": 0.2, "original_ms": 0.1}, "dtype": "bf16", "mode": "inference"}
    kept = keep_original(Mlp(), info)
    found = record_of(kept)
    assert found.kind is Kind.KEPT and found.graph is None and found.record is info


def test_a_model_converted_by_parts_answers_with_its_parts_record():
    model = amppass.convert(BranchesOnData(), X, "bf16", plan_for="coverage")
    found = record_of(model)
    assert found.kind is Kind.PARTS and found.graph is None
    assert found.parts.converted == ["body"] and dict(found.record) == {"dtype": "bf16", "mode": "inference"}


@pytest.mark.parametrize("thing", [Mlp(), fx.symbolic_trace(Mlp()), "model.onnx", None],
                         ids=["module", "graph-module", "path", "none"])
def test_what_amppass_did_not_convert_has_no_record(thing):
    assert record_of(thing) is None
