"""export_onnx keeps batch, sequence and image dims dynamic where the model takes any size, exports without
autograd, and warns when it falls back."""

from __future__ import annotations

import logging
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
import torch

import amppass
from amppass.pipelines import export_onnx as export
from amppass.pipelines import export_shapes
from models import build
from tests.helpers.paths import ROOT


def dims(model) -> list[list]:
    return [[d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input]


def run(path, model, *inputs) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {i.name: x.numpy() for i, x in zip(model.graph.input, inputs, strict=False)})[0]


def rel(out: np.ndarray, ref: torch.Tensor) -> float:
    return float(np.linalg.norm(out - ref.numpy()) / np.linalg.norm(ref.numpy()))


def test_a_two_by_sixteen_export_serves_batch_six_and_another_length(tmp_path):
    case = build("bert", batch=2, seq=16)
    path = tmp_path / "bert.fp16.onnx"
    model = amppass.export_onnx(case.model, case.example_inputs, path, dtype="fp16")
    assert all(isinstance(d, str) for d in dims(model)[0]), dims(model)
    for batch, seq in ((6, 16), (1, 9), (3, 40)):
        ids = build("bert", batch=batch, seq=seq).make_inputs(batch)[0]
        with torch.no_grad():
            ref = case.model(ids).last_hidden_state
        assert rel(run(path, model, ids), ref) < 1e-2


def test_a_batch_of_one_stays_dynamic_and_features_stay_fixed(tmp_path):
    case = build("mlp", batch=1)
    model = amppass.export_onnx(case.model, case.example_inputs, tmp_path / "mlp.onnx", dtype="fp16")
    assert isinstance(dims(model)[0][0], str) and dims(model)[0][1] == 64
    x = torch.randn(5, 64)
    with torch.no_grad():
        assert rel(run(tmp_path / "mlp.onnx", model, x), case.model(x)) < 1e-2
    fixed = amppass.export_onnx(case.model, case.example_inputs, tmp_path / "fixed.onnx", dynamic_shapes=None)
    assert dims(fixed) == [[1, 64]]


def test_exported_without_autograd_and_a_fallback_is_a_warning_with_the_same_dynamic_dims(
    tmp_path, monkeypatch, caplog
):
    case = build("mlp", batch=2)
    real = torch.onnx.export
    seen = []

    def dynamo_fails(*args, dynamo=True, **kwargs):
        seen.append((dynamo, torch.is_grad_enabled()))
        if dynamo:
            raise RuntimeError("unsupported op in this test")
        return real(*args, dynamo=False, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", dynamo_fails)
    with caplog.at_level(logging.WARNING, logger="amppass"):
        model = amppass.export_onnx(case.model, case.example_inputs, tmp_path / "m.onnx", dtype="fp16")
    assert [grad for _, grad in seen] == [False] * len(seen) and seen[-1][0] is False
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "TorchScript" in r.getMessage()]
    assert warned and "unsupported op in this test" in warned[0].getMessage()
    assert dims(model)[0][0] == "x_0" and dims(model)[0][1] == 64
    x = torch.randn(7, 64)
    with torch.no_grad():
        assert rel(run(tmp_path / "m.onnx", model, x), case.model(x)) < 1e-2


def test_both_exporters_failing_is_one_capture_error(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.onnx, "export", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("nope")))
    with pytest.raises(amppass.CaptureError, match="dynamo=True: RuntimeError: nope.*dynamo=False"):
        export.export_fp32(build("mlp").model, build("mlp").example_inputs)


class _ProposalNet(torch.nn.Module):
    """A fully convolutional face-proposal net (an MTCNN P-Net's shape): meant for any image size."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 10, 3), torch.nn.PReLU(10), torch.nn.MaxPool2d(2, 2, ceil_mode=True),
            torch.nn.Conv2d(10, 16, 3), torch.nn.PReLU(16), torch.nn.Conv2d(16, 32, 3), torch.nn.PReLU(32))
        self.prob, self.box = torch.nn.Conv2d(32, 2, 1), torch.nn.Conv2d(32, 4, 1)

    def forward(self, image):
        features = self.body(image)
        return torch.softmax(self.prob(features), dim=1), self.box(features)


def test_a_fully_convolutional_net_takes_other_image_sizes(tmp_path):
    """main: 'INVALID_ARGUMENT : Got invalid dimensions for input' at any size but the example's."""
    net = _ProposalNet().eval()
    model = amppass.export_onnx(net, (torch.randn(1, 3, 24, 24),), tmp_path / "pnet.onnx")
    assert dims(model)[0][1] == 3 and all(isinstance(d, str) for d in dims(model)[0][2:]), dims(model)
    session = ort.InferenceSession(str(tmp_path / "pnet.onnx"), providers=["CPUExecutionProvider"])
    for size in ((2, 3, 60, 40), (1, 3, 37, 53)):
        image = torch.randn(*size)
        got = session.run(None, {model.graph.input[0].name: image.numpy()})
        with torch.no_grad():
            want = net(image)
        assert [g.shape for g in got] == [tuple(w.shape) for w in want]
        assert max(rel(g, w) for g, w in zip(got, want, strict=False)) < 1e-2


