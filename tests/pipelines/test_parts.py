"""amppass.pipelines.parts: a model torch.export cannot take whole converts by parts.

Three models of the shapes that defeat a whole capture: a detector whose head selects boxes by score (sizes
from data), an encoder whose layer loop draws random numbers in training (LayerDrop), and a model applying a
``torch.autograd.Function`` with its own backward in train mode. Each converts; the parts are its submodules
with weights, the code between them runs as the model's Python in fp32, the caller's model is never touched.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import amppass
from amppass import AmpPassError, CaptureError, InputError
from amppass.fx.view.macs import measured_macs
from amppass.serving.parts import parts_of
from tests.helpers.autograd_functions import RoundSTE


class Scorer(nn.Module):
    """Scores anchors and keeps the best 16 above zero: the kept count depends on the data."""

    def __init__(self):
        super().__init__()
        self.hidden, self.score, self.delta = nn.Linear(32, 64), nn.Linear(64, 1), nn.Linear(64, 4)

    def forward(self, features, anchors):
        h = torch.relu(self.hidden(features))
        scores, deltas = self.score(h).squeeze(-1), self.delta(h)
        keep = torch.nonzero(scores > 0).squeeze(-1)
        if keep.numel() > 16:  # a branch on a size from the data: no single graph takes it
            keep = keep[scores[keep].argsort(descending=True)[:16]]
        boxes = anchors[keep] + deltas[keep] * 16
        return boxes, scores[keep], keep


class Detector(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2,
                                                                                           padding=1), nn.ReLU())
        self.head = Scorer()
        self.register_buffer("anchors", torch.rand(64, 4) * 1000)

    def forward(self, images):
        features = self.backbone(images).flatten(2).transpose(1, 2)[0]
        return self.head(features, self.anchors)


def _detector() -> tuple[Detector, torch.Tensor]:
    torch.manual_seed(0)
    return Detector().eval(), torch.randn(1, 3, 16, 16)


def test_a_detector_converts_by_parts_with_boxes_in_fp32_and_the_callers_model_untouched():
    model, images = _detector()
    before = copy.deepcopy(model.state_dict())
    attributes = set(vars(model)) | {k for m in model.modules() for k in vars(m)}
    fast = amppass.convert(model, (images,), "bf16", plan_for="coverage")

    record = parts_of(fast)
    assert isinstance(fast, Detector) and record.converted == ["backbone", "head.hidden", "head.score",
                                                               "head.delta"]
    assert set(record.eager) == {"head"} and "data-dependent" in record.eager["head"]
    assert "Try:" not in record.eager["head"]
    assert model.backbone is not fast.backbone and isinstance(model.backbone, nn.Sequential)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert attributes == set(vars(model)) | {k for m in model.modules() for k in vars(m)}

    with torch.no_grad():
        want, got = model(images), fast(images)
    assert [t.dtype for t in got] == [torch.float32, torch.float32, torch.int64]
    assert torch.equal(want[2], got[2])  # the same anchors kept
    assert (got[0] - want[0]).abs().max() < 1.5 and (got[1] - want[1]).abs().max() < 0.05


def test_the_report_names_each_part_what_runs_eagerly_and_the_share_of_macs_low():
    model, images = _detector()
    fast = amppass.convert(model, (images,), "bf16", plan_for="coverage")
    report = amppass.report(fast)
    names = [row.name for row in report.rows]
    assert any(n.startswith("backbone.") for n in names) and any(n.startswith("head.score.") for n in names)
    parts = report.info["parts"]
    total, low = measured_macs(lambda: model(images))
    assert parts["macs_total"] == total and 0.95 < parts["macs_low"] / total <= 1
    summary = report.summary()
    assert "converted by parts" in summary and "runs as the model's own code, in fp32: head" in summary
    assert "of the whole model, eager code included" in summary
    report.to_json()  # the schema holds the parts


def test_what_takes_one_graph_refuses_a_model_converted_by_parts(tmp_path):
    model, images = _detector()
    fast = amppass.convert(model, (images,), "bf16", plan_for="coverage")
    with pytest.raises(InputError, match="converted by parts"):
        amppass.save(fast, tmp_path / "m.pt2")
    assert not (tmp_path / "m.pt2").exists()
    assert amppass.convert(fast, (images,), "bf16") is fast
    with pytest.raises(AmpPassError, match="already converted"):
        amppass.convert(fast, (images,), "fp16")
    with pytest.raises(InputError, match="converted by parts.*pass the original"):
        amppass.export_onnx(fast, (images,), tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


class LayerDropEncoder(nn.Module):
    """wav2vec2's layer loop: in training each layer is skipped with probability ``p``."""

    def __init__(self, p: float = 0.5):
        super().__init__()
        self.p = p
        self.embed = nn.Linear(8, 32)
        self.layers = nn.ModuleList([nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
                                     for _ in range(3)])
        self.out = nn.Linear(32, 2)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            if self.training and torch.rand(1) < self.p:
                continue
            h = layer(h)
        return self.out(h.mean(1))


