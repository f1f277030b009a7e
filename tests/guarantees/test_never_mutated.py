"""The caller's model is never changed by any entry point (convert, export_onnx, convert_onnx, report, the
compile backend), even when a conversion fails midway or the model's code stores tensors on itself while traced;
a failed save loses nothing."""

from __future__ import annotations

import io
import os

import onnx
import pytest
import torch

import amppass
from amppass.cli import main
from amppass.onnx.io import stream_write
from amppass.onnx.io.save import save
from amppass.onnx.io.weight_store import WeightStore
from amppass.pipelines.backend import amppass_backend
from tests.helpers.small_models import X, matmul_model


class Net(torch.nn.Module):
    """Linear + BatchNorm (a buffer that training would update) + LayerNorm, with hooks attached."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.bn(self.fc(x))))


def _hooked() -> torch.nn.Module:
    torch.manual_seed(0)
    net = Net().train()
    net.bn.eval()  # one submodule with its own flag
    net.fc.register_forward_hook(lambda module, args, out: None)
    net.register_forward_pre_hook(lambda module, args: None)
    net.norm.weight.register_hook(lambda grad: grad)
    return net


def _snapshot(net: torch.nn.Module) -> dict:
    buffer = io.BytesIO()
    torch.save(net.state_dict(), buffer)
    return {
        "state_dict": buffer.getvalue(),
        "training": [(name, m.training) for name, m in net.named_modules()],
        "params": [(name, p.dtype, p.requires_grad, p.data_ptr()) for name, p in net.named_parameters()],
        "hooks": [(name, len(m._forward_hooks), len(m._forward_pre_hooks)) for name, m in net.named_modules()],
        "grad_hooks": [(name, len(p._backward_hooks or {})) for name, p in net.named_parameters()],
        "attributes": [(name, key, _value(value)) for name, m in net.named_modules() for key, value in vars(m).items()
                       if not key.startswith("_") and key != "training"],
    }


def _value(value) -> object:
    """An attribute as the snapshot compares it: a tensor by its type and values (a FakeTensor has none), anything
    else by its repr (a torch.Size of symbolic sizes reads otherwise than one of ints)."""
    if isinstance(value, torch.Tensor):
        return (type(value).__name__, value.tolist() if type(value) is torch.Tensor else None)
    return repr(value)


CALLS = {
    "fx-inference": lambda net, tmp: amppass.convert(net, X, "fp16", plan_for="coverage"),
    "fx-bf16-calibrated": lambda net, tmp: amppass.convert(
        net, X, "bf16", calibration=[X, (X[0] * 3,)], plan_for="coverage"
    ),
    "fx-train": lambda net, tmp: amppass.convert(net, X, "fp16", mode="train", plan_for="coverage"),
    "export-onnx": lambda net, tmp: amppass.export_onnx(net, X, tmp / "net.onnx"),
    "report": lambda net, tmp: amppass.report(amppass.convert(net, X, "fp16", plan_for="coverage")).summary(),
    # failures after capture: the override matches nothing; a calibration batch is bad halfway through
    "fx-fails-on-override": lambda net, tmp: amppass.convert(
        net, X, "fp16", keep_fp32=["nothing_here"], plan_for="coverage"
    ),
    "fx-fails-in-calibration": lambda net, tmp: amppass.convert(
        net, X, "fp16", calibration=[X, (torch.full((2, 4), float("nan")),)], plan_for="coverage"
    ),
    "export-fails-in-convert": lambda net, tmp: amppass.export_onnx(net, X, tmp / "net.onnx", keep_fp32=["Nope"]),
}


@pytest.mark.parametrize("call", CALLS, ids=list(CALLS))
def test_torch_module_unchanged(call, tmp_path):
    net = _hooked()
    before = _snapshot(net)
    try:
        CALLS[call](net, tmp_path)
    except amppass.AmpPassError:
        assert "fails" in call, "only the failing calls may raise"
        assert not (tmp_path / "net.onnx").exists()
    assert _snapshot(net) == before


class Caching(torch.nn.Module):
    """Stores a tensor computed from the input's shape on itself at the first call of each shape, as ultralytics'
    Detect head caches its anchors: traced on the caller's model, the cache would hold fake tensors and symbolic
    sizes, and the next eager call would fail."""

    def __init__(self):
        super().__init__()
        self.fc, self.shape = torch.nn.Linear(4, 4), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shape != x.shape:
            self.anchors, self.shape = torch.arange(x.shape[0], dtype=x.dtype)[:, None], x.shape
        return self.fc(x) + self.anchors


def _compiled(net, tmp):
    torch._dynamo.reset()
    try:
        return torch.compile(net, backend=amppass_backend, options={"plan_for": "coverage"})(*X)
    finally:
        torch._dynamo.reset()


ENTRY_POINTS = {
    "convert": lambda net, tmp: amppass.convert(net, X, "fp16", plan_for="coverage"),
    "convert-train": lambda net, tmp: amppass.convert(net, X, "fp16", mode="train", plan_for="coverage"),
    "export-onnx": lambda net, tmp: amppass.export_onnx(net, X, tmp / "net.onnx"),
    "report": lambda net, tmp: amppass.report(amppass.export_onnx(net, X, tmp / "net.onnx")).summary(),
    "compile-backend": _compiled,
}


@pytest.mark.parametrize("call", ENTRY_POINTS, ids=list(ENTRY_POINTS))
def test_what_the_models_code_stores_on_itself_while_traced_stays_off_the_callers_model(call, tmp_path):
    """main: export_onnx traced the caller's model, leaving FakeTensors in its cache (a freshly built YOLOv8n's
    Detect head), and the next call raised GuardOnDataDependentSymNode. The compile backend runs the model's
    code as the call it compiles: the cache is then what an eager call leaves, real tensors."""
    torch.manual_seed(0)
    net, twin = Caching().eval(), Caching().eval()
    twin.load_state_dict(net.state_dict())
    expected = _snapshot(net)
    if call == "compile-backend":
        twin(*X)
        expected["attributes"] = _snapshot(twin)["attributes"]  # what the eager call stores
    ENTRY_POINTS[call](net, tmp_path)
    assert _snapshot(net) == expected
    assert torch.equal(net(*X), twin(*X))  # and the model still runs


@pytest.mark.parametrize("kwargs", [
    {"dtype": "fp16"}, {"dtype": "bf16", "keep_io_types": False, "target": "cuda"}, {"force_low": ["mm"]},
    {"dtype": "bf16"},  # refused: the CPU provider has no bf16 MatMul
    {"keep_fp32": ["no_such_node"]},  # fails after shape inference and planning began
    {"dtype": "int8"},
])
def test_model_proto_unchanged(kwargs):
    model = matmul_model()
    before = model.SerializeToString()
    try:
        converted = amppass.convert_onnx(model, **kwargs)
    except amppass.InputError:
        assert kwargs.get("dtype") in ("int8", "bf16") or "keep_fp32" in kwargs
    else:
        stored = converted.SerializeToString()
        amppass.report(converted).summary()
        assert converted.SerializeToString() == stored
    assert model.SerializeToString() == before


def test_model_file_unchanged(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save_model(matmul_model(), path, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    before = {p: (tmp_path / p).read_bytes() for p in sorted(os.listdir(tmp_path))}
    save(amppass.convert_onnx(path), tmp_path / "out.onnx")
    assert {p: (tmp_path / p).read_bytes() for p in before} == before


def _partial_then_fail(out) -> None:
    out.write(b"\x08\x07partial")
    raise OSError(28, "No space left on device")


def _out_of_disk(monkeypatch) -> None:
    """Both ways a model's bytes reach disk (streamed inline, or into a data file) write a few of them and
    then run out of space."""
    monkeypatch.setattr(stream_write, "write", lambda parts, store, out: _partial_then_fail(out))
    monkeypatch.setattr(WeightStore, "write", lambda self, model, out, location: _partial_then_fail(out))


@pytest.mark.parametrize("external", [False, True])
def test_failed_save_leaves_no_partial_file_and_keeps_the_old_one(tmp_path, monkeypatch, external):
    converted = amppass.convert_onnx(matmul_model())
    target = tmp_path / "out.onnx"
    save(converted, target, external_data=external)
    before = {p: (tmp_path / p).read_bytes() for p in sorted(os.listdir(tmp_path))}
    assert len(before) == (2 if external else 1) and "out.onnx" in before
    _out_of_disk(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        save(amppass.convert_onnx(matmul_model(), "bf16", target="cuda"), target, external_data=external)
    assert {p: (tmp_path / p).read_bytes() for p in sorted(os.listdir(tmp_path))} == before


def test_failed_save_of_a_new_file_leaves_nothing(tmp_path, monkeypatch):
    _out_of_disk(monkeypatch)
    with pytest.raises(OSError):
        save(amppass.convert_onnx(matmul_model()), tmp_path / "new.onnx", external_data=True)
    assert os.listdir(tmp_path) == []


def test_cli_refuses_to_overwrite_its_input_through_a_link_unless_forced(tmp_path, capsys):
    onnx.save(matmul_model(), tmp_path / "m.onnx")
    os.symlink(tmp_path / "m.onnx", tmp_path / "link.onnx")
    before = (tmp_path / "m.onnx").read_bytes()
    assert main(["convert", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "link.onnx")]) == 2
    assert "--force" in capsys.readouterr().err and (tmp_path / "m.onnx").read_bytes() == before
    assert main(["convert", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.onnx"), "--force"]) == 0
    assert amppass.report(str(tmp_path / "m.onnx")).info["dtype"] == "fp16"
