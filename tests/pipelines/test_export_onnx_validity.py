"""A file an exporter writes without raising but that is not valid (onnxruntime cannot load it, or onnx.checker
refuses it) counts as that exporter failing: the TorchScript exporter is tried, and where both fail the error
names both. (torch's dynamo exporter wrote such a Squeeze for an LSTM-based speech model.)"""

from __future__ import annotations

import logging
import tomllib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper

import amppass
from tests.helpers.paths import ROOT


class Tagger(torch.nn.Module):
    """A frame tagger: convolutions over frames, [batch, frames, 8] -> [batch, frames, 3]. (An LSTM would be the
    speech model's own layer, but onnxruntime's CPU provider crashes loading the fp16 LSTM a conversion writes.)"""

    def __init__(self):
        super().__init__()
        self.body, self.head = torch.nn.Conv1d(8, 16, 3, padding=1), torch.nn.Conv1d(16, 3, 1)

    def forward(self, frames):
        return self.head(torch.relu(self.body(frames.transpose(1, 2)))).transpose(1, 2)


def _squeeze_onnxruntime_refuses(path) -> None:
    """Append a Squeeze of an axis of size 3 (the tags) to the file's output: valid for onnx.checker, refused by
    onnxruntime's shape inference when it loads the file."""
    model = onnx.load(path)
    out = model.graph.output[0]
    axis = next(i for i, d in enumerate(out.type.tensor_type.shape.dim) if d.dim_value > 1)
    model.graph.initializer.append(helper.make_tensor("bad_axes", onnx.TensorProto.INT64, [1], [axis]))
    model.graph.node.append(helper.make_node("Squeeze", [out.name, "bad_axes"], ["squeezed"]))
    model.graph.output.remove(out)
    model.graph.output.append(helper.make_tensor_value_info("squeezed", onnx.TensorProto.FLOAT, ["b", "f"]))
    onnx.save(model, path)


def _unknown_op(path) -> None:
    """Replace the file's graph by one node of an op the default domain does not have: onnx.checker refuses it."""
    model = onnx.load(path)
    out = model.graph.output[0].name
    del model.graph.node[:]
    model.graph.node.append(helper.make_node("NoSuchOp", [model.graph.input[0].name], [out]))
    onnx.save(model, path)


@pytest.fixture
def broken(monkeypatch):
    """torch.onnx.export writing a broken file with the exporters named in the returned set (and raising nothing)."""
    real, which = torch.onnx.export, {}

    def export(model, args, path, *rest, dynamo=True, **kwargs):
        result = real(model, args, path, *rest, dynamo=dynamo, **kwargs)
        if dynamo in which:
            which[dynamo](path)
        return result

    monkeypatch.setattr(torch.onnx, "export", export)
    return which


def test_a_dynamo_file_onnxruntime_cannot_load_falls_back_to_torchscript(broken, tmp_path, caplog):
    """main: the invalid file went on to conversion and the user was told to fix a node torch wrote."""
    broken[True] = _squeeze_onnxruntime_refuses
    torch.manual_seed(0)
    net, frames = Tagger().eval(), torch.randn(2, 5, 8)
    with caplog.at_level(logging.WARNING, logger="amppass"):
        model = amppass.export_onnx(net, (frames,), tmp_path / "tagger.onnx")
    warned = [r.getMessage() for r in caplog.records if "TorchScript" in r.getMessage()]
    assert warned and "onnxruntime cannot load the exported file" in warned[0] and "Squeeze" in warned[0]
    assert "squeezed" not in {o.name for o in model.graph.output}
    session = ort.InferenceSession(str(tmp_path / "tagger.onnx"), providers=["CPUExecutionProvider"])
    longer = torch.randn(3, 9, 8)  # the TorchScript file keeps batch and frames dynamic too
    got = session.run(None, {session.get_inputs()[0].name: longer.numpy()})[0]
    with torch.no_grad():
        want = net(longer).numpy()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


def test_both_exporters_writing_invalid_files_is_one_capture_error_naming_both(broken, tmp_path):
    broken[True], broken[False] = _squeeze_onnxruntime_refuses, _unknown_op
    with pytest.raises(amppass.CaptureError) as caught:
        amppass.export_onnx(Tagger().eval(), (torch.randn(2, 5, 8),), tmp_path / "tagger.onnx")
    message = str(caught.value)
    assert "dynamo=True: RuntimeError: onnxruntime cannot load the exported file" in message
    assert "dynamo=False: RuntimeError: the exported file is not valid ONNX (onnx.checker: " in message
    assert "NoSuchOp" in message
    assert not (tmp_path / "tagger.onnx").exists()


def test_an_environment_without_onnxscript_is_told_to_install_it(tmp_path, monkeypatch):
    """main's error ended 'try amppass.convert for a torch.fx graph instead' where onnxscript was missing."""
    def missing(*args, dynamo=True, **kwargs):
        raise ModuleNotFoundError("No module named 'onnxscript'") if dynamo else RuntimeError("unsupported op")

    monkeypatch.setattr(torch.onnx, "export", missing)
    with pytest.raises(amppass.CaptureError) as caught:
        amppass.export_onnx(Tagger().eval(), (torch.randn(2, 5, 8),), tmp_path / "tagger.onnx")
    required = next(r for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                    if r.startswith("onnxscript"))  # the hint names the range amppass requires
    assert str(caught.value).endswith("the dynamo exporter needs onnxscript, a dependency of amppass that this "
                                      f"environment lacks: pip install '{required}', then export again")
    assert "amppass.convert" not in str(caught.value)
