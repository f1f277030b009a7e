"""``export_onnx`` / ``convert_onnx`` with ``dtype="fp8"`` on models from torch: a small MLP, a tiny BERT and, for
``target="cuda"``, a tiny ViT and a tiny GPT-2 built from transformers configs (random weights) give files that pass the
full checker, run in onnxruntime's CPU provider within the tolerance of fp32, and report their fp8 products with scales
and the MACs in fp8."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import amppass
from tests.helpers.onnx_graphs import meta

transformers = pytest.importorskip("transformers")
RNG = np.random.default_rng(0)
TOLERANCE = 2e-2


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want.astype(np.float64)))


def _session(path, level: str = "ORT_ENABLE_ALL") -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _token_feed(batch: int = 2, length: int = 12) -> dict[str, np.ndarray]:
    return {"input_ids": RNG.integers(0, 200, (batch, length)).astype(np.int64),
            "attention_mask": np.ones((batch, length), np.int64),
            "token_type_ids": np.zeros((batch, length), np.int64)}


@pytest.fixture(scope="module")
def bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=32, vocab_size=200)
    return transformers.BertModel(config).eval()


@pytest.fixture(scope="module")
def bert_fp8(bert, tmp_path_factory):
    """The tiny BERT exported to fp8 for onnxruntime's CPU provider (the default target), and its path."""
    path = tmp_path_factory.mktemp("fp8") / "bert.fp8.onnx"
    feeds = [_token_feed() for _ in range(4)]
    example = {k: torch.from_numpy(v) for k, v in feeds[0].items()}
    converted = amppass.export_onnx(bert, path, example_kwargs=example, dtype="fp8", calibration=feeds)
    return converted, path


def test_an_mlp_exported_in_fp8_passes_the_checker_and_runs_within_tolerance(tmp_path):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
                              torch.nn.Linear(128, 16)).eval()
    feeds = [{"input": RNG.standard_normal((8, 64)).astype(np.float32)} for _ in range(4)]
    path = tmp_path / "mlp.fp8.onnx"
    converted = amppass.export_onnx(mlp, (torch.from_numpy(feeds[0]["input"]),), path, dtype="fp8",
                                    calibration=feeds, tolerance=0.1, output_names=["out"])
    onnx.checker.check_model(str(path), full_check=True)
    info = amppass.report(converted).info["fp8"]
    assert info["products"]["fp8"] >= 1 and info["tolerance_met"]
    x = RNG.standard_normal((8, 64)).astype(np.float32)
    got = _session(path).run(None, {converted.graph.input[0].name: x})[0]
    with torch.no_grad():
        want = mlp(torch.from_numpy(x)).numpy()
    assert _relative(got, want) <= 0.1


def test_a_tiny_bert_in_fp8_passes_the_checker_and_runs_in_onnxruntime_within_tolerance(bert, bert_fp8):
    converted, path = bert_fp8
    onnx.checker.check_model(str(path), full_check=True)
    session = _session(path)  # default optimisations, as a user's session
    for _ in range(3):  # inputs the conversion never saw
        feed = _token_feed()
        got = session.run(["last_hidden_state"], feed)[0]
        with torch.no_grad():
            want = bert(**{k: torch.from_numpy(v) for k, v in feed.items()}).last_hidden_state.numpy()
        assert _relative(got, want) <= TOLERANCE
    info = amppass.report(converted).info["fp8"]
    assert info["products"]["fp8"] >= 1 and info["output_error"] <= info["error_bound"] <= TOLERANCE


def test_the_report_names_each_fp8_product_with_its_scales_and_the_mac_shares(bert_fp8):
    converted, _ = bert_fp8
    report = amppass.report(converted)
    fp8_rows = [row for row in report.rows if row.precision == "fp8"]
    assert fp8_rows and all(row.op in ("MatMul", "Gemm", "Conv") for row in fp8_rows)
    assert fp8_rows == [row for row in report.fp8_rows() if "format" in row.evidence["fp8"]]
    for row in fp8_rows:
        operands = row.evidence["fp8"]["operands"]
        assert len(operands) == 2 and all(o["scale"] > 0 and np.isfinite(o["scale"]) for o in operands)
        assert "e4m3 inputs and weights" in row.reason and "scale" in row.reason
    others = [row for row in report.rows if row.op in ("MatMul", "Gemm") and row.precision != "fp8"]
    assert all("not e4m3" in row.evidence["fp8"]["why_not"] for row in others)  # every product left higher says why
    record = report.info["fp8"]
    assert record["products"] == {"fp8": len(fp8_rows), "fp16": len(others), "fp32": 0}
    assert sum(record["why_not"].values()) == len(others)
    macs = record["macs"]
    assert macs["fp8"] > 0 and record["counted_at"]["input_ids"] == [2, 12]
    summary = report.summary()
    assert f"fp8 (e4m3): {len(fp8_rows)} of {len(fp8_rows) + len(others)} matrix products" in summary
    assert f"fp8 {macs['fp8'] / sum(macs.values()):.1%}" in summary
    nodes = {n.name: n for n in converted.graph.node}
    assert all(meta(nodes[row.name]).get("evidence", {}).get("fp8") for row in fp8_rows)  # read from the file


