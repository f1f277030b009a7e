"""Recurrent ops (LSTM, GRU, RNN) for onnxruntime's CPU provider, which has no fp16 or bf16 kernel for them.

A model whose fp16 LSTM or GRU onnxruntime 1.31 had to cast around segfaulted while it created its session,
so each converted file is loaded in a subprocess here: a regression fails the test instead of killing pytest.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

import amppass
from tests.helpers.onnx_graphs import model_of, vinfo, weight

_RUN = """
import sys, numpy as np, onnxruntime as ort
feeds = dict(np.load(sys.argv[2]))
session = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])  # default: ORT_ENABLE_ALL
np.save(sys.argv[3], session.run(None, feeds)[0])
"""
_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _run_apart(path, feeds: dict, tmp_path) -> np.ndarray:
    """The first output of the model at ``path`` on ``feeds``, loaded and run by onnxruntime in a subprocess."""
    np.savez(tmp_path / "feeds.npz", **feeds)
    done = subprocess.run([sys.executable, "-c", _RUN, str(path), str(tmp_path / "feeds.npz"),
                           str(tmp_path / "out.npy")], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"onnxruntime failed on {path} (rc={done.returncode}): {done.stderr[-2000:]}"
    return np.load(tmp_path / "out.npy")


def _close(got: np.ndarray, want: np.ndarray) -> None:
    error = np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want)
    assert error < 2e-2, f"relative error {error:.2e} against fp32"


class Tagger(torch.nn.Module):
    """A recurrent layer and a linear head over each frame."""

    def __init__(self, kind: str):
        super().__init__()
        self.rnn, self.head = getattr(torch.nn, kind)(8, 16, batch_first=True), torch.nn.Linear(16, 3)

    def forward(self, frames):
        return self.head(self.rnn(frames)[0])


def _recurrent_rows(model: onnx.ModelProto, op: str) -> list:
    names = {n.name for n in model.graph.node if n.op_type == op}
    return [r for r in amppass.report(model).rows if r.name in names]


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_export_onnx_fp16_of_a_recurrent_model_loads_and_runs_on_cpu(kind, tmp_path):
    torch.manual_seed(0)
    model, frames = Tagger(kind).eval(), torch.randn(2, 5, 8)
    with torch.no_grad():
        want = model(frames).double().numpy()
    path = tmp_path / "tagger.onnx"
    converted = amppass.export_onnx(model, (frames,), str(path), dtype="fp16")
    _close(_run_apart(path, {converted.graph.input[0].name: frames.numpy()}, tmp_path), want)
    rows = _recurrent_rows(converted, kind)
    if kind != "RNN":  # torch's exporter writes nn.RNN as MatMul and Tanh nodes, nn.LSTM and nn.GRU as one node
        assert [r.precision for r in rows] == ["fp32"]
        assert f"no fp16 kernel for {kind}" in rows[0].reason and "onnxruntime" in rows[0].reason


def _recurrent_graph(op: str, opset: int = 20) -> onnx.ModelProto:
    """x (5, 2, 8) -> MatMul -> op (hidden 16, initial_h given) -> Squeeze -> MatMul -> y (5, 2, 3)."""
    gates, rng = _GATES[op], np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "w_in"], ["h_in"], name="proj_in"),
        helper.make_node(op, ["h_in", "W", "R", "B", "", "h0"], ["seq"], name="cell", hidden_size=16),
        helper.make_node("Squeeze", ["seq", "axis1"], ["seq3"], name="squeeze"),
        helper.make_node("MatMul", ["seq3", "w_out"], ["y"], name="proj_out"),
    ]
    inits = [weight("w_in", 8, 8), weight("W", 1, gates * 16, 8), weight("R", 1, gates * 16, 16),
             weight("B", 1, 2 * gates * 16), weight("w_out", 16, 3),
             onnx.numpy_helper.from_array(rng.standard_normal((1, 2, 16)).astype(np.float32) * 0.1, "h0"),
             onnx.numpy_helper.from_array(np.array([1], np.int64), "axis1")]
    model = model_of(nodes, [vinfo("x", shape=(5, 2, 8))], [vinfo("y", shape=(5, 2, 3))], inits, opset=opset)
    model.ir_version = 10  # one the installed onnxruntime loads
    return model


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_convert_onnx_fp16_keeps_recurrent_node_fp32_on_cpu_and_names_the_kernel(op, tmp_path):
    model = _recurrent_graph(op)
    feeds = {"x": np.random.default_rng(1).standard_normal((5, 2, 8)).astype(np.float32)}
    onnx.save(model, tmp_path / "fp32.onnx")
    want = _run_apart(tmp_path / "fp32.onnx", feeds, tmp_path).astype(np.float64)
    converted = amppass.convert_onnx(str(tmp_path / "fp32.onnx"), "fp16")
    onnx.save(converted, tmp_path / "fp16.onnx")
    _close(_run_apart(tmp_path / "fp16.onnx", feeds, tmp_path), want)
    [row] = _recurrent_rows(converted, op)
    assert row.precision == "fp32"
    assert row.reason == (f"onnxruntime CPUExecutionProvider has no fp16 kernel for {op} (opset 20) and does not "
                          "cast around it; kept fp32")
    assert {r.precision for r in amppass.report(converted).rows if r.name.startswith("proj")} == {"fp16"}


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_recurrent_node_stays_low_for_cuda_which_has_the_kernel(op):
    converted = amppass.convert_onnx(_recurrent_graph(op), "fp16", target="cuda")
    [row] = _recurrent_rows(converted, op)
    assert row.precision == "fp16"


def test_bf16_on_cpu_is_refused_naming_the_recurrent_op():
    with pytest.raises(amppass.InputError, match=r"no bf16 kernel for LSTM.*dtype='fp16'"):
        amppass.convert_onnx(_recurrent_graph("LSTM", opset=22), "bf16")


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_convert_onnx_fp16_of_the_torchscript_exporters_file_loads_and_runs_on_cpu(kind, tmp_path):
    torch.manual_seed(0)
    model, frames = Tagger(kind).eval(), torch.randn(2, 5, 8)
    with torch.no_grad():
        want = model(frames).double().numpy()
    torch.onnx.export(model, (frames,), str(tmp_path / "fp32.onnx"), dynamo=False, input_names=["frames"])
    converted = amppass.convert_onnx(str(tmp_path / "fp32.onnx"), "fp16")
    onnx.save(converted, tmp_path / "fp16.onnx")
    _close(_run_apart(tmp_path / "fp16.onnx", {"frames": frames.numpy()}, tmp_path), want)
    assert [r.precision for r in _recurrent_rows(converted, kind)] == ["fp32"]


def test_force_low_does_not_put_a_recurrent_node_in_fp16_on_cpu():
    converted = amppass.convert_onnx(_recurrent_graph("LSTM"), "fp16", force_low=["LSTM"])
    [row] = _recurrent_rows(converted, "LSTM")
    assert row.precision == "fp32"
    assert row.reason.startswith("user asked for fp16 (force_low='LSTM'), but onnxruntime CPUExecutionProvider has "
                                 "no fp16 kernel for LSTM (opset 20)")
