"""ONNX calibration through onnxruntime: range rules from observed values, feed validation, the tolerance
search on a convolutional net whose fp16 error sits in its first layers, and the metadata it leaves.

Errors are measured twice: the converted model as onnxruntime's CPU provider runs it, and its fp32
simulation (:mod:`amppass.onnx.simulate`), which stores every low-precision value in fp16 as a GPU does;
the CPU provider computes most of them in fp32 and would hide fp16's error.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import amppass
from amppass import CalibrationError, InputError
from amppass.analysis.tolerance import rank_runs
from amppass.onnx.io.save import save
from amppass.onnx.simulate import simulated
from models.sensor import EARLY, sensor_feed, sensor_net
from tests.helpers.onnx_graphs import meta, model_of, session, vinfo

F32 = TensorProto.FLOAT


def _error(got: np.ndarray, want: np.ndarray) -> float:
    got, want = got.astype(np.float64), want.astype(np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _output_error(original: onnx.ModelProto, converted: onnx.ModelProto, feeds: list[dict]) -> float:
    """Relative error of ``converted`` run by onnxruntime (CPU) against ``original``."""
    fp32, low = session(original), session(converted)
    return max(_error(low.run(None, f)[0], fp32.run(None, f)[0]) for f in feeds)


def _stored_low_error(original: onnx.ModelProto, converted: onnx.ModelProto, feeds: list[dict]) -> float:
    """Relative error of ``converted`` with its low-precision values stored in fp16 (as on a GPU)."""
    return _output_error(original, simulated(converted), feeds)


# -- range rules: an intermediate beyond 65504 before a LayerNormalization --------------------------------
def _overflowing_model() -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array((rng.standard_normal((64, 64)) * 10).astype(np.float32), "w1"),
             numpy_helper.from_array((rng.standard_normal((64, 16)) * 0.2).astype(np.float32), "w2"),
             numpy_helper.from_array(np.ones(64, np.float32), "gamma"),
             numpy_helper.from_array(np.zeros(64, np.float32), "beta")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["big"], name="wide"),
             helper.make_node("LayerNormalization", ["big", "gamma", "beta"], ["normed"], name="norm", axis=-1),
             helper.make_node("MatMul", ["normed", "w2"], ["y"], name="head")]
    return model_of(nodes, [vinfo("x", shape=(4, 64))], [vinfo("y", shape=(4, 16))], inits)


def _big_feed(seed: int) -> dict:
    # |x| ~ 1e3 fits fp16, but x @ w1 reaches ~8e4, beyond fp16's 65504
    return {"x": (np.random.default_rng(seed).standard_normal((4, 64)) * 1000).astype(np.float32)}


def test_overflow_before_layernorm_is_kept_fp32_by_calibration():
    model = _overflowing_model()
    held_out = [_big_feed(100)]
    plain = amppass.convert_onnx(model, "fp16")
    assert _stored_low_error(model, plain, held_out) > 1.0  # inf/NaN or garbage without calibration

    converted = amppass.convert_onnx(model, "fp16", calibration=[_big_feed(s) for s in range(3)])
    onnx.checker.check_model(converted, full_check=True)
    assert _output_error(model, converted, held_out) <= 1e-2
    assert _stored_low_error(model, converted, held_out) <= 1e-2
    rows = {row.name: row for row in amppass.report(converted).rows}
    assert rows["wide"].precision == "fp32" and rows["wide"].source == "calibration"
    assert rows["wide"].evidence["rule"] == "overflow" and rows["wide"].evidence["absmax"] > 65504
    assert "65504" in rows["wide"].reason and rows["head"].precision == "fp16"
    info = amppass.report(converted).info
    assert info["calibrated"] is True and info["calibration_batches"] == 3 and info["calibration_decisions"] >= 1


# -- feed validation -------------------------------------------------------------------------------------
GOOD = {"x": np.zeros((4, 64), np.float32)}


@pytest.mark.parametrize("bad, words", [
    ({}, ["batch 1", "'x'", "no array"]),
    ({**GOOD, "z": GOOD["x"]}, ["batch 1", "'z'", "not inputs"]),
    ({"x": np.zeros((4, 64))}, ["batch 1", "'x'", "float64", "astype(np.float32)"]),
    ({"x": np.zeros((4, 64, 1), np.float32)}, ["batch 1", "'x'", "shape (4, 64, 1)", "[4, 64]"]),
    ({"x": np.zeros((4, 32), np.float32)}, ["batch 1", "'x'", "shape (4, 32)"]),
    ({"x": np.full((4, 64), np.nan, np.float32)}, ["batch 1", "'x'", "NaN", "nan_to_num"]),
    ({"x": np.full((4, 64), np.inf, np.float32)}, ["batch 1", "'x'", "inf"]),
    ([GOOD["x"]], ["batch 1", "dict"]),
])
def test_bad_feeds_name_the_batch_and_input(bad, words):
    with pytest.raises(CalibrationError) as caught:
        amppass.convert_onnx(_overflowing_model(), calibration=[GOOD, bad])
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))


@pytest.mark.parametrize("calibration, words", [([], ["empty"]), (GOOD, ["wrap it in a list"]),
                                                 (iter(()), ["empty"])])
def test_empty_or_single_feed_calibration_is_refused(calibration, words):
    with pytest.raises(CalibrationError, match="|".join(words)):
        amppass.convert_onnx(_overflowing_model(), calibration=calibration)


def test_tolerance_needs_calibration_and_a_positive_number():
    with pytest.raises(InputError, match="needs calibration"):
        amppass.convert_onnx(_overflowing_model(), tolerance=1e-2)
    with pytest.raises(InputError, match="positive number"):
        amppass.convert_onnx(_overflowing_model(), calibration=[GOOD], tolerance=-1.0)


# -- the judged case: a conv net whose fp16 error comes from its first (high-pass) layers -----------------
def _convs(model: onnx.ModelProto) -> dict[str, str]:
    return {n.name: meta(n)["precision"] for n in model.graph.node if n.op_type == "Conv" and meta(n)}


def test_tolerance_search_moves_only_the_early_high_pass_convs():
    model = sensor_net()
    calibration = [sensor_feed(seed) for seed in range(3)]
    held_out = [sensor_feed(seed) for seed in (100, 101)]

    plain = amppass.convert_onnx(model, "fp16", calibration=calibration)
    assert _stored_low_error(model, plain, held_out) > 1e-2, "fp16 alone must miss the tolerance here"
    assert all(p == "low" for p in _convs(plain).values()), "no range rule fires: the offset fits fp16"

    converted = amppass.convert_onnx(model, "fp16", calibration=calibration, tolerance=1e-2)
    onnx.checker.check_model(converted, full_check=True)
    info = amppass.report(converted).info
    assert info["tolerance_met"] is True and info["achieved_error"] <= 1e-2 < info["initial_error"]
    convs = _convs(converted)
    moved = {name for name, p in convs.items() if p == "fp32"}
    assert moved and moved <= set(EARLY), moved
    assert sum(p == "low" for p in convs.values()) >= 0.8 * len(convs)
    candidates = sum(row.precision == "fp16" for row in amppass.report(plain).rows)
    assert info["moved_by_tolerance"] <= 3
    assert info["tolerance_runs"] <= rank_runs(candidates) + 2 * np.log2(len(convs) * 2) + 2
    assert _stored_low_error(model, converted, held_out) <= 1e-2
    assert _output_error(model, converted, held_out) <= 1e-2
    rows = {row.name: row for row in amppass.report(converted).rows}
    assert rows["grad_x"].source == "tolerance" and "fp16 error x gain" in rows["grad_x"].reason
    assert rows["grad_x"].evidence["rank"] in (1, 2)


def test_calibration_and_tolerance_survive_a_file_round_trip(tmp_path):
    model = sensor_net(depth=3)
    converted = amppass.convert_onnx(model, "fp16", calibration=[sensor_feed(0)], tolerance=5e-2)
    path = tmp_path / "out.onnx"
    save(converted, path)
    report = amppass.report(str(path))
    for key in ("calibrated", "calibration_batches", "calibration_seconds", "calibration_decisions", "tolerance",
                "achieved_error", "initial_error", "tolerance_met", "moved_by_tolerance", "tolerance_runs"):
        assert key in report.info, key
    assert report.info["calibration_batches"] == 1 and report.info["tolerance"] == 5e-2
    summary = report.summary()
    assert "tolerance of 0.05" in summary and "uncalibrated" not in summary
    assert json.loads(report.to_json())["summary"]["calibrated"] is True
    assert any("absmax" in row.evidence for row in report.rows), "observed ranges recorded per node"


# -- where the fp32 model comes from -------------------------------------------------------------------
def test_model_with_external_data_calibrates_from_its_path(tmp_path):
    model = _overflowing_model()
    path = tmp_path / "model.onnx"
    copy = onnx.ModelProto.FromString(model.SerializeToString())  # saving moves its bytes out
    onnx.save_model(copy, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=0)
    converted = amppass.convert_onnx(str(path), "fp16", calibration=[_big_feed(0)])
    assert _output_error(model, converted, [_big_feed(5)]) <= 1e-2
    assert {r.name: r.source for r in amppass.report(converted).rows}["wide"] == "calibration"


def test_values_inside_if_bodies_are_counted_as_unobserved(caplog):
    branch = lambda name, op: helper.make_graph(  # noqa: E731
        [helper.make_node(op, ["h"], [f"{name}_out"], name=f"{name}_op")], name, [],
        [helper.make_tensor_value_info(f"{name}_out", F32, [4, 64])])
    nodes = [helper.make_node("Relu", ["x"], ["h"], name="pre"),
             helper.make_node("ReduceSum", ["x"], ["s"], name="sum", keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["cond"], name="gt"),
             helper.make_node("If", ["cond"], ["y"], name="choose", then_branch=branch("then", "Sigmoid"),
                              else_branch=branch("else", "Tanh"))]
    model = model_of(nodes, [vinfo("x", shape=(4, 64))], [vinfo("y", shape=(4, 64))],
                     [numpy_helper.from_array(np.array(0, np.float32), "zero")])
    with caplog.at_level(logging.INFO, logger="amppass.onnx.calibrate"):
        converted = amppass.convert_onnx(model, "fp16", calibration=[GOOD])
    info = amppass.report(converted).info
    assert info["calibrated"] is True and info["calibration_unobserved"] == 2
    assert "not observed" in caplog.text
    feed = {"x": np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)}
    assert _output_error(model, converted, [feed]) <= 1e-2


# -- the simulation the tolerance search measures ----------------------------------------------------------
def test_simulation_stores_every_low_value_in_fp16_like_numpy_does():
    rng = np.random.default_rng(11)
    w1, w2 = (rng.standard_normal((64, 32)) * 0.3).astype(np.float32), rng.standard_normal((32, 8)).astype(np.float32)
    model = model_of([helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
                      helper.make_node("Relu", ["h"], ["r"], name="act"),
                      helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2")],
                     [vinfo("x", shape=(4, 64))], [vinfo("y", shape=(4, 8))],
                     [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    converted = amppass.convert_onnx(model, "fp16")
    x = {"x": (rng.standard_normal((4, 64)) * 50).astype(np.float32)}

    def half(a):  # store in fp16: the rounding the simulation must reproduce
        return a.astype(np.float16).astype(np.float32)

    expected = half(np.maximum(half(half(x["x"]) @ half(w1)), 0) @ half(w2))
    before = converted.SerializeToString()
    sim = simulated(converted)
    assert converted.SerializeToString() == before, "the converted model is only read"
    onnx.checker.check_model(sim, full_check=True)
    (got,) = session(sim).run(None, x)
    # fp32 sums in another order may round a few values to the neighbouring fp16 number, no further
    assert np.allclose(got, expected, rtol=2 ** -10, atol=0)
    exact = (x["x"] @ w1).clip(0) @ w2
    assert _error(got, exact) > 1e-4, "values really are rounded"