def test_layer_drop_trains_by_parts_and_the_callers_weights_stay_as_they_were():
    torch.manual_seed(0)
    model = LayerDropEncoder().train()
    x, y = torch.randn(8, 10, 8), torch.randint(0, 2, (8,))
    before = copy.deepcopy(model.state_dict())
    fast = amppass.convert(model, (x,), "bf16", mode="train", plan_for="coverage")
    record = parts_of(fast)
    assert record.converted == ["embed", "layers.0", "layers.1", "layers.2", "out"] and record.mode == "train"

    optimizer = torch.optim.SGD(fast.parameters(), lr=0.1)
    losses = []
    torch.manual_seed(1)
    for _ in range(12):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(fast(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    fast.eval()
    model.load_state_dict(fast.state_dict())  # the original's keys, loadable by the plain class
    with torch.no_grad():
        got, want = fast(x), model.eval()(x)
    assert (got - want).norm() / want.norm() < 0.05


def test_a_functions_own_backward_runs_in_the_converted_model():
    """A straight-through estimator: torch.export would differentiate round() (zero); by parts the Function
    runs as itself between the converted layers, so fc1 gets the gradient the model's own backward gives."""
    from tests.helpers.autograd_functions import Net, function_input

    torch.manual_seed(0)
    model = Net(RoundSTE).train()
    reference = copy.deepcopy(model)
    fast = amppass.convert(model, (function_input(),), "bf16", mode="train", plan_for="coverage")
    assert "RoundSTE" in parts_of(fast).why_whole and "fc1" in parts_of(fast).converted
    fast(function_input()).square().mean().backward()
    reference(function_input()).square().mean().backward()
    grad, want = fast.fc1.weight.grad, reference.fc1.weight.grad
    assert want.norm() > 1e-2 and (grad - want).norm() / want.norm() < 0.05
    assert all(p.grad is None for p in model.parameters())


def test_calibration_batches_reach_each_part():
    model, images = _detector()
    batches = [(torch.randn(1, 3, 16, 16),) for _ in range(3)]
    fast = amppass.convert(model, (images,), "bf16", calibration=batches, plan_for="coverage")
    assert parts_of(fast).converted
    assert all(amppass.report(part).info.get("calibrated") for part in parts_of(fast).modules(fast).values())


def test_a_model_no_part_of_which_captures_keeps_the_capture_error():
    class Opaque(nn.Module):
        def forward(self, x):
            return x[torch.nonzero(x > 0).squeeze(-1)] if x.sum() > 0 else x

    with pytest.raises(CaptureError, match="No submodule of Opaque converts on its own either"):
        amppass.convert(Opaque(), (torch.randn(8),), "bf16")


class Cached(nn.Module):
    """Stores a tensor derived from its input on itself, as ultralytics' Detect head caches its anchors."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.shape, self.grid = None, None

    def forward(self, x):
        if self.shape != x.shape:
            self.grid, self.shape = torch.arange(x.shape[0], dtype=x.dtype)[:, None], x.shape
        return self.fc(x) + self.grid


def test_what_the_model_stores_on_itself_while_traced_stays_off_the_callers_model():
    model = Cached().eval()
    amppass.convert(model, (torch.randn(3, 4),), "bf16", plan_for="coverage")
    assert model.grid is None or type(model.grid) is torch.Tensor
    with torch.no_grad():
        assert model(torch.randn(5, 4)).shape == (5, 4)


def test_measured_macs_counts_eager_code_and_splits_low():
    conv, x = nn.Conv2d(3, 8, 3), torch.randn(2, 3, 16, 16)
    expected = 2 * 8 * 14 * 14 * 3 * 9
    assert measured_macs(lambda: conv(x)) == (expected, 0)
    low = copy.deepcopy(conv).to(torch.bfloat16)
    assert measured_macs(lambda: low(x.bfloat16())) == (expected, expected)
    q = torch.randn(2, 4, 16, 8)
    assert measured_macs(lambda: nn.functional.scaled_dot_product_attention(q, q, q))[0] == 2 * 4 * 16 * 16 * 16


class TiedLM(nn.Module):
    """A masked LM's decoder tied to its embeddings, with a branch on a value from the data between them."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.GELU())
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.body(self.embed(ids))
        if h.mean() > 10:  # never on these weights, but no single graph takes it
            h = h * 0
        return self.head(h)


def test_a_parameter_two_parts_share_trains_as_one():
    torch.manual_seed(0)
    model = TiedLM().train()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 50, (4, 6))
    fast = amppass.convert(model, (ids,), "bf16", mode="train", plan_for="coverage")
    assert "head" in parts_of(fast).converted  # the embedding alone runs nothing low: it stays the model's
    assert fast.head.weight is fast.embed.weight
    assert len(list(fast.parameters())) == len(list(reference.parameters()))
    fast(ids).square().mean().backward()
    reference(ids).square().mean().backward()
    grad, want = fast.embed.weight.grad, reference.embed.weight.grad
    assert (grad - want).norm() / want.norm() < 0.05  # both uses' gradients, as the model's own


def test_a_transformers_model_converted_by_parts_saves_what_its_class_loads(tmp_path):
    """XLM-RoBERTa-XL writing into its input cache converts by parts; save_pretrained writes the original's keys
    and fp32 weights, so the plain class loads the original model back."""
    transformers = pytest.importorskip("transformers")

    config = transformers.XLMRobertaXLConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                             num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.XLMRobertaXLForCausalLM(config).eval()
    ids = torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    cache = transformers.DynamicCache(config=config)
    fast = amppass.convert(model, example_kwargs={"input_ids": ids, "cache": cache, "use_cache": True},
                           dtype="bf16", plan_for="coverage")
    assert parts_of(fast).converted
    fast.save_pretrained(tmp_path / "saved")
    model.save_pretrained(tmp_path / "original")
    loaded = transformers.XLMRobertaXLForCausalLM.from_pretrained(tmp_path / "saved").eval()
    want = transformers.XLMRobertaXLForCausalLM.from_pretrained(tmp_path / "original").eval()
    assert set(loaded.state_dict()) == set(want.state_dict())
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


class LossHead(nn.Module):
    """A head whose parent calls its loss method besides its forward (torchvision's RetinaNet head)."""

    def __init__(self):
        super().__init__()
        self.fc, self.weight_of_loss = nn.Linear(16, 4), 0.5

    def forward(self, h):
        return self.fc(h)

    def compute_loss(self, out, target):
        return self.weight_of_loss * self._distance(out, target)

    @staticmethod
    def _distance(out, target):
        return (out - target).square().mean()


class TrainsWithItsHeadsLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(8, 16), LossHead()

    def forward(self, x, target):
        h = torch.relu(self.body(x))
        if h.sum() > 0:  # a branch on the data: no single graph takes the model
            h = h * 2
        return self.head.compute_loss(self.head(h), target)


def test_a_part_trained_by_parts_keeps_the_other_methods_its_parent_calls():
    torch.manual_seed(0)
    model, x, target = TrainsWithItsHeadsLoss().train(), torch.randn(4, 8), torch.randn(4, 4)
    reference = copy.deepcopy(model)
    fast = amppass.convert(model, (x, target), "fp16", mode="train", plan_for="coverage")
    assert "head" in parts_of(fast).converted and fast.head.weight_of_loss == 0.5
    loss, expected = fast(x, target), reference(x, target)
    loss.backward(), expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-2, atol=1e-3)
    grad, want = fast.head.fc.weight.grad, reference.head.fc.weight.grad
    assert (grad - want).norm() / want.norm() < 0.02


