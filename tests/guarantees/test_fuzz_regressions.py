"""Failures the fuzz tests (test_fuzz_onnx.py, test_fuzz_fx.py) found, each shrunk to a minimal program
and kept as a named regression test through the same property checks."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest

import amppass
from tests.helpers.fuzz_checks import check_fx, check_onnx
from tests.helpers.fuzz_graphs import Program, Step, Weight, to_onnx
from tests.helpers.onnx_graphs import meta


def _matmul_program() -> Program:
    w0 = Weight(np.array([[0.09, -0.09], [0.45, 0.07]], np.float32), constant=False)
    return Program(inputs=[(1, 2)], weights={"w0": w0}, steps=[Step("matmul", [0, "w0"])],
                   shapes=[(1, 2), (1, 2)], outputs=[1], named_nodes=False)


def test_bf16_force_low_matmul_without_cpu_kernel_is_refused():
    """force_low overrode the runtime check: a bf16 MatMul onnxruntime CPU cannot load ("NOT_IMPLEMENTED"). Then it
    stayed fp32 with that reason; now bf16 for the CPU provider with a float32 MatMul is refused, forced
    or not, and the per-op kernel check is the tests' below."""
    assert check_onnx(_matmul_program(), "bf16", force_low=["MatMul"]) is None
    assert check_onnx(_matmul_program(), "bf16") is None
    assert check_onnx(_matmul_program(), "fp16", force_low=["MatMul"]) is not None


@pytest.mark.parametrize("op, attrs, shape", [("softmax", {"axis": 0}, (1, 2)), ("log_softmax", {"axis": -1}, (1, 2)),
                                              ("reduce_sum", {"axes": [1], "keepdims": 1}, (1, 1))])
def test_bf16_force_low_fp32_policy_op_without_cpu_kernel_stays_fp32(op, attrs, shape):
    """Only LOW/FOLLOW ops were checked for a kernel: a forced bf16 Softmax made onnxruntime expand its
    function body and fail on ReduceMax, which has no bf16 kernel either."""
    program = Program(inputs=[(1, 2)], weights={}, steps=[Step(op, [0], attrs)], shapes=[(1, 2), shape],
                      outputs=[1], named_nodes=False)
    onnx_op = {"softmax": "Softmax", "log_softmax": "LogSoftmax", "reduce_sum": "ReduceSum"}[op]
    converted = check_onnx(program, "bf16", force_low=[onnx_op])
    (node,) = [n for n in converted.graph.node if n.op_type == onnx_op]
    assert meta(node)["precision"] == "fp32" and meta(node)["evidence"]["no_low_kernel"]


def test_fp16_force_low_softmax_still_honoured():
    """The kernel check above must not block ops onnxruntime does run in fp16."""
    program = Program(inputs=[(2, 4)], weights={}, steps=[Step("softmax", [0], {"axis": -1})],
                      shapes=[(2, 4), (2, 4)], outputs=[1])
    converted = check_onnx(program, "fp16", force_low=["Softmax"])
    (node,) = [n for n in converted.graph.node if n.op_type == "Softmax"]
    assert meta(node)["precision"] == "low"


def _split_program() -> Program:
    w0 = Weight(np.array([[0.07, -0.08], [0.37, 0.06], [-0.31, 0.21]], np.float32), constant=False)
    return Program(inputs=[(1, 4)], weights={"w0": w0},
                   steps=[Step("add", [0, 0]), Step("split", [1], {"axis": 1, "sizes": [1, 3]}, 2),
                          Step("matmul", [3, "w0"])],
                   shapes=[(1, 4), (1, 4), (1, 1), (1, 3), (1, 2)], outputs=[4, 2])


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("options", [
    {"force_low": ["aten.add"], "keep_fp32": ["getitem"], "keep_io_types": False},
    {"keep_fp32": ["aten.split_with_sizes"], "force_low": ["getitem"]},
], ids=["split-low-getitem-fp32", "split-fp32-getitem-low"])
def test_fx_getitem_in_another_precision_than_its_split(dtype, options):
    """The rewrite cast the split's list output itself (aten._to_copy on a list: RuntimeError at run time)."""
    fast = check_fx(_split_program(), dtype, **options)
    for node in fast.graph.nodes:
        if node.meta.get("amppass", {}).get("cast"):
            assert not isinstance(node.args[0].meta.get("val"), (list, tuple)), f"{node.name} casts a list"


def _transpose_program() -> Program:
    w1 = Weight(np.full((2, 8), 0.3, np.float32), constant=False)
    return Program(inputs=[(1, 3, 2)], weights={"w1": w1},
                   steps=[Step("add", [0, 0]), Step("transpose", [1], {"perm": [1, 0, 2]}), Step("matmul", [2, "w1"])],
                   shapes=[(1, 3, 2), (1, 3, 2), (3, 1, 2), (3, 1, 8)], outputs=[3])


def _loads_in_a_child(model: onnx.ModelProto, tmp_path) -> int:
    """Exit code of a child process that loads ``model`` in onnxruntime (a segfault kills only the child)."""
    path = tmp_path / "converted.onnx"
    onnx.save(model, path)
    load = "import onnxruntime as ort, sys; ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])"
    return subprocess.run([sys.executable, "-c", load, str(path)], capture_output=True, timeout=120).returncode


def test_transpose_read_only_by_an_fp32_matmul_runs_fp32_and_onnxruntime_loads_it(tmp_path):
    """Found by the slow fuzz profile: a low Transpose swapping the two leading axes, read by an fp32 MatMul
    through a Cast, crashes onnxruntime 1.31's MatmulTransposeFusion. Painting rule 8 runs such a Transpose
    fp32 (its cast moves before it, exactly), so plain conversion never writes the pattern."""
    converted = amppass.convert_onnx(to_onnx(_transpose_program()), "fp16", force_low=["Add"],
                                     keep_fp32=["MatMul"])
    (transpose,) = [n for n in converted.graph.node if n.op_type == "Transpose"]
    assert meta(transpose)["precision"] == "fp32" and "every reader runs fp32" in meta(transpose)["reason"]
    assert _loads_in_a_child(converted, tmp_path) == 0


@pytest.mark.xfail(strict=True, reason="onnxruntime 1.31 MatmulTransposeFusion segfaults on "
                   "Transpose(perm=[1, 0, 2]) -> Cast(to=float) -> MatMul; a user who forces the Transpose low "
                   "still gets that pattern")
def test_onnxruntime_loads_a_forced_low_batch_transpose_read_by_fp32_matmul(tmp_path):
    """The same graph with the Transpose forced low by the user: amppass does what it is told."""
    converted = amppass.convert_onnx(to_onnx(_transpose_program()), "fp16", force_low=["Add", "Transpose"],
                                     keep_fp32=["MatMul"])
    assert _loads_in_a_child(converted, tmp_path) == 0, "onnxruntime died loading the converted model"
