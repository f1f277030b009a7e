"""ONNX models for the file-safety tests: a MatMul whose weight sits in the main graph, a Constant or an If branch,
and the bytes a file outside the model's folder holds (which must never be read)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

F32 = TensorProto.FLOAT


SECRET = b"TOP-SECRET-" * 4096  # what a file outside the model's folder holds (bigger than W): never read


def secret_weight(name: str = "W", seed: int = 0) -> np.ndarray:
    """A seeded 64x64 weight."""
    return (np.random.default_rng(seed).standard_normal((64, 64)) * 0.1).astype(np.float32)


def matmul_64(where: str = "initializer") -> onnx.ModelProto:
    """x[2,64] @ W -> y, with W an initializer, a Constant node, or an initializer of an If branch."""
    w = numpy_helper.from_array(secret_weight(), "W")
    x = helper.make_tensor_value_info("x", F32, [2, 64])
    y = helper.make_tensor_value_info("y", F32, [2, 64])
    if where == "initializer":
        graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g", [x], [y], [w])
    elif where == "constant":
        graph = helper.make_graph([helper.make_node("Constant", [], ["W"], name="c", value=w),
                                   helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g", [x], [y])
    else:
        branch = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["yb"], name="mm")], "then", [],
                                   [helper.make_tensor_value_info("yb", F32, [2, 64])], [w])
        other = helper.make_graph([helper.make_node("Identity", ["x"], ["ye"], name="id")], "else", [],
                                  [helper.make_tensor_value_info("ye", F32, [2, 64])])
        cond = helper.make_tensor_value_info("cond", TensorProto.BOOL, [])
        graph = helper.make_graph([helper.make_node("If", ["cond"], ["y"], name="if", then_branch=branch,
                                                    else_branch=other)], "g", [x, cond], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def weights_named_w(model: onnx.ModelProto):
    """Every tensor named ``W`` in ``model``, subgraphs included."""
    from amppass.onnx.io.weight_store import tensors

    return [t for t in tensors(model.graph) if t.name == "W"]
