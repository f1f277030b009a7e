"""fp8 products in ONNX plans (amppass.onnx.fp8) on hand-built graphs: the Q/DQ pairs and their types, the scales of
all-zero ranges, which products stay fp16 and why, and the bias moved out of an fp8 Gemm."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import amppass
from amppass.analysis import tolerance as tolerance_search
from amppass.analysis.tolerance import BOUND_RULE, batch_bound
from amppass.dtypes import E4M3, FP16
from amppass.onnx import calibrate as onnx_calibrate
from amppass.onnx.fp8 import stored_scale
from tests.helpers.onnx_graphs import meta, model_of, session, vinfo

RNG = np.random.default_rng(0)


def _weight(name: str, values: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(values.astype(np.float32), name)


def _feeds(count: int = 4, **extra) -> list[dict[str, np.ndarray]]:
    feeds = []
    for _ in range(count):
        feed = {"x": RNG.standard_normal((8, 64)).astype(np.float32)}
        feed.update({name: make() for name, make in extra.items()})
        feeds.append(feed)
    return feeds


def _error(model: onnx.ModelProto, converted: onnx.ModelProto, feed: dict[str, np.ndarray]) -> float:
    want = session(model).run(None, feed)[0].astype(np.float64)
    got = session(converted).run(None, feed)[0].astype(np.float64)
    assert np.isfinite(got).all()
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _by_name(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {n.name: n for n in model.graph.node}


def _two_matmuls(first: np.ndarray | None = None) -> onnx.ModelProto:
    """x [8, 64] -> MatMul(W1) -> Relu -> MatMul(W2) -> y [8, 32], at opset 17."""
    w1 = first if first is not None else RNG.standard_normal((64, 64)) / 8
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"], name="first"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "W2"], ["y"], name="second")]
    return model_of(nodes, [vinfo("x", shape=(8, 64))], [vinfo("y", shape=(8, 32))],
                    [_weight("W1", w1), _weight("W2", RNG.standard_normal((64, 32)) / 8)])


def test_fp8_products_read_e4m3_weights_and_qdq_activations_in_a_file_the_checker_and_onnxruntime_take():
    """Each fp8 product reads its weight as a FLOAT8E4M3FN initializer through DequantizeLinear and its input
    through a QuantizeLinear/DequantizeLinear pair, with fp16 scales; nothing else is quantized. W1's columns
    (its output channels) span five decades of magnitude, so it takes one scale per channel."""
    model = _two_matmuls(RNG.standard_normal((64, 64)) / 8 * np.logspace(-5, 0, 64)[None, :])
    converted = amppass.convert_onnx(model, "fp8", calibration=_feeds(), tolerance=0.2)
    onnx.checker.check_model(converted, full_check=True)
    nodes, inits = _by_name(converted), {t.name: t for t in converted.graph.initializer}
    producers = {o: n for n in converted.graph.node for o in n.output}
    for name in ("first", "second"):
        assert meta(nodes[name])["evidence"]["fp8"]["format"] == "e4m3", meta(nodes[name])["reason"]
        activation, weight = (producers[v] for v in nodes[name].input)
        assert activation.op_type == weight.op_type == "DequantizeLinear"
        assert inits[weight.input[0]].data_type == TensorProto.FLOAT8E4M3FN  # stored once as e4m3
        assert producers[activation.input[0]].op_type == "QuantizeLinear"
        assert inits[activation.input[1]].data_type == TensorProto.FLOAT16  # the product's dtype
        assert inits[activation.input[2]].data_type == TensorProto.FLOAT8E4M3FN  # zero point: the e4m3 type
    quantizers = [n for n in converted.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert len(quantizers) == 6 and all(n.output[0] in {i for m in ("first", "second") for i in nodes[m].input}
                                        or n.op_type == "QuantizeLinear" for n in quantizers)
    assert [o.version for o in converted.opset_import if o.domain in ("", "ai.onnx")] == [19]
    info = amppass.report(converted).info
    assert info["opset_upgraded"] == [17, 19]
    assert info["fp8"]["products"] == {"fp8": 2, "fp16": 0, "fp32": 0} and info["fp8"]["why_not"] == {}
    assert info["fp8"]["macs"] == {"fp8": 8 * 64 * (64 + 32), "fp16": 0, "fp32": 0}  # at the feeds' [8, 64]
    feed = _feeds(1)[0]
    assert _error(model, converted, feed) <= 0.2
    dequantize = producers[nodes["first"].input[1]]
    stored_w1 = numpy_helper.to_array(inits[dequantize.input[0]])  # e4m3 as float
    scales = numpy_helper.to_array(inits[dequantize.input[1]])  # one per output channel (its columns)
    assert scales.shape == (64,) and [(a.name, a.i) for a in dequantize.attribute] == [("axis", 1)]
    assert inits[dequantize.input[2]].dims == [64] and inits[dequantize.input[2]].data_type == TensorProto.FLOAT8E4M3FN
    w1 = numpy_helper.to_array(model.graph.initializer[0])
    assert np.linalg.norm(stored_w1.astype(np.float32) * scales[None, :] - w1) / np.linalg.norm(w1) < 0.05
    evidence = meta(nodes["first"])["evidence"]["fp8"]
    assert evidence["granularity"] == "channel" and "per output channel" in evidence["granularity_reason"]
    weight = evidence["operands"][1]
    assert weight["axis"] == 1 and weight["weight_scales"]["channels"] == 64
    assert weight["weight_scales"]["max"] == weight["scale"] == float(scales.max())


def test_a_weight_whose_channels_share_one_range_keeps_one_scale_and_says_why():
    """Every column of W1 holds the same values in another order: one scale per channel would be the same scale,
    so the weight's own e4m3 error is no lower and the product keeps one scale per tensor."""
    column = RNG.standard_normal(64) / 8
    w1 = np.stack([RNG.permutation(column) for _ in range(64)], axis=1)
    converted = amppass.convert_onnx(_two_matmuls(w1), "fp8", calibration=_feeds(), tolerance=0.2)
    nodes, inits = _by_name(converted), {t.name: t for t in converted.graph.initializer}
    producers = {o: n for n in converted.graph.node for o in n.output}
    dequantize = producers[nodes["first"].input[1]]
    assert list(inits[dequantize.input[1]].dims) == [] and not dequantize.attribute
    evidence = meta(nodes["first"])["evidence"]["fp8"]
    assert evidence["granularity"] == "tensor" and "not below 0.9x that" in evidence["granularity_reason"]
    assert "axis" not in evidence["operands"][1]


