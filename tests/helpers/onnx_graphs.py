"""Hand-built ONNX graphs in tests: building them, running them in onnxruntime's CPU provider, reading amppass's
node metadata, and the checks of a converted graph against its original (structure, numerics, validity)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import amppass
from amppass.onnx.simulate import simulated
from amppass.onnx.view import all_nodes
from amppass.targets import onnxruntime_facts

F32 = TensorProto.FLOAT
RNG = np.random.default_rng(0)


# -- helpers shared with test_onnx_zoo.py ------------------------------------------------------------
def session(model: onnx.ModelProto | str) -> ort.InferenceSession:
    """An onnxruntime CPU session of ``model``, its IR version lowered to what the installed onnxruntime reads."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if isinstance(model, onnx.ModelProto) and model.ir_version > onnxruntime_facts.max_ir_version():
        model = onnx.ModelProto.FromString(model.SerializeToString())  # fp32 reference: onnx writes IR 14
        model.ir_version = onnxruntime_facts.max_ir_version()
    source = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def meta(node: onnx.NodeProto) -> dict:
    """The decision amppass wrote into ``node``'s metadata (empty for a node it did not mark)."""
    raw = {p.key: p.value for p in node.metadata_props}.get("amppass")
    return json.loads(raw) if raw else {}


HEAVY = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "LSTM", "GRU", "RNN", "Attention"}


def heavy_low_share(model: onnx.ModelProto) -> tuple[int, int]:
    """(heavy nodes planned low, heavy nodes), subgraphs included."""
    heavy = [n for n in all_nodes(model.graph) if n.op_type in HEAVY and not meta(n).get("cast")]
    return sum(meta(n).get("precision") == "low" for n in heavy), len(heavy)


def check_converted(original: onnx.ModelProto, converted: onnx.ModelProto, feeds: dict, rtol: float = 1e-2,
                    min_heavy: float = 0.75, sim_rtol: float | None = 1e-2) -> None:
    """Checker, onnxruntime, finite outputs within ``rtol`` of fp32 as onnxruntime's CPU provider runs them
    and within ``sim_rtol`` as fp16 hardware computes them (the :func:`simulated` model stores every low
    value in fp16, which the CPU provider mostly does not; None skips it), and the share of heavy nodes low."""
    onnx.checker.check_model(converted, full_check=True)
    assert converted.ir_version <= onnxruntime_facts.max_ir_version()
    want = session(original).run(None, feeds)
    got = session(converted).run(None, feeds)
    for w, g in zip(want, got, strict=False):
        assert g.dtype == w.dtype, "keep_io_types: outputs keep their dtype"
    assert_close(want, got, rtol, "onnxruntime CPU")
    if sim_rtol is not None:
        assert_close(want, session(simulated(converted)).run(None, feeds), sim_rtol, "simulated fp16 storage")
    low, total = heavy_low_share(converted)
    assert total == 0 or low >= min_heavy * total, f"only {low}/{total} heavy nodes low"
    assert amppass.report(converted).rows


def assert_close(want: list[np.ndarray], got: list[np.ndarray], rtol: float, what: str) -> None:
    """Every output of ``got`` is finite and within relative error ``rtol`` of ``want`` (L2 norm)."""
    for index, (w, g) in enumerate(zip(want, got, strict=False)):
        g64, w64 = g.astype(np.float64), w.astype(np.float64)
        assert np.isfinite(g64).all(), f"{what}: output {index} is not finite"
        error = np.linalg.norm(g64 - w64) / max(np.linalg.norm(w64), 1e-12)
        assert error <= rtol, f"{what}: output {index} relative error {error:.3g} > {rtol}"


def weight(name: str, *shape: int, scale: float = 0.2) -> onnx.TensorProto:
    return numpy_helper.from_array((RNG.standard_normal(shape) * scale).astype(np.float32), name)


def model_of(nodes, inputs, outputs, initializers=(), opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])  # onnx writes IR 14 here
    onnx.checker.check_model(model, full_check=True)
    return model


def vinfo(name: str, elem=F32, shape=(2, 8)) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, list(shape))


def relu_chain(count: int) -> onnx.ModelProto:
    """x -> Relu -> Relu -> ... (``count`` nodes) -> y."""
    graph = onnx.GraphProto(name="chain")
    for i in range(count):
        graph.node.add(op_type="Relu", input=[f"v{i}"], output=[f"v{i + 1}"], name=f"r{i}")
    graph.input.append(helper.make_tensor_value_info("v0", F32, [2]))
    graph.output.append(helper.make_tensor_value_info(f"v{count}", F32, [2]))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
