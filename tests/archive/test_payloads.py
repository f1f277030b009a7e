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
from tests.helpers.pt2_files import empty_weight, pickled, rewrite, shared_branches


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


def _pickle_of(value) -> bytes:
    """The data.pkl torch.save writes for ``value``."""
    import io
    import zipfile

    archive = zipfile.ZipFile(io.BytesIO(pickled(value)))
    return archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))


class _Reduced:
    """Pickled as ``call(*args)``: what a file may ask torch's weights-only unpickler to build."""

    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def test_the_sample_inputs_torch_export_writes_pass_the_pickle_reader():
    """Tensors of every kind a model takes, and the numbers, strings and containers export stores beside them."""
    from collections import OrderedDict

    from amppass.archive.payloads import check_pickle

    value = ((torch.ones(2, 8), torch.ones(3, dtype=torch.bfloat16), torch.arange(4), torch.zeros(0, 5),
              torch.ones(4, 4).t(), torch.ones(2)[1:], [1, 2.5, None, True], 1 << 40),
             {"mask": torch.ones(2, dtype=torch.bool), "dtype": torch.float16, "device": torch.device("cpu"),
              "size": torch.Size([2, 3]), "ordered": OrderedDict(a=torch.ones(1)), "name": "text"})
    check_pickle(_pickle_of(value), "samples")


@pytest.mark.parametrize("value, words", [
    (_Reduced(bytearray, 1 << 30), "names '__builtin__.bytearray'"),
    (_Reduced(torch.Tensor, 1 << 28), "names 'torch.Tensor'"),
    (_Reduced(set, [1, 2]), "names '__builtin__.set'"),
    (_Reduced(print, "x"), "names '__builtin__.print'"),
    ({1, 2}, "names '__builtin__.set'"),
], ids=["bytearray", "legacy-tensor", "set", "builtin", "set-literal"])
def test_a_pickle_naming_what_torch_save_does_not_write_for_inputs_is_refused(value, words):
    from amppass.archive.payloads import check_pickle

    with pytest.raises(InputError, match=f"samples {words} at byte .*trusted=True"):
        check_pickle(_pickle_of(((torch.ones(1),), {"x": value})), "samples")


@pytest.mark.parametrize("data, words", [
    (b"\x80\x02cbuiltins\nbytearray\n.", "names 'builtins.bytearray'"),
    (b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00N.", "uses opcode FRAME at byte 2"),
    (b"\x80\x02(X\x00\x00\x00\x10", "not a pickle amppass can read"),
    (b"\x80\x02}\x81.", "uses opcode NEWOBJ"),
    (b"\x80\x02)b.", "uses opcode BUILD"),
], ids=["builtins-global", "protocol-4", "cut", "newobj", "build"])
def test_pickle_opcodes_outside_the_allowlist_are_refused_before_torch_reads_them(data, words):
    from amppass.archive.payloads import check_pickle

    with pytest.raises(InputError, match=words):
        check_pickle(data, "samples")


def test_sample_inputs_with_an_oversized_pickle_or_none_are_refused(saved, tmp_path, monkeypatch):
    from amppass.archive import payloads

    monkeypatch.setattr(payloads, "MAX_PICKLE", 64)
    with pytest.raises(InputError, match="model.pt': its pickle 'data.pkl' is missing or over 64 bytes"):
        amppass.load(saved["converted"])

    def edit(entries):
        entries["data/sample_inputs/model.pt"] = b"\x80\x02N." + entries["data/sample_inputs/model.pt"]

    with pytest.raises(InputError, match="model.pt' is not a torch.save archive \\(it does not start as a zip"):
        amppass.load(rewrite(saved["converted"], tmp_path / "legacy.pt2", edit))