def test_all_zero_weight_and_all_zero_activation_get_finite_positive_scales():
    """An all-zero weight and an input that is zero on every calibration feed: scale 1, never 0, inf or NaN."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["a"], name="live"),
             helper.make_node("MatMul", ["z", "Z"], ["b"], name="zeros"),
             helper.make_node("Add", ["a", "b"], ["y"], name="add")]
    model = model_of(nodes, [vinfo("x", shape=(8, 64)), vinfo("z", shape=(8, 64))], [vinfo("y", shape=(8, 32))],
                     [_weight("W", RNG.standard_normal((64, 32)) / 8), _weight("Z", np.zeros((64, 32)))], opset=19)
    feeds = _feeds(z=lambda: np.zeros((8, 64), np.float32))
    converted = amppass.convert_onnx(model, "fp8", calibration=feeds, tolerance=0.2)
    zeros = meta(_by_name(converted)["zeros"])["evidence"]["fp8"]["operands"]
    assert [o["scale"] for o in zeros] == [1.0, 1.0] and [o["absmax"] for o in zeros] == [0.0, 0.0]
    scales = [numpy_helper.to_array(t) for t in converted.graph.initializer if t.name.endswith("_scale")]
    assert scales and all(np.isfinite(s).all() and (s > 0).all() for s in scales)
    out = session(converted).run(None, {"x": feeds[0]["x"], "z": RNG.standard_normal((8, 64)).astype(np.float32)})
    assert np.isfinite(out[0]).all()


@pytest.mark.parametrize("amax", [0.0, -1.0, float("nan"), float("inf"), 1e-30, 1e-6, 3e5])
def test_a_stored_scale_is_a_positive_normal_fp16_number_for_any_range(amax):
    scale = stored_scale(E4M3, amax, FP16)
    assert FP16.min_normal <= scale <= FP16.max
    assert float(np.float16(scale)) == scale  # what the file holds is what quantized the weights


def test_a_product_whose_input_has_an_outlier_stays_fp16_with_a_reason_naming_the_range():
    """Feature 0 of x is 1000 on every feed (its weight row is zero, so it adds nothing): the per-tensor scale it sets
    flushes the other features to e4m3's subnormals, and the first product stays fp16; the second goes fp8."""
    w1 = RNG.standard_normal((64, 64)) / 8
    w1[0] = 0.0
    model = _two_matmuls(w1)

    def with_outlier() -> np.ndarray:
        x = (RNG.standard_normal((8, 64)) * 0.01).astype(np.float32)
        x[:, 0] = 1000.0
        return x

    feeds = [{"x": with_outlier()} for _ in range(4)]
    converted = amppass.convert_onnx(model, "fp8", calibration=feeds, tolerance=0.1)
    first, second = (meta(_by_name(converted)[n]) for n in ("first", "second"))
    assert "format" not in first["evidence"]["fp8"] and first["precision"] == "low"
    assert first["evidence"]["fp8"]["why_not"].startswith("stays fp16, not e4m3")
    assert "stays fp16, not e4m3" in first["reason"] and "input x |x| <= 1e+03" in first["reason"]
    assert first["evidence"]["fp8_error_alone"] > 0.1
    assert second["evidence"]["fp8"]["format"] == "e4m3"
    assert _error(model, converted, {"x": with_outlier()}) <= 0.1


