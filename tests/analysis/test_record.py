"""amppass.analysis.record: the summary keys every conversion opens with, and the refusal to convert a converted
model again."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import pytest
import torch

import amppass
from amppass.analysis.record import META_KEY, check_reconversion, summary
from amppass.errors import AmpPassError, InputError
from tests.helpers.small_models import matmul_model, mlp

SUMMARY_KEYS = ["amppass_version", "front_end", "dtype", "target", "mode", "keep_io_types", "casts",
                "weights_converted", "weight_copies", "weight_bytes_before", "weight_bytes_after"]


@dataclass
class Counts:
    casts: int
    weights_converted: int
    weight_copies: int


def test_summary_opens_with_its_keys_in_order_and_copies_the_counts():
    info = summary("onnx", "fp16", "cpu (onnxruntime)", "inference", False, Counts(3, 2, 1), 400, 200)
    assert list(info) == SUMMARY_KEYS
    assert info == {"amppass_version": amppass.__version__, "front_end": "onnx", "dtype": "fp16",
                    "target": "cpu (onnxruntime)", "mode": "inference", "keep_io_types": False, "casts": 3,
                    "weights_converted": 2, "weight_copies": 1, "weight_bytes_before": 400,
                    "weight_bytes_after": 200}
    json.dumps(info)  # stored as JSON in an ONNX model's metadata: plain values only


def test_both_front_ends_store_the_summary_first_under_one_key():
    onnx_model = amppass.convert_onnx(matmul_model())
    stored = {p.key: p.value for p in onnx_model.metadata_props}
    onnx_info = json.loads(stored[META_KEY])
    assert list(onnx_info)[:len(SUMMARY_KEYS)] == SUMMARY_KEYS
    assert onnx_info["front_end"] == "onnx" and onnx_info["dtype"] == "fp16"
    planned = [n for n in onnx_model.graph.node if n.op_type == "MatMul"]
    assert planned and all(json.loads({p.key: p.value for p in n.metadata_props}[META_KEY])["precision"] == "low"
                           for n in planned)

    gm = amppass.convert(mlp(), dtype=torch.bfloat16, plan_for="coverage")  # traced: no export warm-up
    torch_info = gm.meta[META_KEY]
    assert list(torch_info)[:len(SUMMARY_KEYS)] == SUMMARY_KEYS
    assert torch_info["front_end"] == "fx" and torch_info["dtype"] == "bf16" and torch_info["mode"] == "inference"
    linears = [n for n in gm.graph.nodes if META_KEY in n.meta and n.meta[META_KEY].get("op", "").endswith("linear")]
    assert linears and all(n.meta[META_KEY]["precision"] == "low" for n in linears)


def test_reconversion_to_what_it_is_returns_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="amppass.analysis.record"):
        assert check_reconversion("model.onnx", "fp16", "fp16", "convert the original") is None
        assert check_reconversion("MLP", "bf16", "bf16", "fix", done_mode="train", wanted_mode="train") is None
    assert [r.getMessage() for r in caplog.records] == [
        "model.onnx was already converted by amppass to fp16; returned unchanged",
        "MLP was already converted by amppass to bf16 (train mode); returned unchanged",
    ]


def test_reconversion_with_no_mode_recorded_is_taken_as_the_mode_asked():
    """A model converted by an amppass that recorded no mode is returned for any mode at its dtype."""
    check_reconversion("MLP", "fp16", "fp16", "fix", done_mode=None, wanted_mode="inference")


@pytest.mark.parametrize("done, wanted, done_mode, wanted_mode, was, asked", [
    ("fp16", "bf16", None, None, "fp16", "bf16"),
    ("bf16", "fp16", "inference", "inference", "bf16 (inference mode)", "fp16 (inference mode)"),
    ("fp16", "fp16", "inference", "train", "fp16 (inference mode)", "fp16 (train mode)"),
])
def test_reconversion_to_something_else_is_refused_naming_both(done, wanted, done_mode, wanted_mode, was, asked):
    with pytest.raises(InputError) as raised:
        check_reconversion("m.onnx", done, wanted, "convert the original float32 model", done_mode=done_mode,
                           wanted_mode=wanted_mode)
    assert isinstance(raised.value, AmpPassError)
    assert str(raised.value) == (f"m.onnx was already converted by amppass to {was}; it cannot be converted to "
                                 f"{asked} on top of that: convert the original float32 model")


def test_a_converted_model_is_refused_by_both_entry_points():
    converted = amppass.convert_onnx(matmul_model())
    with pytest.raises(InputError, match=r"already converted by amppass to fp16; it cannot be converted to bf16"):
        amppass.convert_onnx(converted, dtype="bf16")
    assert amppass.convert_onnx(converted).graph == converted.graph  # the same dtype: unchanged

    gm = amppass.convert(mlp(), dtype=torch.bfloat16, plan_for="coverage")
    with pytest.raises(
        InputError,
        match=r"to bf16 \(inference mode\); it cannot be converted to fp16 \(inference mode\) "
        r"on top of that: convert the original float32 module instead",
    ):
        amppass.convert(gm, dtype=torch.float16)
    assert amppass.convert(gm, dtype=torch.bfloat16) is gm
