"""Converted models are drop-ins for the original (amppass.serving.dropin, amppass.serving.serving_graph,
amppass.fx.capture.export).

Their class, attributes and ``forward`` signature are the model's; ``forward(...)`` takes the path ``__call__``
takes; keyword flags never make tensor dimensions static; ``BatchEncoding`` is a dict; errors show inputs by
shape and dtype; nothing amppass runs writes into the caller's inputs.
"""

from __future__ import annotations

import inspect
import io
import logging

import pytest
import torch
from torch import fx, nn

import amppass
from tests.helpers.small_models import Flagged

transformers = pytest.importorskip("transformers")


def _bert(cls=None):
    cls = cls or transformers.BertForSequenceClassification
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64, num_labels=3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return cls(config).eval()


def _ids(length: int, batch: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(5, 100, (batch, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _close(got: torch.Tensor, expected: torch.Tensor, rel: float = 2e-2) -> bool:
    return bool((got - expected).norm() <= rel * expected.norm())


def test_a_converted_classifier_is_an_instance_of_its_class_with_its_attributes_and_signature():
    model = _bert()
    fast = amppass.convert(model, example_kwargs=_ids(9), dtype="bf16", plan_for="coverage")
    assert isinstance(fast, transformers.BertForSequenceClassification)
    assert fast.config.to_dict() == model.config.to_dict() and fast.config is not model.config
    assert fast.device == torch.device("cpu") and fast.dtype == torch.float32 and not fast.can_generate()
    assert hasattr(fast, "generation_config") == hasattr(model, "generation_config")  # transformers sets it to generate
    assert inspect.signature(fast.forward) == inspect.signature(model.forward)
    assert {p.dtype for p in fast.parameters()} == {torch.float32}, "the fp32 face"
    table = fast.get_input_embeddings()
    assert isinstance(table, nn.Embedding) and table.weight.dtype == torch.float32
    assert _close(table.weight, model.get_input_embeddings().weight, 1e-2)
    call = _ids(17, seed=1)  # another length: dynamic in the example's plan
    with torch.no_grad():
        expected = model(**call).logits
        assert _close(fast(**call).logits, expected) and _close(fast.forward(**call).logits, expected)
        as_tuple = fast(**call, return_dict=False)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], fast(**call).logits)
    assert amppass.report(fast).info["recaptures"] == 0 and fast.plans[0] is fast.converted


def _vit():
    config = transformers.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=64, num_labels=4)
    return transformers.ViTForImageClassification(config), torch.randn(2, 3, 32, 32), torch.randn(1, 3, 32, 32)


def _wav2vec2():
    config = transformers.Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                                         conv_kernel=(10, 3), num_feat_extract_layers=2, num_labels=4,
                                         num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2)
    return transformers.Wav2Vec2ForSequenceClassification(config), torch.randn(2, 1600), torch.randn(2, 2400)


@pytest.mark.parametrize("make", [_vit, _wav2vec2], ids=["vision", "audio"])
def test_converted_vision_and_audio_classifiers_are_instances_of_their_class(make):
    torch.manual_seed(0)
    model, example, call = make()
    model.eval()
    fast = amppass.convert(model, (example,), dtype="bf16", plan_for="coverage")
    assert isinstance(fast, type(model)) and fast.config.num_labels == 4
    assert inspect.signature(fast.forward) == inspect.signature(model.forward)
    with torch.no_grad():
        assert _close(fast.forward(call).logits, model(call).logits)