def test_an_fp8_gemm_adds_its_bias_after_the_product_so_onnxruntime_optimisations_keep_it_right():
    """onnxruntime's CPU provider quantizes a Q/DQ Gemm's bias to int32 at x_scale * w_scale, which overflows at
    fp8's scales: with the bias inside, Gemm -> Relu -> Gemm came out 0.47 off fp32 at default optimisations."""
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["h"], name="first", transB=1),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Gemm", ["r", "W2", "b2"], ["y"], name="second", transB=1)]
    model = model_of(nodes, [vinfo("x", shape=(8, 64))], [vinfo("y", shape=(8, 32))],
                     [_weight("W1", RNG.standard_normal((64, 64)) / 8), _weight("b1", RNG.standard_normal(64)),
                      _weight("W2", RNG.standard_normal((32, 64)) / 8), _weight("b2", RNG.standard_normal(32))])
    converted = amppass.convert_onnx(model, "fp8", calibration=_feeds(), tolerance=0.2)
    onnx.checker.check_model(converted, full_check=True)
    nodes_after = _by_name(converted)
    for name in ("first", "second"):
        assert "format" in meta(nodes_after[name])["evidence"]["fp8"] and len(nodes_after[name].input) == 2
    adds = [n for n in converted.graph.node if n.op_type == "Add"]
    assert sorted(n.input[1] for n in adds) == ["b1", "b2"]
    assert _error(model, converted, _feeds(1)[0]) <= 0.2


def test_fp8_without_calibration_is_refused_with_the_fix():
    with pytest.raises(amppass.AmpPassError, match=r"dtype='fp8' needs calibration=.*static"):
        amppass.convert_onnx(_two_matmuls(), "fp8")


def test_an_fp8_conv_reads_e4m3_and_adds_its_bias_unsqueezed_over_the_spatial_dimensions():
    nodes = [helper.make_node("Conv", ["img", "K1", "c1"], ["h"], name="first", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "K2", "c2"], ["y"], name="second", pads=[1, 1, 1, 1])]
    shape = (2, 8, 12, 12)
    model = model_of(nodes, [vinfo("img", shape=shape)], [vinfo("y", shape=(2, 8, 12, 12))],
                     [_weight("K1", RNG.standard_normal((16, 8, 3, 3)) / 8), _weight("c1", RNG.standard_normal(16)),
                      _weight("K2", RNG.standard_normal((8, 16, 3, 3)) / 12), _weight("c2", RNG.standard_normal(8))])

    def image() -> dict[str, np.ndarray]:
        return {"img": RNG.standard_normal(shape).astype(np.float32)}

    converted = amppass.convert_onnx(model, "fp8", calibration=[image() for _ in range(4)], tolerance=0.2)
    onnx.checker.check_model(converted, full_check=True)
    after = _by_name(converted)
    assert all("format" in meta(after[n])["evidence"]["fp8"] and len(after[n].input) == 2 for n in ("first", "second"))
    unsqueezes = [n for n in converted.graph.node if n.op_type == "Unsqueeze"]
    assert sorted(n.input[0] for n in unsqueezes) == ["c1", "c2"]
    assert _error(model, converted, image()) <= 0.2


