"""Converting an already converted model changes nothing and says so; asking for another dtype is an error."""

from __future__ import annotations

import logging

import onnx
import pytest
import torch

import amppass
from amppass.cli import main
from amppass.onnx.io.save import save
from tests.helpers.small_models import X, matmul_model, mlp


def ours(caplog) -> list[logging.LogRecord]:
    """amppass's own records: torch's trace loggers can reach the capture too, depending on test order."""
    return [r for r in caplog.records if r.name.startswith("amppass")]


def test_onnx_reconvert_returns_an_unchanged_copy_and_warns(caplog):
    once = amppass.convert_onnx(matmul_model(), "fp16")
    before = once.SerializeToString()
    with caplog.at_level(logging.WARNING, logger="amppass"):
        twice = amppass.convert_onnx(once, "fp16")
    assert twice is not once and twice.SerializeToString() == before
    assert once.SerializeToString() == before
    assert [r.getMessage() for r in ours(caplog)] == [
        "the onnx.ModelProto passed to convert_onnx was already converted by amppass to fp16; returned unchanged"]
    assert amppass.report(twice).info == amppass.report(once).info


def test_onnx_reconvert_from_a_path_with_external_data(tmp_path, caplog):
    once = amppass.convert_onnx(matmul_model(), "bf16", target="cuda")  # the CPU provider has no bf16 MatMul
    save(once, tmp_path / "m.onnx", external_data=True)
    with caplog.at_level(logging.WARNING, logger="amppass"):
        twice = amppass.convert_onnx(tmp_path / "m.onnx", "bfloat16")
    for tensor in twice.graph.initializer:  # read back from m.onnx.data: now inline, as in ``once``
        assert not tensor.external_data
        tensor.ClearField("data_location")
    assert twice.SerializeToString() == once.SerializeToString()
    assert "m.onnx' was already converted by amppass to bf16" in caplog.text


def test_onnx_reconvert_to_another_dtype_names_both():
    once = amppass.convert_onnx(matmul_model(), "fp16")
    with pytest.raises(amppass.InputError, match="already converted by amppass to fp16.*to bf16"):
        amppass.convert_onnx(once, "bf16")


def test_cli_reconvert_prints_one_note_and_writes_the_same_model(tmp_path, capsys):
    save(amppass.convert_onnx(matmul_model(), "fp16"), tmp_path / "once.onnx")
    assert main(["convert", str(tmp_path / "once.onnx"), "-o", str(tmp_path / "twice.onnx")]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "already converted" in line]
    assert len(notes) == 1 and "once.onnx" in notes[0] and "fp16" in notes[0] and "unchanged" in notes[0], out
    assert main(["convert", str(tmp_path / "once.onnx"), "-o", str(tmp_path / "bf16.onnx"), "--dtype", "bf16"]) == 1
    assert "already converted by amppass to fp16" in capsys.readouterr().err
    assert not (tmp_path / "bf16.onnx").exists()
    assert onnx.load(tmp_path / "twice.onnx") == onnx.load(tmp_path / "once.onnx")


def test_fx_reconvert_returns_the_same_module_and_warns(caplog):
    once = amppass.convert(mlp().eval(), X, "fp16", plan_for="coverage")
    code = once.code
    with caplog.at_level(logging.WARNING, logger="amppass"):
        assert amppass.convert(once, X, "fp16", plan_for="coverage") is once
        assert amppass.convert(once, X, plan_for="coverage") is once, "dtype='auto' accepts what the module already is"
    assert once.code == code
    warned = ours(caplog)
    assert warned and all("already converted by amppass to fp16" in r.getMessage() for r in warned)


def test_fx_reconvert_to_another_dtype_or_mode_names_both():
    once = amppass.convert(mlp(), X, torch.bfloat16, plan_for="coverage")
    with pytest.raises(amppass.InputError, match="already converted by amppass to bf16.*to fp16"):
        amppass.convert(once, X, torch.float16, plan_for="coverage")
    with pytest.raises(amppass.InputError, match=r"\(inference mode\).*\(train mode\)"):
        amppass.convert(once, X, "bf16", mode="train", plan_for="coverage")
