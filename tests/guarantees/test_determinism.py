"""The same input gives byte-identical ONNX output and the same report JSON (timing fields aside), within one
process and across processes with different PYTHONHASHSEED."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import amppass
from tests.helpers.paths import ROOT

F32 = TensorProto.FLOAT


def busy_model() -> "onnx.ModelProto":  # noqa: F821 - a hand-built graph with the traps that invite set order
    """Unnamed nodes, a shared weight read in fp32 and low work, an If with captures, Softmax, LayerNorm."""
    rng = np.random.default_rng(7)

    def w(name: str, *shape: int):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)

    then_g = helper.make_graph([helper.make_node("MatMul", ["h", "W"], ["t"]), helper.make_node("Relu", ["t"], ["to"])],
                               "then", [], [helper.make_tensor_value_info("to", F32, [8, 8])])
    else_g = helper.make_graph([helper.make_node("Add", ["h", "x"], ["eo"])], "else", [],
                               [helper.make_tensor_value_info("eo", F32, [8, 8])])
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Add", ["h", "W"], ["shared"]),  # W read again by an fp32-following op
        helper.make_node("If", ["cond"], ["b"], then_branch=then_g, else_branch=else_g),
        helper.make_node("LayerNormalization", ["b", "gamma", "beta"], ["n"], axis=-1),
        helper.make_node("MatMul", ["n", "W2"], ["m"]),
        helper.make_node("Softmax", ["m"], ["s"], axis=-1),
        helper.make_node("Mul", ["s", "shared"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "busy", [helper.make_tensor_value_info("x", F32, [8, 8]),
                                              helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", F32, [8, 8]),
                               helper.make_tensor_value_info("m", F32, [8, 8])],
                              [w("W", 8, 8), w("W2", 8, 8), w("gamma", 8), w("beta", 8)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _without_timing(value):
    if isinstance(value, dict):
        return {k: _without_timing(v) for k, v in value.items() if "seconds" not in k and "time" not in k}
    if isinstance(value, list):
        return [_without_timing(v) for v in value]
    return value


def fingerprints(fx: bool = False) -> dict[str, str]:
    """sha256 of the converted ONNX bytes and of the report JSONs (timing fields dropped)."""
    out = {}
    for dtype in ("fp16", "bf16"):
        converted = amppass.convert_onnx(busy_model(), dtype, target="cuda" if dtype == "bf16" else "cpu")
        out[f"onnx-{dtype}"] = hashlib.sha256(converted.SerializeToString()).hexdigest()
        report = _without_timing(json.loads(amppass.report(converted).to_json()))
        out[f"onnx-report-{dtype}"] = hashlib.sha256(json.dumps(report).encode()).hexdigest()
    if fx:
        from models import build

        case = build("mlp", "small")
        batches = [case.make_inputs(seed) for seed in range(2)]
        gm = amppass.convert(
            case.model, case.example_inputs, "fp16", calibration=batches, tolerance=1e-3, plan_for="coverage"
        )
        report = _without_timing(json.loads(amppass.report(gm).to_json()))
        out["fx-report"] = hashlib.sha256(json.dumps(report).encode()).hexdigest()
        out["fx-code"] = hashlib.sha256(gm.code.encode()).hexdigest()
    return out


def _in_subprocess(seed: str, fx: bool) -> dict[str, str]:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    code = ("import json; from tests.guarantees.test_determinism import fingerprints; "
            f"print(json.dumps(fingerprints({fx})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_same_bytes_twice_in_one_process():
    first = amppass.convert_onnx(busy_model(), "fp16").SerializeToString()
    assert amppass.convert_onnx(busy_model(), "fp16").SerializeToString() == first
    assert fingerprints() == fingerprints()


def test_same_bytes_across_hash_seeds():
    assert _in_subprocess("1", False) == _in_subprocess("2", False) == fingerprints()


@pytest.mark.slow
def test_fx_report_and_code_across_hash_seeds():
    torch.manual_seed(0)
    assert _in_subprocess("3", True) == _in_subprocess("4", True)
