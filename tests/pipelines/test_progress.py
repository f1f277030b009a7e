"""progress=True: the bar counts calibration batches, then shows every run of the tolerance search."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import amppass
from models import build


@pytest.fixture()
def terminal(monkeypatch):
    """Make rich treat the captured stderr as an interactive terminal, 120 columns wide."""
    for name, value in (("TTY_COMPATIBLE", "1"), ("TTY_INTERACTIVE", "1"), ("COLUMNS", "120")):
        monkeypatch.setenv(name, value)


def _onnx_mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), f"w{i}") for i in range(3)]
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["a"]), helper.make_node("Tanh", ["a"], ["b"]),
             helper.make_node("MatMul", ["b", "w1"], ["c"]), helper.make_node("Tanh", ["c"], ["d"]),
             helper.make_node("MatMul", ["d", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def _fx(progress: bool):
    case = build("mlp", "small")
    batches = [case.make_inputs(i) for i in range(2)]
    return amppass.convert(case.model, case.example_inputs, dtype="fp16", calibration=batches, tolerance=1e-5,
                           progress=progress, plan_for="coverage")


def _onnx(progress: bool):
    feeds = [{"x": np.random.default_rng(i).standard_normal((4, 16)).astype(np.float32)} for i in range(2)]
    return amppass.convert_onnx(_onnx_mlp(), "fp16", calibration=feeds, tolerance=1e-5, progress=progress)


@pytest.mark.parametrize("convert", [_fx, _onnx], ids=["fx", "onnx"])
def test_the_bar_shows_each_tolerance_run_and_changes_no_decision(terminal, capsys, convert):
    shown = amppass.report(convert(progress=True))
    err = capsys.readouterr().err
    quiet = amppass.report(convert(progress=False))
    assert capsys.readouterr().err == ""
    assert [(r.name, r.precision, r.source) for r in shown.rows] == [
        (r.name, r.precision, r.source) for r in quiet.rows
    ]
    assert shown.info["tolerance_runs"] == quiet.info["tolerance_runs"] >= 2
    assert "calibrating" in err and "2/2" in err
    runs = re.findall(r"tolerance search: run (\d+), (\d+) nodes fp32, error \S+ (<=|>) 1e-05", err)
    assert {int(run) for run, _, _ in runs} == set(range(1, shown.info["tolerance_runs"] + 1))
    assert runs[0][1] == "0"  # the first run measures the plan as painted, nothing moved yet
