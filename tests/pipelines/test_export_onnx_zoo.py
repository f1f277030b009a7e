"""convert_onnx and export_onnx on exports of the model zoo, with both torch exporters where they work."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
import torch

import amppass
from amppass.pipelines.export_onnx import export_fp32
from models import build
from tests.helpers.onnx_graphs import check_converted, heavy_low_share, session

# TorchScript exporter: fast, but fails on transformers' text models (forward() kwargs) in this torch.
TORCHSCRIPT = ("mlp", "cnn", "resnet", "vit")
DYNAMO_FAST = ("cnn", "bert")
DYNAMO_SLOW = ("mlp", "resnet", "gpt2", "vit", "llama")


def _torchscript(case) -> onnx.ModelProto:
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(case.model, case.example_inputs, buffer, dynamo=False)
    return onnx.load_from_string(buffer.getvalue())


def _feeds(model: onnx.ModelProto, case, seed: int) -> dict:
    names = [i.name for i in model.graph.input]
    return {n: t.numpy() for n, t in zip(names, case.make_inputs(seed), strict=False)}


def _check(model: onnx.ModelProto, case) -> None:
    converted = amppass.convert_onnx(model, "fp16")
    for seed in (0, 1):  # the error holds on inputs other than the example ones
        check_converted(model, converted, _feeds(model, case, seed))


@pytest.mark.parametrize("name", TORCHSCRIPT)
def test_torchscript_export(name):
    case = build(name)
    _check(_torchscript(case), case)


@pytest.mark.parametrize("name", DYNAMO_FAST)
def test_dynamo_export(name):
    case = build(name)
    _check(export_fp32(case.model, case.example_inputs), case)


@pytest.mark.slow
@pytest.mark.parametrize("name", DYNAMO_SLOW)
def test_dynamo_export_slow(name):
    case = build(name)
    _check(export_fp32(case.model, case.example_inputs), case)


def test_export_onnx_writes_a_converted_file(tmp_path):
    case = build("mlp")
    path = tmp_path / "mlp.fp16.onnx"
    returned = amppass.export_onnx(case.model, case.example_inputs, path, dtype="fp16")
    assert path.exists()
    on_disk = onnx.load(path)
    onnx.checker.check_model(on_disk, full_check=True)
    assert heavy_low_share(on_disk) == heavy_low_share(returned) == (2, 2)
    report = amppass.report(str(path))
    assert report.info["dtype"] == "fp16" and report.info["weight_bytes_after"] < report.info["weight_bytes_before"]


def test_export_onnx_exports_in_eval_mode_and_restores_the_flags(tmp_path):
    """A model left in train mode exports without dropout (an inference model), and stays in train mode."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 4))
    model.train()
    model[0].eval()  # a submodule's own flag must come back as it was, too
    flags = [m.training for m in model.modules()]
    x = torch.randn(3, 8)
    returned = amppass.export_onnx(model, (x,), tmp_path / "m.onnx", dtype="fp16")
    assert [m.training for m in model.modules()] == flags == [True, False, True, True]
    assert not any(n.op_type == "Dropout" and len(n.input) > 2 for n in returned.graph.node)
    got = session(returned).run(None, {returned.graph.input[0].name: x.numpy()})[0]
    with torch.no_grad():
        want = model.eval()(x).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)


def test_models_onnx_export_takes_the_zoos_bert():
    """models.onnx_export.export (the TorchScript exporter) on the zoo's BERT (transformers 5): the exporter's filled-in
    defaults used to collide with the keywords transformers sets (``use_cache``); the file runs as the model does,
    with the model's own node names, and the model is left as it was."""
    from models.onnx_export import export

    case = build("bert", "small")
    before = dict(vars(case.model))
    model = export(case.model, case.example_inputs, ["input_ids"], ["last_hidden_state"])
    assert vars(case.model) == before
    assert any(node.name.startswith("/encoder/layer.0/") for node in model.graph.node)
    ids = case.make_inputs(1)[0]
    got = session(model).run(["last_hidden_state"], {"input_ids": ids.numpy()})[0]
    with torch.no_grad():
        want = case.model(ids).last_hidden_state.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# 2-4 minutes on 2 busy cores; tests/guarantees/test_never_mutated.py holds the same in the default run
@pytest.mark.slow
def test_a_freshly_built_yolov8n_exports_and_stays_as_it_was(tmp_path):
    """main traced the caller's YOLOv8n (never called before): its Detect head cached FakeTensor anchors, and
    export_onnx raised torch's GuardOnDataDependentSymNode on the next call of the model."""
    pytest.importorskip("ultralytics")
    from tests.helpers.peer_models import build_yolov8n

    model, (image,), _ = build_yolov8n(size=64)
    head = model.model[-1]
    cached = {k: type(v) for k, v in vars(head).items() if isinstance(v, torch.Tensor)}
    converted = amppass.export_onnx(model, (image,), tmp_path / "yolo.onnx", dtype="fp16")
    assert {k: type(v) for k, v in vars(head).items() if isinstance(v, torch.Tensor)} == cached  # no anchors
    with torch.no_grad():
        want = model(image)[0]  # the model still runs: (boxes + scores, features)
    got = session(converted).run(None, {converted.graph.input[0].name: image.numpy()})[0]
    assert got.shape == tuple(want.shape)
    assert np.linalg.norm(got - want.numpy()) / np.linalg.norm(want.numpy()) < 2e-2
