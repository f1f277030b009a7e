"""A converted inference module faces its caller in fp32: code that casts its input to
``next(net.parameters()).dtype`` or reads ``net.dtype`` feeds fp32, the graph keeps its low copies."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amppass
from amppass.serving.fp32_parameters import stored_parameters


class PNet(nn.Module):
    """The first stage of a face-detection cascade: conv-PReLU-pool, then per-cell face scores and boxes."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 10, 3), nn.PReLU(10), nn.MaxPool2d(2, 2, ceil_mode=True),
                                  nn.Conv2d(10, 16, 3), nn.PReLU(16), nn.Conv2d(16, 32, 3), nn.PReLU(32))
        self.score = nn.Conv2d(32, 2, 1)
        self.box = nn.Conv2d(32, 4, 1)

    def forward(self, x):
        h = self.body(x)
        return torch.softmax(self.score(h), 1), self.box(h)


def _detect(net, image):
    """The cascade's own call: the image goes to the dtype of the net's first parameter."""
    return net(image.to(next(net.parameters()).dtype))


def _pnet():
    torch.manual_seed(0)
    return PNet().eval()


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_input_cast_to_the_parameters_dtype_runs_the_converted_graph(dtype):
    net, image = _pnet(), torch.rand(1, 3, 48, 40)
    fast = amppass.convert(net, (image,), dtype, plan_for="coverage")
    scores, boxes = _detect(fast, image)
    ref_scores, ref_boxes = net(image)
    assert scores.dtype == boxes.dtype == torch.float32
    assert torch.allclose(scores, ref_scores, atol=2e-2) and torch.allclose(boxes, ref_boxes, atol=5e-2)
    assert fast.dtype == torch.float32
    assert len(amppass.report(fast).info["plans"]) == 1, "the fp32 call runs the example's plan, no re-capture"


def test_the_face_is_fp32_while_the_graph_stores_low_copies_once():
    net, image = _pnet(), torch.rand(1, 3, 48, 40)
    fast = amppass.convert(net, (image,), "fp16", plan_for="coverage")
    stored = {name: t for name, t in fast.state_dict().items() if t.is_floating_point()}
    assert {t.dtype for t in stored.values()} == {torch.float16}, "the graph runs with its low copies"
    face = dict(fast.named_parameters())
    assert set(face) == {n for n, _ in stored_parameters(fast)}, "the storage's names, no copies twice"
    assert {p.dtype for p in face.values()} == {torch.float32}
    for name, widened in face.items():
        assert torch.equal(widened, stored[name].float())
        assert not widened.requires_grad
    assert face["body.0.weight"] is not dict(fast.named_parameters())["body.0.weight"], "made on each call, not kept"
    held = [t for _, t in stored_parameters(fast)] + list(fast.buffers())
    assert sum(t.numel() * t.element_size() for t in held) == sum(
        t.numel() * t.element_size() for t in stored.values()
    ), "no fp32 copy is held"
    assert sum(p.numel() for p in fast.parameters()) == sum(p.numel() for p in net.parameters())


def test_low_precision_outputs_show_the_storage_as_it_is():
    net, image = _pnet(), torch.rand(1, 3, 48, 40)
    fast = amppass.convert(net, (image,), "fp16", plan_for="coverage", keep_io_types=False)
    assert next(fast.parameters()).dtype == torch.float16 and fast.dtype == torch.float16


def test_a_weight_read_in_both_precisions_is_listed_once_in_fp32():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return x @ self.w + torch.exp(self.w).sum()  # matmul low, exp fp32: the weight is read in both

    x = torch.randn(4, 8)
    fast = amppass.convert(Tied(), (x,), "fp16", plan_for="coverage")
    stored = dict(stored_parameters(fast))
    assert any(name.endswith("__fp16") for name in stored), "the graph keeps an fp16 copy beside the weight"
    assert [(n, p.dtype) for n, p in fast.named_parameters()] == [("w", torch.float32)]


