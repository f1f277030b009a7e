"""What a converted model carries besides its program, read as untrusted data: the names and decisions stored on
its nodes and its summary (a .pt2 or an ONNX model), and the files the CLI reads and writes.

Every value must come through a reader that checks its type and bounds it, and every failure must be an
:class:`~amppass.InputError` naming the node or field; no stored text is ever a format string.
"""

from __future__ import annotations

import pytest
import torch

import amppass
from amppass import InputError
from amppass.cli import main
from tests.helpers.pt2_files import (X, edit_program, mlp, rewrite, saved, stored_name,  # noqa: F401
                                     stored_names)  # saved is a fixture


@pytest.mark.parametrize("value", [7, None, ["linear"], "", "x = 1", "class", "n" * 513],
                         ids=["int", "null", "list", "empty", "code", "keyword", "long"])
def test_a_stored_node_name_that_is_not_an_identifier_is_refused(saved, tmp_path, value, capsys):
    evil = rewrite(saved["converted"], tmp_path / "evil.pt2", edit_program(stored_name(value)))
    with pytest.raises(InputError) as caught:
        amppass.load(evil)
    said = str(caught.value)
    assert "evil.pt2" in said and "amppass_name" in said and "Python identifier" in said and "convert the original" in said
    assert main(["report", str(evil)]) == 1
    assert "amppass: error:" in capsys.readouterr().err


def test_two_nodes_with_one_stored_name_are_refused(saved, tmp_path):
    import zipfile

    with zipfile.ZipFile(saved["converted"]) as archive:
        entries = {i.filename.partition("/")[2]: archive.read(i) for i in archive.infolist()}
    first = stored_names(entries)[0]
    evil = rewrite(saved["converted"], tmp_path / "evil.pt2", edit_program(stored_name(first, node=1)))
    with pytest.raises(InputError, match=f"is '{first}', which another node of the file also names itself"):
        amppass.load(evil)


def test_honest_stored_names_come_back(saved):
    loaded = amppass.load(saved["converted"])
    names = [row.name for row in amppass.report(loaded).rows]
    assert names == [row.name for row in amppass.report(amppass.convert(mlp(), X, "bf16", plan_for="coverage")).rows]
    assert torch.isfinite(loaded(*X)).all()