def test_what_a_part_warns_is_noted_at_info_with_no_filter_on_any_logger(monkeypatch, caplog):
    """One warning for the conversion: what amppass warns while a part converts goes into the parts record and is
    logged at info level, without a filter on any logger while it converts, and amppass's logger is as it was."""
    import logging

    from amppass.pipelines import convert as convert_module

    package = logging.getLogger("amppass")
    before = (list(package.handlers), package.propagate)
    filters: list[object] = []
    whole = convert_module._convert_module

    def warning_one(model, *args, **kwargs):
        filters.extend(f for name, logger in logging.Logger.manager.loggerDict.items()
                       if name.startswith("amppass") and isinstance(logger, logging.Logger) for f in logger.filters)
        logging.getLogger("amppass.pipelines.convert").warning("converting %s", type(model).__name__)
        return whole(model, *args, **kwargs)

    monkeypatch.setattr(convert_module, "_convert_module", warning_one)
    model, images = _detector()
    with caplog.at_level(logging.INFO, logger="amppass"):
        fast = amppass.convert(model, (images,), "bf16", plan_for="coverage")
    said = {record.getMessage(): record.levelname for record in caplog.records
            if record.getMessage().startswith("converting ")}
    assert said == {"converting Detector": "WARNING", "converting Sequential": "INFO", "converting Scorer": "INFO",
                    "converting Linear": "INFO"}
    assert parts_of(fast).notes["backbone"] == ["converting Sequential"]
    assert parts_of(fast).notes["head"] == ["converting Scorer"]
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "by parts" in r.getMessage()]
    assert filters == [] and (list(package.handlers), package.propagate) == before