def test_spatial_sizes_a_linear_head_fixes_stay_fixed(tmp_path):
    """A Linear reading the flattened feature map takes one image size: the export says so instead of
    declaring free sizes onnxruntime would fail on at run time."""
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(4 * 8 * 8, 5)).eval()
    model = amppass.export_onnx(net, (torch.randn(2, 3, 8, 8),), tmp_path / "head.onnx")
    assert isinstance(dims(model)[0][0], str) and dims(model)[0][1:] == [3, 8, 8]
    x = torch.randn(5, 3, 8, 8)
    with torch.no_grad():
        assert rel(run(tmp_path / "head.onnx", model, x), net(x)) < 1e-2


class _MaskedConv(torch.nn.Module):
    """A fully convolutional net whose first argument is an optional mask, passed as None."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, mask, image):
        out = self.conv(image)
        return out if mask is None else out * mask


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_a_none_argument_before_the_image_keeps_its_sizes_dynamic(tmp_path, monkeypatch, exporter):
    """main fed onnxruntime the Python arguments by position (None for the image), so the size check failed
    and the image sizes were fixed; the TorchScript exporter was given a name for the None argument and refused."""
    if exporter == "torchscript":
        real = torch.onnx.export
        monkeypatch.setattr(torch.onnx, "export", lambda *a, dynamo=True, **k: real(*a, dynamo=False, **k)
                            if not dynamo else (_ for _ in ()).throw(RuntimeError("dynamo off in this test")))
    net = _MaskedConv().eval()
    model = amppass.export_onnx(net, (None, torch.randn(1, 3, 16, 16)), tmp_path / "masked.onnx")
    assert [i.name for i in model.graph.input] == ["image"]
    assert dims(model)[0][1] == 3 and all(isinstance(d, str) for d in dims(model)[0][2:]), dims(model)
    image = torch.randn(2, 3, 20, 12)
    with torch.no_grad():
        assert rel(run(tmp_path / "masked.onnx", model, image), net(None, image)) < 1e-2


class _EncoderDecoder(torch.nn.Module):
    """Five stride-2 stages down and up with skip additions: takes only sizes divisible by 32."""

    def __init__(self):
        super().__init__()
        self.down = torch.nn.ModuleList(torch.nn.Conv2d(3 if i == 0 else 4, 4, 3, stride=2, padding=1)
                                        for i in range(5))
        self.up = torch.nn.ModuleList(torch.nn.ConvTranspose2d(4, 4, 2, stride=2) for _ in range(5))

    def forward(self, image):
        skips, x = [], image
        for conv in self.down:
            skips.append(x)
            x = torch.relu(conv(x))
        for conv, skip in zip(self.up, reversed([None] + skips[1:]), strict=False):
            x = conv(x)
            x = x if skip is None else x + skip
        return x


def test_the_size_check_runs_a_modest_size_change_that_keeps_the_stride(tmp_path, monkeypatch):
    """main ran the fp32 model at twice the example's height and width (four times the pixels)."""
    fed = []
    real_run = ort.InferenceSession.run

    def recording(self, outputs, feeds, *args, **kwargs):
        fed.append({name: array.shape for name, array in feeds.items()})
        return real_run(self, outputs, feeds, *args, **kwargs)

    monkeypatch.setattr(ort.InferenceSession, "run", recording)
    net = _EncoderDecoder().eval()
    model = amppass.export_onnx(net, (torch.randn(1, 3, 224, 96),), tmp_path / "unet.onnx")
    assert fed[0] == {"image": (2, 3, 256, 128)}  # the batch grown too; +32 each: four times would be (448, 192)
    assert all(isinstance(d, str) for d in dims(model)[0][2:]), dims(model)
    image = torch.randn(1, 3, 160, 64)
    with torch.no_grad():
        assert rel(run(tmp_path / "unet.onnx", model, image), net(image)) < 1e-2
    # a batch or short sequence grows by its power-of-two divisor (1 -> 2, 2 -> 4), an image past 16 by 32 to 64
    assert [export_shapes.grown(n) for n in (1, 2, 7, 16, 224, 256, 512, 1024)] == [2, 4, 8, 32, 256, 320, 576, 1088]


