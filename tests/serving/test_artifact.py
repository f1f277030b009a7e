"""record_of: which converted artifact an object is, and the record and graph it answers with, for every module
amppass.convert returns, and None for what it did not convert."""

import pytest
import torch
from torch import fx, nn

import amppass
from amppass import InputError
from amppass.reporting.report import Report
from amppass.serving.artifact import KINDS, Artifact, record_of
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
    assert found.kind == "serving" and found.graph is fast and found.module is fast
    assert found.record["dtype"] == "bf16" and found.record["mode"] == "inference"


def test_a_symbolic_trace_is_a_graph_that_cannot_serve_other_shapes():
    traced = amppass.convert(Mlp(), dtype="fp16", plan_for="coverage")
    found = record_of(traced)
    assert found.kind == "graph" and found.graph is traced and found.record["dtype"] == "fp16"


def test_a_drop_in_answers_with_its_converted_graph():
    model = amppass.convert(Encoder(), X, "bf16", plan_for="coverage")
    assert type(model).__name__ == "Encoder" and hasattr(model, "encode")
    found = record_of(model)
    assert found.kind == "drop-in" and found.module is model
    assert found.inner.kind == "serving" and found.graph is found.inner.graph is model.converted
    assert found.record is model.converted.meta["amppass"]


def test_a_train_mode_model_answers_with_its_train_graph():
    trained = amppass.convert(Mlp(), X, "bf16", mode="train", plan_for="coverage")
    found = record_of(trained)
    assert found.kind == "train" and found.graph is trained.train_graph
    assert found.record["mode"] == "train"


def test_a_kept_original_holds_its_measurement():
    info = {"whole_model": {"converted_ms": 0.2, "original_ms": 0.1}, "dtype": "bf16", "mode": "inference"}
    kept = keep_original(Mlp(), info)
    found = record_of(kept)
    assert found.kind == "kept" and found.graph is None and found.record is info


def test_a_model_converted_by_parts_answers_with_its_parts_record():
    model = amppass.convert(BranchesOnData(), X, "bf16", plan_for="coverage")
    found = record_of(model)
    assert found.kind == "parts" and found.graph is None
    assert found.parts.converted == ["body"] and dict(found.record) == {"dtype": "bf16", "mode": "inference"}


@pytest.mark.parametrize("thing", [Mlp(), fx.symbolic_trace(Mlp()), "model.onnx", None],
                         ids=["module", "graph-module", "path", "none"])
def test_what_amppass_did_not_convert_has_no_record(thing):
    assert record_of(thing) is None


class Stamped(Mlp):
    """A module of a kind amppass does not have: only the Artifact class the test defines says what it is."""


SAID = Report([], {"dtype": "bf16", "mode": "inference"})


@pytest.fixture
def stamped_kind():
    """A new kind, as one class defined here (which is all it takes: defining it makes it known), known while the
    test runs: it recognises its modules and answers report, save and export_onnx itself."""

    class StampedArtifact(Artifact):
        kind = "stamped"

        @classmethod
        def found(cls, module):
            return cls(module, {"dtype": "bf16", "mode": "inference"}) if isinstance(module, Stamped) else None

        def report(self):
            return SAID

        def saved_graph(self):
            raise InputError("a stamped model writes no .pt2 file: save its state_dict()")

        def export_refusal(self):
            return "a stamped model is exported from its original: pass that"

    try:
        assert KINDS[-1] is StampedArtifact
        yield StampedArtifact
    finally:
        KINDS.remove(StampedArtifact)


def test_a_new_kind_is_one_class_every_entry_point_asks(stamped_kind, tmp_path):
    model = Stamped()
    found = record_of(model)
    assert isinstance(found, stamped_kind) and found.kind == "stamped" and record_of(Mlp()) is None
    assert amppass.report(model) is SAID
    with pytest.raises(InputError, match="a stamped model writes no .pt2 file"):
        amppass.save(model, tmp_path / "m.pt2")
    assert not (tmp_path / "m.pt2").exists()
    with pytest.raises(InputError, match="a stamped model is exported from its original"):
        amppass.export_onnx(model, X, tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()
    assert amppass.convert(model, X, "bf16") is model  # its record says what it is already
    with pytest.raises(InputError, match="already converted"):
        amppass.convert(model, X, "fp16")


def test_every_kind_answers_for_itself():
    """Each kind amppass has is a class of its own overriding how it is found, with a name of its own."""
    assert [kind.kind for kind in KINDS] == ["parts", "drop-in", "train", "kept", "serving", "graph"]
    for kind in KINDS:
        assert "found" in vars(kind), kind
    assert {"report", "fp32_because", "saved_graph", "export_refusal", "refuse_training"} <= set(vars(Artifact))