class Saving(Detector):
    """A class with its own save method (as sentence-transformers' ``save``)."""

    def save(self, folder):
        torch.save(self.state_dict(), f"{folder}/weights.pt")


def test_a_model_converted_by_parts_is_an_artifact_of_its_own_class(tmp_path):
    """Its class (not its instance) holds the save method writing the original, copies stay what they are."""
    from amppass.serving.artifact import record_of
    from amppass.serving.parts import ByParts

    torch.manual_seed(0)
    model, images = Saving().eval(), torch.randn(1, 3, 16, 16)
    fast = amppass.convert(model, (images,), "bf16", plan_for="coverage")
    assert isinstance(fast, ByParts) and isinstance(fast, Saving) and type(fast).__name__ == "Saving"
    assert "save" not in vars(fast) and record_of(fast).kind == "parts"
    fast.save(tmp_path)
    saved = torch.load(tmp_path / "weights.pt")
    assert saved.keys() == model.state_dict().keys()
    assert all(torch.equal(saved[k], v) and saved[k].dtype == v.dtype for k, v in model.state_dict().items())
    twin = copy.deepcopy(fast)
    assert type(twin) is type(fast) and parts_of(twin).converted == parts_of(fast).converted
    with torch.no_grad():
        assert torch.equal(twin(images)[0], fast(images)[0])


def test_only_the_converting_context_is_noted_and_other_threads_keep_their_warnings(caplog):
    """The handler acts in the context of the part being converted: another thread's warning at that moment stays
    a warning, an error stays an error, and amppass's logger is as it was after."""
    import logging
    import threading

    from amppass.pipelines.parts import _notes_of
    from amppass.serving.parts import PartsRecord

    record = PartsRecord(converted=[], eager={}, macs=None, dtype="bf16", mode="inference", why_whole="a branch")
    log, package = logging.getLogger("amppass.pipelines.convert"), logging.getLogger("amppass")
    before = (list(package.handlers), package.propagate)
    with caplog.at_level(logging.INFO, logger="amppass"):
        with _notes_of(record, "head"):
            log.warning("here")
            other = threading.Thread(target=log.warning, args=("elsewhere",))
            other.start()
            other.join()
            log.error("an error")
    assert {r.getMessage(): r.levelname for r in caplog.records} == {"here": "INFO", "elsewhere": "WARNING",
                                                                     "an error": "ERROR"}
    assert record.notes == {"head": ["here"]} and (list(package.handlers), package.propagate) == before