def test_export_is_quiet(tmp_path):
    """main printed torch's exporter lines ('torchvision is not installed. Skipping ...') and a FutureWarning."""
    code = ("import sys, torch, amppass\n"
            "net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval()\n"
            "amppass.export_onnx(net, (torch.randn(1, 3, 8, 8),), sys.argv[1])\n")
    done = subprocess.run([sys.executable, "-W", "always", "-c", code, str(tmp_path / "m.onnx")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("", "")


def test_an_exporter_failure_is_named_by_its_innermost_cause_without_terminal_colours():
    """The dynamo exporter wraps the real error in a page of advice with terminal colours; the CaptureError
    quotes the cause (here: an op with no ONNX function), one line, no escapes."""
    from amppass.pipelines.export_onnx import _why

    try:
        try:
            raise KeyError("No ONNX function found for transformers.grouped_mm_fallback")
        except KeyError as inner:
            raise RuntimeError(
                "Failed to convert. \x1b[96mThis is step 3/3\x1b[0m of exporting.\nNext steps"
            ) from inner
    except RuntimeError as err:
        why = _why(err)
    assert why == "KeyError: 'No ONNX function found for transformers.grouped_mm_fallback'"
    assert _why(RuntimeError("\x1b[96mstep\x1b[0m one\ntwo")) == "RuntimeError: step one"


def test_a_float32_export_that_differs_from_the_model_is_said(caplog, tmp_path):
    """The exporter's own error (here a model whose exported graph computes something else: a Python float read
    at export time and changed after) is measured on the example and named in a warning; an exact export says
    nothing."""
    import logging

    from amppass.pipelines.export_onnx import _say_if_the_export_differs, export_fp32

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.scale = torch.nn.Linear(8, 8), 1.0

        def forward(self, x):
            return self.linear(x) * self.scale

    def warned() -> list[str]:
        # amppass's warnings only: caplog also holds what other loggers wrote (pytest 9.2 keeps the DEBUG
        # records torch's tracing writes during export_fp32, before the with block)
        return [r.getMessage() for r in caplog.records if r.name.startswith("amppass") and r.levelno >= logging.WARNING]

    model, x = Scaled().eval(), torch.randn(2, 8)
    fp32 = export_fp32(model, (x,))
    with caplog.at_level(logging.WARNING, logger="amppass"):
        assert _say_if_the_export_differs(fp32, model, (x,)) < 1e-6 and not warned()
        model.scale = 1.01  # the export baked 1.0 in
        assert abs(_say_if_the_export_differs(fp32, model, (x,)) - 0.01 / 1.01) < 1e-4
    assert len(warned()) == 1
    assert "the float32 ONNX export differs from the PyTorch model on the example by 0.0099" in warned()[0]


def test_a_declared_dynamic_batch_the_file_cannot_run_is_found(tmp_path):
    """A Reshape to a shape holding the example's batch (what the dynamo exporter wrote for LeViT, SD3 and Flux):
    the file declares a dynamic batch that only runs at 1. The check runs every declared dimension grown."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])], "baked",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 4])],
        [helper.make_tensor("shape", TensorProto.INT64, [3], [1, 2, 4])])
    path = tmp_path / "baked.onnx"
    import onnx

    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), path)
    example = (torch.randn(1, 8),)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])  # it takes the file
    assert session.run(None, {"x": example[0].numpy()})[0].shape == (1, 2, 4)
    assert export_shapes.cannot_vary(session, ["x"], example, {"x": {0: torch.export.Dim.AUTO}}) == {("x", 0)}
    assert export_shapes.cannot_vary(session, ["x"], example, None) == set()


def test_the_export_keeps_the_most_dynamic_shapes_the_file_runs_and_the_report_names_the_fixed(tmp_path):
    """Spatial sizes a Linear head fixes are fixed (the batch stays dynamic), and the converted file says so."""
    from torch.export import Dim

    shapes = {"image": {0: Dim.AUTO, 2: Dim.AUTO, 3: Dim.AUTO}, "mask": None}
    assert export_shapes.attempts(shapes) == [shapes, {"image": {0: Dim.AUTO}, "mask": None}, None]

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1), torch.nn.Linear(4 * 8 * 8, 2)

        def forward(self, image):
            return self.fc(self.conv(image).flatten(1))

    model = amppass.export_onnx(Head().eval(), (torch.randn(2, 3, 16, 16),), tmp_path / "head.onnx")
    assert isinstance(dims(model)[0][0], str) and dims(model)[0][2:] == [16, 16]
    info = amppass.report(model).info
    assert info["fixed_dims"] == ["image dim 2 (16)", "image dim 3 (16)"]
    assert "sizes fixed at the example's in the file" in amppass.report(model).summary()
    assert run(tmp_path / "head.onnx", model, torch.randn(3, 3, 16, 16)).shape == (3, 2)


def test_the_size_check_grows_the_batch_and_the_other_dims_apart_too(tmp_path, monkeypatch):
    """timm's Swin exported from 2x128x128 ran at batch 4 and 192x192 but not at batch 2 and 192x192 (a size baked
    from the example): growing every dimension at once hid it. A file that fails with one kind grown fails the check."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "free",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "length"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "length"])])
    path = tmp_path / "free.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), path)
    fed, refused = [], set()
    real_run = ort.InferenceSession.run

    def run_unless_refused(self, outputs, feeds, *args, **kwargs):
        fed.append(feeds["x"].shape)
        if feeds["x"].shape in refused:
            raise RuntimeError("Reshape: a size baked from the example")
        return real_run(self, outputs, feeds, *args, **kwargs)

    monkeypatch.setattr(ort.InferenceSession, "run", run_unless_refused)
    both = {"x": {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}}
    example = (torch.randn(2, 6),)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert export_shapes.cannot_vary(session, ["x"], example, both) == set()
    assert fed == [(4, 8), (4, 6), (2, 8)]
    refused.add((2, 8))
    fed.clear()  # the length alone is what fails: the batch stays dynamic
    assert export_shapes.cannot_vary(session, ["x"], example, both) == {("x", 1)}
    assert fed == [(4, 8), (4, 6), (2, 8), (4, 6), (4, 8), (4, 6), (2, 8)]
    fed.clear()
    assert export_shapes.cannot_vary(session, ["x"], example, {"x": {0: torch.export.Dim.AUTO}}) == set()
    assert fed == [(4, 6)]  # one kind declared: one run


class _EdgeScorer(torch.nn.Module):
    """A graph net's edge scores: node features [nodes, 8] and ``edge_index`` [2, edges], whose leading 2 (source and
    destination rows) cannot vary while the node and edge counts can."""

    def __init__(self):
        super().__init__()
        self.lin, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)

    def forward(self, x, edge_index):
        src, dst = edge_index
        return self.out(torch.relu(self.lin(x)[src] + x[dst]))


