"""The benchmarks on a machine that lacks something: ``--help`` runs without matplotlib, and a baseline that cannot
run here (a package not installed, autocast's kernel failing on this CPU) is said in its table row while the
section goes on."""

from __future__ import annotations

import subprocess
import sys

import onnx
import torch
from onnx import TensorProto, helper

from benchmarks import never_slower, onnx_compare
from tests.helpers.paths import ROOT

_NO_MATPLOTLIB = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "matplotlib":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Refuse())
from benchmarks.__main__ import main
main(["--help"])
"""


def test_help_runs_without_matplotlib():
    done = subprocess.run([sys.executable, "-c", _NO_MATPLOTLIB], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "python -m benchmarks" in done.stdout and "run" in done.stdout


def _relu_model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_a_converter_not_installed_is_said_in_its_row(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxconverter_common", None)  # import raises ModuleNotFoundError
    feeds = {"x": torch.randn(2, 4).numpy()}
    row = onnx_compare._one("relu", "tiny", _relu_model(), feeds, "onnxconverter-common",
                            onnx_compare.onnxconverter_common_fp16)
    assert row["error"] == 'not run: onnxconverter_common is not installed (pip install -e ".[bench]")'
    assert row["convert_s"] is None and not row["runs"]


class _AutocastKernelFails(torch.nn.Module):
    """A model whose low-precision kernel fails under autocast, as an RNN primitive may on a CPU without bf16."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        if torch.is_autocast_enabled("cpu"):
            raise RuntimeError("could not create a primitive descriptor for an LSTM forward propagation primitive")
        return self.linear(x)


def test_a_baseline_failing_on_this_cpu_is_said_in_its_row_and_the_row_is_measured():
    def make():
        torch.manual_seed(0)
        return _AutocastKernelFails().eval(), (torch.randn(4, 8),), {}

    row = never_slower.measure("failing-autocast", 4, make, warmup=0, repeats=1)
    assert row["note"].startswith("autocast not run on this CPU: RuntimeError: could not create a primitive")
    assert row["autocast_ms"] is None and row["err_autocast"] is None
    assert row["fp32_ms"] > 0 and row["amppass_ms"] > 0 and row["err_amppass"] < 1e-2
