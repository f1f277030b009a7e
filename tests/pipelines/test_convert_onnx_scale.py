"""Scale: a 20k-node graph, and a model over protobuf's 2 GB limit (external data), convert, check and run.

``python -m tests.pipelines.test_convert_onnx_scale`` prints the figures (20k-node conversion time; >2 GB peak RSS and
times).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import amppass
from tests.helpers.onnx_graphs import session
from tests.helpers.paths import ROOT

WIDTH, BLOCKS = 16, 5000  # 4 nodes a block: MatMul, Add, Relu, LayerNormalization
BIG_DIM, BIG_LAYERS = 8192, 9  # 9 fp32 8192x8192 weights: 2.25 GiB
RSS_LIMIT_GIB = 12


def chain_model(blocks: int = BLOCKS) -> onnx.ModelProto:
    """x[2,16] through ``blocks`` blocks of MatMul(W_i) + b_i -> Relu -> LayerNormalization (shared gamma/beta)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.ones(WIDTH, np.float32), "gamma"),
             numpy_helper.from_array(np.zeros(WIDTH, np.float32), "beta")]
    nodes, value = [], "x"
    for i in range(blocks):
        inits.append(numpy_helper.from_array((rng.standard_normal((WIDTH, WIDTH)) / 4).astype(np.float32), f"W{i}"))
        inits.append(numpy_helper.from_array((rng.standard_normal(WIDTH) * 0.1).astype(np.float32), f"b{i}"))
        nodes += [helper.make_node("MatMul", [value, f"W{i}"], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"], name=f"add{i}"),
                  helper.make_node("Relu", [f"a{i}"], [f"r{i}"], name=f"relu{i}"),
                  helper.make_node("LayerNormalization", [f"r{i}", "gamma", "beta"], [f"n{i}"], name=f"ln{i}")]
        value = f"n{i}"
    nodes.append(helper.make_node("Identity", [value], ["y"], name="out"))
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", T.FLOAT, [2, WIDTH])],
                              [helper.make_tensor_value_info("y", T.FLOAT, [2, WIDTH]),
                               helper.make_tensor_value_info("n9", T.FLOAT, [2, WIDTH])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.slow  # about 25 s with the checker and two onnxruntime sessions on the shared 2-core machine
def test_20k_node_graph_converts_checks_and_runs():
    model = chain_model()
    assert len(model.graph.node) > 20_000
    start = time.perf_counter()
    converted = amppass.convert_onnx(model)
    seconds = time.perf_counter() - start
    onnx.checker.check_model(converted)
    feed = {"x": np.random.default_rng(1).standard_normal((2, WIDTH)).astype(np.float32)}
    want, got = session(model).run(None, feed), session(converted).run(None, feed)
    assert np.isfinite(got[0]).all(), "5000 random blocks are chaotic: the end is only checked finite"
    assert np.linalg.norm(got[1] - want[1]) <= 1e-2 * np.linalg.norm(want[1]), "after 10 blocks: close"
    rows = amppass.report(converted).rows
    assert sum(r.precision == "fp16" for r in rows if r.op == "MatMul") == BLOCKS
    assert all(r.precision == "fp32" for r in rows if r.op == "LayerNormalization")
    print(f"20k-node graph ({len(model.graph.node)} nodes): converted in {seconds:.1f} s")


def big_model(folder: str) -> str:
    """A chain of BIG_LAYERS MatMuls with 8192x8192 fp32 weights in one external data file (one random
    matrix written BIG_LAYERS times, so generating it takes seconds); returns the .onnx path."""
    weight = (np.random.default_rng(0).standard_normal((BIG_DIM, BIG_DIM), dtype=np.float32)
              / np.float32(np.sqrt(BIG_DIM)))
    payload = weight.tobytes()
    inits, nodes, value = [], [], "x"
    with open(os.path.join(folder, "big.onnx.data"), "wb") as data:
        for i in range(BIG_LAYERS):
            tensor = onnx.TensorProto(name=f"W{i}", data_type=T.FLOAT, dims=[BIG_DIM, BIG_DIM],
                                      data_location=T.EXTERNAL)
            for key, entry in (("location", "big.onnx.data"), ("offset", str(data.tell())),
                               ("length", str(len(payload)))):
                tensor.external_data.add(key=key, value=entry)
            data.write(payload)
            inits.append(tensor)
            nodes.append(helper.make_node("MatMul", [value, f"W{i}"], [f"h{i}"], name=f"mm{i}"))
            value = f"h{i}"
    nodes.append(helper.make_node("Relu", [value], ["y"], name="relu"))
    graph = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("x", T.FLOAT, ["n", BIG_DIM])],
                              [helper.make_tensor_value_info("y", T.FLOAT, ["n", BIG_DIM])], inits)
    path = os.path.join(folder, "big.onnx")
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10  # onnx writes IR 14, newer than onnxruntime loads; the fp32 reference must run
    onnx.save_model(model, path)
    return path


_MEASURE = """
import json, resource, sys, time
import amppass
from amppass.onnx.io.save import save
start = time.perf_counter()
model = amppass.convert_onnx(sys.argv[1], "fp16")
converted = time.perf_counter()
after_convert = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
save(model, sys.argv[2], external_data=True)
print(json.dumps({"convert_s": converted - start, "save_s": time.perf_counter() - converted,
                  "peak_rss_convert_gib": after_convert,
                  "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2}))
"""


def measure_big(folder: str) -> dict:
    """Generate the >2 GB model in ``folder``, convert and save it in a fresh process; its figures."""
    start = time.perf_counter()
    source = big_model(folder)
    generated = time.perf_counter() - start
    target = os.path.join(folder, "big.fp16.onnx")
    root = str(ROOT)
    done = subprocess.run([sys.executable, "-c", _MEASURE, source, target], capture_output=True, text=True,
                          cwd=root, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    figures.update(generate_s=generated, model_gib=os.path.getsize(source + ".data") / 1024**3,
                   source=source, target=target)
    return figures


@pytest.mark.slow
def test_over_2gb_model_converts_saves_and_runs_within_memory(tmp_path):
    figures = measure_big(str(tmp_path))
    print(json.dumps(figures))
    assert figures["model_gib"] > 2 and figures["peak_rss_gib"] < RSS_LIMIT_GIB
    target = figures["target"]
    data, = glob.glob(target + ".*.data")  # the fresh data file only the new model names
    assert os.path.getsize(data) < 0.51 * os.path.getsize(figures["source"] + ".data")
    onnx.checker.check_model(target)  # a path: the checker reads external data itself
    x = {"x": np.random.default_rng(1).standard_normal((2, BIG_DIM)).astype(np.float32)}
    got = session(target).run(None, x)[0]
    want = session(figures["source"]).run(None, x)[0]
    assert got.dtype == np.float32 and np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)


if __name__ == "__main__":
    import tempfile

    start = time.perf_counter()
    amppass.convert_onnx(chain_model())
    print(f"20k-node chain ({4 * BLOCKS + 1} nodes): convert_onnx {time.perf_counter() - start:.1f} s")
    if "--big" in sys.argv:
        with tempfile.TemporaryDirectory(dir=os.environ.get("AMPPASS_SCALE_DIR")) as folder:
            print(json.dumps(measure_big(folder), indent=1))