def test_only_the_dimension_that_cannot_vary_is_fixed_and_the_report_names_it(tmp_path, monkeypatch):
    """main fixed every input's size when edge_index's leading 2 could not vary (the TorchScript exporter writes
    the unpacking as a Split into two rows): the nodes and edges were fixed too, and the file took one graph size."""
    real = torch.onnx.export
    monkeypatch.setattr(torch.onnx, "export", lambda *a, dynamo=True, **k: real(*a, dynamo=False, **k)
                        if not dynamo else (_ for _ in ()).throw(RuntimeError("dynamo off in this test")))
    torch.manual_seed(0)
    net = _EdgeScorer().eval()
    model = amppass.export_onnx(net, (torch.randn(5, 8), torch.randint(0, 5, (2, 12))), tmp_path / "edges.onnx")
    assert [i.name for i in model.graph.input] == ["x", "edge_index"]
    nodes, edges = dims(model)
    assert isinstance(nodes[0], str) and nodes[1] == 8 and edges[0] == 2 and isinstance(edges[1], str), dims(model)
    assert amppass.report(model).info["fixed_dims"] == ["edge_index dim 0 (2)"]
    assert "sizes fixed at the example's in the file (the export does not run at others): edge_index dim 0 (2)" in (
        amppass.report(model).summary())
    x, edge_index = torch.randn(9, 8), torch.randint(0, 9, (2, 30))
    with torch.no_grad():
        assert rel(run(tmp_path / "edges.onnx", model, x, edge_index), net(x, edge_index)) < 1e-2