def test_an_fp8_file_converted_again_comes_back_for_fp8_and_is_refused_for_fp16():
    converted = amppass.convert_onnx(_two_matmuls(), "fp8", calibration=_feeds(), tolerance=0.2)
    assert amppass.convert_onnx(converted, "fp8", calibration=_feeds()) is not None
    with pytest.raises(amppass.AmpPassError, match="already converted by amppass to fp8.*fp16"):
        amppass.convert_onnx(converted, "fp16")


def test_a_cuda_target_fp8_plan_is_judged_on_the_simulation_and_runs_in_onnxruntime_at_basic_optimisations():
    model = _two_matmuls()
    converted = amppass.convert_onnx(model, "fp8", calibration=_feeds(), tolerance=0.2, target="cuda")
    onnx.checker.check_model(converted, full_check=True)
    info = amppass.report(converted).info
    assert info["fp8"]["products"]["fp8"] == 2 and info["error_judged_by"] == "fp16-storage simulation"
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    got = ort.InferenceSession(converted.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feed = _feeds(1)[0]
    want = session(model).run(None, feed)[0]
    assert np.linalg.norm(got.run(None, feed)[0] - want) / np.linalg.norm(want) <= 0.2


# (nodes, the weight's shape, its output-channel axis, the input's shape, the output's shape, its channel axis)
ORIENTATIONS = {
    "MatMul x @ W": ([helper.make_node("MatMul", ["x", "W"], ["y"], name="p")], (64, 32), 1, (8, 64), (8, 32), 1),
    "MatMul W @ x": ([helper.make_node("MatMul", ["W", "x"], ["y"], name="p")], (32, 64), 0, (64, 8), (32, 8), 0),
    "Gemm x W": ([helper.make_node("Gemm", ["x", "W"], ["y"], name="p")], (64, 32), 1, (8, 64), (8, 32), 1),
    "Gemm x W transB": ([helper.make_node("Gemm", ["x", "W"], ["y"], name="p", transB=1)], (32, 64), 0, (8, 64),
                        (8, 32), 1),
    "Gemm W x transA": ([helper.make_node("Gemm", ["W", "x"], ["y"], name="p", transA=1)], (64, 32), 1, (64, 8),
                        (32, 8), 0),
}


@pytest.mark.parametrize("orientation", list(ORIENTATIONS))
def test_an_initializer_weight_in_any_orientation_takes_one_scale_per_output_channel(orientation):
    """A weight whose output channels span five decades, read second or first, as stored or transposed: it takes one
    e4m3 scale per output channel along its own channel axis (a weight read first included, as the torch front end
    gives any orientation row-wise scales), the file passes the full checker, and in onnxruntime every output
    channel, the smallest too, stays within e4m3's rounding of both operands (2 x 2^-4 of itself)."""
    nodes, shape, axis, x_shape, y_shape, y_axis = ORIENTATIONS[orientation]
    spread = np.logspace(-5, 0, shape[axis]).reshape([-1 if d == axis else 1 for d in range(2)])
    model = model_of(nodes, [vinfo("x", shape=x_shape)], [vinfo("y", shape=y_shape)],
                     [_weight("W", RNG.standard_normal(shape) / 8 * spread)])
    feeds = [{"x": RNG.standard_normal(x_shape).astype(np.float32)} for _ in range(5)]
    converted = amppass.convert_onnx(model, "fp8", calibration=feeds, tolerance=0.2)
    onnx.checker.check_model(converted, full_check=True)
    evidence = meta(_by_name(converted)["p"])["evidence"]["fp8"]
    assert evidence["format"] == "e4m3"
    weight = next(o for o in evidence["operands"] if o["value"] == "W")
    assert weight["axis"] == axis and weight["weight_scales"]["channels"] == shape[axis]
    feed = {"x": RNG.standard_normal(x_shape).astype(np.float32)}
    want = np.moveaxis(session(model).run(None, feed)[0].astype(np.float64), y_axis, 0)
    got = np.moveaxis(session(converted).run(None, feed)[0].astype(np.float64), y_axis, 0)
    errors = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
    assert errors.max() <= 2 * 2.0 ** -4


def _cancelling_model(rng: np.random.Generator, c: np.ndarray) -> onnx.ModelProto:
    """y = sum of four steady products of z (small weights: each adds a small e4m3 error) and one product of x whose
    weight has ``c`` in its null space: x = a c + s n leaves s n W, so x's e4m3 rounding, relative to a c, lands
    on an output of size s and its error varies with each batch's s."""
    null = np.eye(64) - np.outer(c, c)
    weights = {f"steady{i}": ("z", rng.standard_normal((64, 32)) / 40) for i in range(4)}
    weights["cancelling"] = ("x", null @ rng.standard_normal((64, 32)) / 8)
    nodes = [helper.make_node("MatMul", [read, f"W_{name}"], [f"y_{name}"], name=name)
             for name, (read, _) in weights.items()]
    nodes.append(helper.make_node("Sum", [f"y_{name}" for name in weights], ["y"], name="sum"))
    return model_of(nodes, [vinfo("x", shape=(8, 64)), vinfo("z", shape=(8, 64))], [vinfo("y", shape=(8, 32))],
                    [_weight(f"W_{name}", w) for name, (_, w) in weights.items()])


def test_the_fp8_search_judges_each_trial_by_a_bound_on_a_new_batch_so_the_tolerance_holds_on_fresh_batches():
    """Batches from one source whose fp8 error varies from batch to batch (each batch's noise scale s is drawn
    log-normally): the largest error of the 4 calibration batches with the cancelling product in e4m3 is 0.048,
    within 0.05, so the search as it was (judged by the largest error) kept that product, and 21 of 40 fresh batches
    then missed 0.05 (up to 0.076). Judged by the 95% prediction bound of its errors on those 4 (0.053 with it alone
    in e4m3), it stays fp16, and every fresh batch stays within 0.05 (at most 0.033 measured). The record holds the
    errors and the bound in the torch record's shape."""

    rng, source = np.random.default_rng(0), np.random.default_rng(3)
    c = rng.standard_normal(64)
    c /= np.linalg.norm(c)
    model = _cancelling_model(rng, c)

    def batch() -> dict[str, np.ndarray]:
        spread = float(np.exp(source.normal(0, 0.5)))
        return {"x": (spread * source.standard_normal((8, 64)) + 7 * c).astype(np.float32),
                "z": source.standard_normal((8, 64)).astype(np.float32)}

    calibration = [batch() for _ in range(4)]
    fresh = [batch() for _ in range(40)]
    converted = amppass.convert_onnx(model, "fp8", calibration=calibration, tolerance=0.05)
    nodes = _by_name(converted)
    assert all(meta(nodes[f"steady{i}"])["evidence"]["fp8"].get("format") == "e4m3" for i in range(4))
    why_not = meta(nodes["cancelling"])["evidence"]["fp8"]["why_not"]
    assert "beyond the tolerance 0.05" in why_not and "bounded for a new batch from the last 4 of 4" in why_not, why_not
    errors = [_error(model, converted, feed) for feed in fresh]
    assert max(errors) <= 0.05, errors  # 0.033 measured

    info = amppass.report(converted).info
    record = info["fp8"]
    assert record["judged_batches"] == len(record["batch_errors"]) == 4
    assert record["output_error"] == max(record["batch_errors"]) == info["achieved_error"]
    assert record["error_bound"] == batch_bound(record["batch_errors"]) <= 0.05
    assert record["margin"] == pytest.approx(record["error_bound"] - record["output_error"]) and record["margin"] > 0
    assert record["bound_rule"] == BOUND_RULE and record["tolerance_met"] and record["trials"] >= 6
    assert info["held_out_error"] is None  # the fp8 plan holds no batch out: its bound judges new inputs


def _three_steady_two_outliers() -> tuple[onnx.ModelProto, list[dict[str, np.ndarray]]]:
    """y = the sum of three products of x (each alone about 0.009 off in e4m3) and two of u, whose feature 0 is 3e4
    (their weights' row 0 is zero): its per-tensor scale leaves u's other values to e4m3's subnormals, and each of
    those products alone moves the output by about 0.036; six calibration feeds."""
    rng = np.random.default_rng(0)
    nodes, weights = [], []
    for i, read in enumerate("xxxuu"):
        w = rng.standard_normal((64, 32)) / 8
        if read == "u":
            w[0] = 0.0
            w *= 3
        nodes.append(helper.make_node("MatMul", [read, f"W{i}"], [f"y{i}"], name=f"p{i}"))
        weights.append(_weight(f"W{i}", w))
    nodes.append(helper.make_node("Sum", [f"y{i}" for i in range(5)], ["y"], name="sum"))
    model = model_of(nodes, [vinfo("x", shape=(8, 64)), vinfo("u", shape=(8, 64))], [vinfo("y", shape=(8, 32))],
                     weights)

    def feed() -> dict[str, np.ndarray]:
        u = rng.standard_normal((8, 64)).astype(np.float32)
        u[:, 0] = 3e4
        return {"x": rng.standard_normal((8, 64)).astype(np.float32), "u": u}

    return model, [feed() for _ in range(6)]


@pytest.mark.parametrize("tolerance", [0.011, 0.03])
def test_stopping_a_trial_at_its_first_batch_beyond_the_tolerance_changes_no_decision_and_runs_fewer_batches(
        monkeypatch, tolerance):
    """The search stops a trial at its first judged batch beyond the tolerance: the same products go fp8, with the
    same record, as judging every batch of every trial, in fewer batch runs, each trial's session built once. At
    0.011 one steady product goes fp8 and the search never needs the order of the two outlier products, each
    stopped at one batch: their reasons say the error is a lower bound. At 0.03 the three steady ones go fp8 and
    the bisection asks for four products: the outlier whose stopping error ranks first is measured on every batch,
    and its bound still ranks below the other's lower bound, so the other is not."""
    model, calibration = _three_steady_two_outliers()
    sessions = []
    built = onnx_calibrate.trial_session
    monkeypatch.setattr(onnx_calibrate, "trial_session", lambda *a, **k: sessions.append(1) or built(*a, **k))

    def converted() -> tuple[dict, dict[str, dict], int]:
        sessions.clear()
        result = amppass.convert_onnx(model, "fp8", calibration=calibration, tolerance=tolerance)
        nodes = _by_name(result)
        return amppass.report(result).info["fp8"], {f"p{i}": meta(nodes[f"p{i}"]) for i in range(5)}, len(sessions)

    early, early_rows, early_sessions = converted()
    monkeypatch.setattr(tolerance_search, "STOP_EARLY", False)
    full, full_rows, full_sessions = converted()
    fp8 = [n for n, row in early_rows.items() if row["evidence"]["fp8"].get("format")]
    assert fp8 == [n for n, row in full_rows.items() if row["evidence"]["fp8"].get("format")]
    assert fp8 == (["p0"] if tolerance == 0.011 else ["p0", "p1", "p2"])
    for key in ("batch_errors", "output_error", "error_bound", "baseline_error", "trials"):
        assert early[key] == full[key], key
    assert full["batch_runs"] == 6 * full["trials"] and early["batch_runs"] < full["batch_runs"]
    stopped_early = {"p3", "p4"} if tolerance == 0.011 else {"p3"}  # at 0.03 p4 ranks fourth: measured in full
    for name in ("p3", "p4"):
        stopped, measured = early_rows[name]["evidence"], full_rows[name]["evidence"]
        if name in stopped_early:
            assert stopped["fp8_error_alone_at_least"] and stopped["fp8_error_alone"] < measured["fp8_error_alone"]
            assert (f"moves the output by at least {stopped['fp8_error_alone']:.2g} on one batch of 6, beyond the "
                    f"tolerance {tolerance:g}") in stopped["fp8"]["why_not"]
        else:
            assert stopped == measured
        assert "at least" not in measured["fp8"]["why_not"] and "fp8_error_alone_at_least" not in measured
    if tolerance == 0.011:
        assert early_sessions == full_sessions  # one session per trial, not one per batch run