def test_forward_takes_the_path_call_takes():
    """``fast.forward(...)`` ran the example's graph on any call (``The size of tensor a (17) must match ...``)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    fast = amppass.convert(model, (torch.randn(2, 8),), "bf16", plan_for="coverage", dynamic_shapes=None)
    x = torch.randn(5, 8)  # the example's plan takes batches of 2 only
    with torch.no_grad():
        assert _close(fast.forward(x), model(x))
    assert amppass.report(fast).info["recaptures"] == 1
    assert inspect.signature(fast.forward) == inspect.signature(fast.run_graph)


def test_keyword_flags_leave_every_dimension_dynamic(caplog):
    """``return_dict=True`` in example_kwargs made every dimension static, the reason printed as ``(None)``."""
    model = Flagged(width=8).eval()
    with caplog.at_level(logging.WARNING, logger="amppass"):
        fast = amppass.convert(model, (torch.randn(2, 5, 8),), "bf16", example_kwargs={"double": True},
                               plan_for="coverage")
    assert "dynamic" not in caplog.text and "None" not in caplog.text
    x = torch.randn(3, 11, 8)
    with torch.no_grad():
        assert _close(fast(x, double=True), model(x, double=True))
        assert amppass.report(fast).info["recaptures"] == 0, "another batch and length: the example's plan"
        assert _close(fast(x, double=False), model(x, double=False))  # another flag: another plan
    plans = amppass.report(fast).info["plans"]
    assert len(plans) == 2 and "double = True" in plans[0]["inputs"] and "double = False" in plans[1]["inputs"]


class _Writes(nn.Module):
    """Writes its output into its input dict (as sentence-transformers' modules do), and takes a data-dependent
    branch for inputs longer than 8 that torch.export cannot capture."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, features):
        x = features["x"]
        if x.shape[1] > 8 and bool(x.sum() > 0):
            x = x.flip(1)
        features["y"] = self.proj(x)
        return features


def test_batch_encodings_are_dicts_and_the_callers_dict_is_never_written():
    from transformers.tokenization_utils_base import BatchEncoding

    model = _Writes().eval()
    example = BatchEncoding({"x": torch.randn(2, 4, 8)})
    fast = amppass.convert(model, (example,), "bf16", plan_for="coverage")
    assert set(example) == {"x"}
    call = BatchEncoding({"x": torch.randn(3, 6, 8)})
    with torch.no_grad():
        out = fast(call)
    assert set(call) == {"x"} and _close(out["y"], model({"x": call["x"]})["y"])


def test_a_call_that_cannot_be_captured_is_named_by_shape_and_dtype_and_writes_nothing(caplog):
    model = _Writes().eval()
    fast = amppass.convert(model, ({"x": torch.randn(2, 4, 8)},), "bf16", plan_for="coverage")
    call = {"x": torch.rand(2, 12, 8), "note": "text"}  # longer than 8 and positive: the branch export refuses
    with pytest.raises(amppass.CaptureError) as caught:
        fast(call)
    message = str(caught.value)
    assert "[2, 12, 8] float32" in message and "tensor(" not in message and len(message) < 2000
    assert set(call) == {"x", "note"}, "the original model, run to check the call, wrote into a copy"


class _Scorer(nn.Module):
    """A module with a method of its own beside forward, reading a submodule's plain attribute."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(8, 4)
        self.encoder.labels = ["a", "b", "c", "d"]

    def forward(self, x):
        return self.encoder(x)

    def best(self, x):
        return [self.encoder.labels[i] for i in self(x).argmax(-1).tolist()]


def test_a_module_with_methods_of_its_own_keeps_its_class_and_a_bare_one_stays_a_graph():
    torch.manual_seed(0)
    model = _Scorer().eval()
    x = torch.randn(6, 8)
    fast = amppass.convert(model, (x[:2],), "bf16", plan_for="coverage")
    assert isinstance(fast, _Scorer) and fast.best(x) == model.best(x)
    assert [name for name, _ in fast.named_children()] == ["encoder", "converted"]
    assert not list(fast.encoder.parameters()), "the hollow part holds no weights"
    with pytest.raises(amppass.InputError, match="holds no weights"):
        fast.encoder(x)
    assert isinstance(fast.graph, fx.Graph) and amppass.report(fast).info["dtype"] == "bf16"
    with pytest.raises(amppass.InputError, match=r"amppass.save\(model.converted, path\)"):
        amppass.save(fast, "unused.pt2")
    with pytest.raises(amppass.InputError, match=r"amppass.save\(model.converted"):
        torch.save(fast, io.BytesIO())
    assert amppass.convert(fast, (x[:2],), "bf16") is fast
    plain = amppass.convert(nn.Sequential(nn.Linear(8, 4)).eval(), (x[:2],), "bf16", plan_for="coverage")
    assert isinstance(plain, fx.GraphModule)


class _Supervised(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 3)

    def forward(self, features, labels=None):
        logits = self.proj(features)
        return logits if labels is None else nn.functional.cross_entropy(logits, labels)


def test_a_train_mode_model_shows_the_originals_forward_signature():
    """transformers' Trainer keeps only the dataset columns inspect.signature(model.forward) names."""
    model = _Supervised().train()
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    fast = amppass.convert(model, (x,), "bf16", example_kwargs={"labels": y}, mode="train", plan_for="coverage")
    assert list(inspect.signature(fast.forward).parameters) == ["features", "labels"]
    loss = fast(x, labels=y)
    loss.backward()
    assert fast.proj.weight.grad is not None and fast.proj.weight.dtype == torch.float32


class _Pyramid(nn.Module):
    """A fully convolutional detector head, called over an image pyramid (one call per scale)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 2, 1))

    def forward(self, x):
        return self.body(x)


def test_an_image_at_another_size_widens_the_plan_once(caplog):
    """The example's spatial sizes are captured static; the first other size makes one plan that takes any."""
    torch.manual_seed(0)
    model = _Pyramid().eval()
    with caplog.at_level(logging.INFO, logger="amppass"):
        fast = amppass.convert(model, (torch.randn(1, 3, 24, 24),), "bf16", plan_for="coverage")
    assert "x's spatial sizes are kept at the example's" in caplog.text
    assert amppass.report(fast).info["plans"][0]["inputs"].endswith(", 3, 24, 24] float32")
    with torch.no_grad():
        for size in (24, 17, 12, 9):
            x = torch.randn(2, 3, size, size)
            assert _close(fast(x), model(x))
    plans = amppass.report(fast).info["plans"]
    assert amppass.report(fast).info["recaptures"] == 1 and len(plans) == 2
    assert ", 3, 24, 24]" not in plans[1]["inputs"]  # the second plan's height and width are symbols