@pytest.mark.slow  # a second BERT conversion; tests/onnx/test_fp8.py holds a quick cuda-target one
def test_a_cuda_target_fp8_file_runs_in_onnxruntime_cpu_at_basic_optimisations(bert, tmp_path):
    """For a GPU target the search judges on the fp16-storage simulation; onnxruntime's CPU provider runs the file
    with its basic optimisations (its extended QDQ fusions assume int8 and reject e4m3 between reshapes)."""
    feeds = [_token_feed() for _ in range(3)]
    path = tmp_path / "bert.cuda.fp8.onnx"
    converted = amppass.export_onnx(bert, path, example_kwargs={k: torch.from_numpy(v) for k, v in feeds[0].items()},
                                    dtype="fp8", calibration=feeds, target="cuda")
    onnx.checker.check_model(str(path), full_check=True)
    assert amppass.report(converted).info["fp8"]["products"]["fp8"] >= 1
    feed = _token_feed()
    got = _session(path, "ORT_ENABLE_BASIC").run(["last_hidden_state"], feed)[0]
    with torch.no_grad():
        want = bert(**{k: torch.from_numpy(v) for k, v in feed.items()}).last_hidden_state.numpy()
    assert _relative(got, want) <= TOLERANCE


def _fp8_bound(products: int) -> float:
    """How far ``products`` e4m3 products may move the output, relative to its norm: each rounds both operands to
    e4m3's 3 significand bits, moving each value by up to 2**-4 of itself, spread evenly (an RMS of 2**-4 / sqrt(3)
    per operand, sqrt(2) times that for a product of two rounded operands); independent products add in quadrature."""
    return math.sqrt(products) * 2 ** -4 * math.sqrt(2 / 3)


def _tiny_vit():
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                    image_size=32, patch_size=8)
    return transformers.ViTModel(config).eval(), lambda: {
        "pixel_values": RNG.standard_normal((2, 3, 32, 32)).astype(np.float32)}


def _tiny_gpt2():
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=200, n_positions=32, use_cache=False)
    return transformers.GPT2Model(config).eval(), lambda: {
        "input_ids": RNG.integers(0, 200, (2, 12)).astype(np.int64)}


@pytest.mark.parametrize("build", [_tiny_vit, _tiny_gpt2], ids=["vit", "gpt2"])
def test_a_tiny_vit_and_gpt2_exported_in_fp8_for_cuda_pass_the_full_checker_and_run_within_their_fp8_bound(
        build, tmp_path):
    """ViT's patch-embedding Conv, LayerNorm and Erf GELU; GPT-2's Conv1D products (Gemm and MatMul) and its causal
    attention: the cuda file passes the full checker and runs in onnxruntime's CPU provider (the machine has no CUDA
    provider) at basic optimisations, on inputs the conversion never saw, within the bound its fp8 product count
    allows (:func:`_fp8_bound`), and the search's own error is within the tolerance."""
    torch.manual_seed(0)
    model, feed = build()
    feeds = [feed() for _ in range(3)]
    path = tmp_path / "model.cuda.fp8.onnx"
    converted = amppass.export_onnx(model, path, example_kwargs={k: torch.from_numpy(v) for k, v in feeds[0].items()},
                                    dtype="fp8", calibration=feeds, target="cuda")
    onnx.checker.check_model(str(path), full_check=True)
    info = amppass.report(converted).info["fp8"]
    products = info["products"]["fp8"]
    assert products >= 1 and info["output_error"] <= info["error_bound"] <= TOLERANCE
    session = _session(path, "ORT_ENABLE_BASIC")
    for _ in range(2):
        held_out = feed()
        got = session.run(["last_hidden_state"], held_out)[0]
        with torch.no_grad():
            want = model(**{k: torch.from_numpy(v) for k, v in held_out.items()}).last_hidden_state.numpy()
        assert np.isfinite(got).all() and _relative(got, want) <= _fp8_bound(products)
