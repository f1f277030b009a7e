"""A converted inference module faces its caller in fp32 (issue 24, item 7): code that casts its input to
``next(net.parameters()).dtype`` or reads ``net.dtype`` feeds fp32, the graph keeps its low copies."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amppass
from amppass.fx.face import stored_parameters


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
    assert sum(t.numel() * t.element_size() for t in held) == sum(t.numel() * t.element_size() for t in stored.values()), "no fp32 copy is held"
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
