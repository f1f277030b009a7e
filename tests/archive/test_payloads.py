"""amppass.archive.payloads: every tensor of a .pt2 file fits in its bytes, and the sample inputs are a small
plain tree of tensors and numbers.

A 20 KB file whose weight has no bytes asks torch for zeros of the size its config declares; a 1.4 KB sample
inputs pickle whose lists share their branches hands torch's tree walk 8**10 leaves.
"""

from __future__ import annotations

import json

import pytest
import torch

import amppass
from amppass import InputError
from tests.helpers.pt2_files import empty_weight, pickled, rewrite, saved, shared_branches  # noqa: F401 - saved is a fixture


def test_a_weight_file_without_bytes_cannot_ask_for_gigabytes(saved, tmp_path):
    """torch builds a tensor of a file with no bytes as zeros of the size the config declares."""
    empty = rewrite(saved["converted"], tmp_path / "empty.pt2", empty_weight)
    assert empty.stat().st_size < 64 << 10
    with pytest.raises(InputError, match="declares 536,870,912 elements of 2 bytes, more than its file holds"):
        amppass.load(empty)


@pytest.mark.parametrize("change, words", [
    (lambda m: m.update(sizes=[{"as_int": 9}, {"as_int": 8}]), "declares 72 elements"),
    (lambda m: m.update(storage_offset={"as_int": 1}), "declares 65 elements"),
    (lambda m: m.update(strides=[{"as_int": 16}, {"as_int": 1}]), "declares 120 elements"),
    (lambda m: m.update(sizes=[{"as_int": -1}, {"as_int": 8}]), "non-negative integer"),
    (lambda m: m.update(sizes=[{"as_expr": "s0"}, {"as_int": 8}]), "non-negative integer"),
    (lambda m: m.update(dtype=7), "declares 64 elements of 4 bytes"),
    (lambda m: m.update(dtype=999), "a dtype"),
], ids=["rows", "offset", "stride", "negative", "symbolic", "dtype-too-wide", "unknown-dtype"])
def test_a_tensor_description_larger_than_its_bytes_is_refused(saved, tmp_path, change, words):
    def edit(entries):
        config = json.loads(entries["data/weights/model_weights_config.json"])
        meta = config["config"]["0.weight"]  # an [8, 8] bf16 weight: 128 bytes
        change(meta["tensor_meta"])
        entries["data/weights/model_weights_config.json"] = json.dumps(config).encode()

    with pytest.raises(InputError, match=words):
        amppass.load(rewrite(saved["converted"], tmp_path / "m.pt2", edit))


def _sample_inputs(value) -> bytes:
    return pickled(value)


def _nested(depth: int) -> list:
    value: list = [torch.ones(1)]
    for _ in range(depth):
        value = [value]
    return value


def test_sample_inputs_that_share_their_branches_are_refused_before_torch_walks_them(saved, tmp_path):
    laughs = rewrite(saved["converted"], tmp_path / "laughs.pt2", shared_branches)
    assert laughs.stat().st_size < 64 << 10
    with pytest.raises(InputError, match="more than 100,000 values"):
        amppass.load(laughs)


@pytest.mark.parametrize("value, words", [
    (((torch.ones(2, 8),), {"x' or open('f', 'w') or '": torch.ones(1)}), "key"),
    (((torch.ones(2, 8), "a' or '"), {}), "sample input"),
    (((_nested(70),), {}), "deeper than 64"),
], ids=["quoted-key", "quoted-string", "deep"])
def test_sample_inputs_torch_would_paste_into_guards_are_refused(saved, tmp_path, value, words):
    def edit(entries):
        entries["data/sample_inputs/model.pt"] = _sample_inputs(value)

    with pytest.raises(InputError, match=words):
        amppass.load(rewrite(saved["converted"], tmp_path / "samples.pt2", edit))