def test_a_loaded_model_faces_fp32_too(tmp_path):
    net, image = _pnet(), torch.rand(1, 3, 48, 40)
    fast = amppass.convert(net, (image,), "fp16", plan_for="coverage")
    amppass.save(fast, tmp_path / "pnet.pt2")
    loaded = amppass.load(tmp_path / "pnet.pt2")
    scores, _ = _detect(loaded, image)
    assert torch.allclose(scores, _detect(fast, image)[0])


@pytest.mark.parametrize("given", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("keep_io_types", [True, False])
def test_an_input_of_another_float_dtype_is_cast_at_the_boundary_without_a_recapture(given, keep_io_types, caplog):
    """A pipeline that already holds bf16/fp16 images (or fp64 ones) feeds them as they are. Before, a bf16
    input re-captured and re-converted the model, and fp16 or fp64 ones then failed inside the graph with
    ``mat1 and mat2 must have the same dtype, but got Half and BFloat16``, a dtype the user never chose;
    torch.autocast runs all three. Now the input is cast to the example's dtype, logged once."""
    net, image = _pnet(), torch.rand(2, 3, 24, 24)
    fast = amppass.convert(net, (image,), dtype="bf16", plan_for="coverage", keep_io_types=keep_io_types)
    expected = net(image)
    with caplog.at_level("INFO", logger="amppass"):
        for _ in range(2):
            got = fast(image.to(given))
    for ours, theirs in zip(got, expected, strict=False):
        assert ours.dtype == torch.float32 or not keep_io_types
        assert (ours.float() - theirs).norm() <= 2e-2 * theirs.norm()
    assert len(fast.plans) == 1 and "capturing and converting it again" not in caplog.text
    told = [
        r.getMessage() for r in caplog.records if "cast to the dtype the model was converted with" in r.getMessage()
    ]
    assert len(told) == 1 and str(given).replace("torch.", "") in told[0]


def test_a_train_mode_model_casts_a_low_precision_input_and_gradients_reach_it():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).train()
    x = torch.randn(8, 16)
    fast = amppass.convert(net, (x,), dtype="fp16", mode="train", plan_for="coverage")
    low = x.to(torch.bfloat16).requires_grad_()
    fast(low).float().sum().backward()
    assert low.grad is not None and low.grad.dtype == torch.bfloat16 and torch.isfinite(low.grad).all()
    assert all(p.grad is not None for p in fast.parameters())


@pytest.mark.parametrize("change", ["to_own_dtype", "float", "half", "double", "to_device_and_dtype"])
def test_dtype_changes_leave_the_plan_s_dtypes_and_the_model_working(change, caplog):
    """``fast.to(fast.dtype)`` (a no-op by what the module says), ``.float()``, ``.half()``, ``.to(device, dtype)``:
    pipelines call them. They widened or narrowed the stored weights under the graph's casts, and the next call
    raised ``mat1 and mat2 must have the same dtype, but got BFloat16 and Float``. The device follows; the
    dtypes stay the plan's, logged once."""
    net, image = _pnet(), torch.rand(2, 3, 24, 24)
    fast = amppass.convert(net, (image,), dtype="bf16", plan_for="coverage")
    before = {k: v.dtype for k, v in fast.state_dict().items()}
    expected = fast(image)
    calls = {"to_own_dtype": lambda m: m.to(m.dtype), "float": lambda m: m.float(), "half": lambda m: m.half(),
             "double": lambda m: m.double(), "to_device_and_dtype": lambda m: m.to("cpu", torch.float16)}
    with caplog.at_level("INFO", logger="amppass"):
        moved = calls[change](fast)
    assert moved is fast and {k: v.dtype for k, v in fast.state_dict().items()} == before
    for ours, theirs in zip(fast(image), expected, strict=False):
        torch.testing.assert_close(ours, theirs)
    told = [r for r in caplog.records if "keeps the dtypes its plan chose" in r.getMessage()]
    assert len(told) == 1 and (told[0].levelname == "INFO") == (change in ("to_own_dtype", "float"))


def test_a_train_mode_model_keeps_fp32_master_weights_under_half():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).train()
    x = torch.randn(8, 16)
    fast = amppass.convert(net, (x,), dtype="fp16", mode="train", plan_for="coverage").half()
    assert all(p.dtype == torch.float32 for p in fast.parameters())
    fast(x).float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in fast.parameters())
