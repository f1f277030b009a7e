"""ONNX conversion time against graph size: does ``amppass.convert_onnx`` scale linearly?

Synthetic graphs are chains of one repeated block built with ``onnx.helper`` (opset 17):

    x -> MatMul(W1) -> Add(b1) -> Relu -> MatMul(W2) -> Softmax -> LayerNormalization -> Add(x) -> ...

seven nodes per block, hidden width 16, so the graph size grows while the weights stay small. The time
of one ``convert_onnx`` call (the median of ``repeats``) is fitted to ``a + b * nodes`` and to a power
law ``nodes ** k``; ``k`` near 1 means linear.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import amppass

WIDTH = 16
NODES_PER_BLOCK = 7
OPSET = 17
IR_VERSION = 9  # onnx.helper writes the newest IR; pin one every supported onnxruntime reads
QUICK_SIZES = (100, 300, 1000)
FULL_SIZES = (100, 300, 1000, 3000, 10000, 20000)
TIME_CAP_S = 120.0  # stop growing once one conversion takes this long


def available() -> bool:
    """Whether this amppass has an ONNX front end to measure."""
    return hasattr(amppass, "convert_onnx")


def chain_model(nodes: int, seed: int = 0) -> onnx.ModelProto:
    """A valid fp32 model of about ``nodes`` nodes (a whole number of blocks, at least one)."""
    rng = np.random.default_rng(seed)
    blocks = max(1, round(nodes / NODES_PER_BLOCK))
    graph_nodes, inits = [], []

    def weight(name: str, *shape: int, scale: float = 0.25) -> str:
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    current = "x"
    for i in range(blocks):
        p = f"b{i}_"
        graph_nodes += [
            helper.make_node("MatMul", [current, weight(p + "w1", WIDTH, WIDTH)], [p + "mm1"], name=p + "mm1"),
            helper.make_node("Add", [p + "mm1", weight(p + "b1", WIDTH)], [p + "add1"], name=p + "add1"),
            helper.make_node("Relu", [p + "add1"], [p + "relu"], name=p + "relu"),
            helper.make_node("MatMul", [p + "relu", weight(p + "w2", WIDTH, WIDTH)], [p + "mm2"], name=p + "mm2"),
            helper.make_node("Softmax", [p + "mm2"], [p + "sm"], name=p + "sm", axis=-1),
            helper.make_node(
                "LayerNormalization", [p + "sm", weight(p + "g", WIDTH, scale=1.0), weight(p + "beta", WIDTH)],
                [p + "ln"], name=p + "ln", axis=-1,
            ),
            helper.make_node("Add", [p + "ln", current], [p + "out"], name=p + "res"),
        ]
        current = p + "out"
    graph = helper.make_graph(
        graph_nodes, f"chain{blocks}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info(current, TensorProto.FLOAT, ["batch", WIDTH])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    return model


def time_conversion(model: onnx.ModelProto, repeats: int) -> float:
    """Median seconds of ``amppass.convert_onnx(path, dtype="fp16")``, the model saved to a temp file first."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chain.onnx"
        onnx.save(model, path)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            amppass.convert_onnx(str(path), dtype="fp16")
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def run(quick: bool) -> list[dict]:
    """One row per graph size: nodes, conversion seconds, microseconds per node."""
    rows = []
    for target in QUICK_SIZES if quick else FULL_SIZES:
        model = chain_model(target)
        nodes = len(model.graph.node)
        seconds = time_conversion(model, repeats=1 if quick or nodes > 3000 else 3)
        rows.append({"nodes": nodes, "convert_s": seconds, "us_per_node": seconds / nodes * 1e6})
        if seconds > TIME_CAP_S:
            break
    return rows


def fit(rows: list[dict]) -> dict:
    """Least-squares ``t = a + b * n`` (with R^2) and the power-law exponent ``k`` of ``t ~ n ** k``.

    The exponent is fitted on the sizes of 1000 nodes and up where there are at least two, so fixed
    per-call costs (loading, checking) do not flatten it.
    """
    n = np.array([r["nodes"] for r in rows], dtype=float)
    t = np.array([r["convert_s"] for r in rows], dtype=float)
    b, a = np.polyfit(n, t, 1)
    predicted = a + b * n
    r2 = 1.0 - float(((t - predicted) ** 2).sum() / max(((t - t.mean()) ** 2).sum(), 1e-30))
    big = n >= 1000 if (n >= 1000).sum() >= 2 else np.ones_like(n, dtype=bool)
    k = float(np.polyfit(np.log(n[big]), np.log(t[big]), 1)[0])
    return {"intercept_s": float(a), "s_per_node": float(b), "r2": r2, "exponent": k, "linear": 0.8 <= k <= 1.25}
