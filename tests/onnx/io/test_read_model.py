"""An ONNX model read for conversion (amppass.onnx.io.read_model): a path gives the model without its large
payloads and the folder its external data is read from; a proto given in memory is only read; what is not an ONNX
model is an InputError naming the path and the fix."""

from __future__ import annotations

import os
import zipfile

import onnx
import pytest

from amppass.errors import InputError
from amppass.onnx.io.read_model import Loaded, load
from amppass.pipelines import convert_onnx
from tests.helpers.onnx_files import matmul_64


def test_a_path_reads_into_a_model_amppass_owns_with_its_folder(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(matmul_64(), path)
    loaded = load(str(path))
    assert isinstance(loaded, Loaded) and loaded.owned
    assert loaded.base_dir == os.path.abspath(tmp_path) and loaded.where == repr(str(path))
    assert [n.op_type for n in loaded.model.graph.node] == ["MatMul"]


def test_a_proto_is_only_read():
    model = matmul_64()
    before = model.SerializeToString()
    loaded = load(model, check=True)
    assert loaded.model is model and not loaded.owned and loaded.base_dir is None
    assert model.SerializeToString() == before


@pytest.mark.parametrize("what, says", [
    ("folder", "is a folder, not a file; pass the path of the .onnx model inside it"),
    ("missing", "is not a file (no such path)"),
    ("empty", "is not an ONNX model (it holds no IR version or graph)"),
    ("zip", "a PyTorch checkpoint? use amppass.convert or amppass.export_onnx"),
])
def test_what_is_not_an_onnx_model_is_refused_by_name(tmp_path, what, says):
    path = tmp_path / "m.onnx"
    if what == "folder":
        path.mkdir()
    elif what == "empty":
        path.write_bytes(b"")
    elif what == "zip":
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
    with pytest.raises(InputError, match="m.onnx") as raised:
        load(str(path))
    assert says in str(raised.value)


def test_a_proto_without_a_graph_and_a_wrong_type_are_refused():
    with pytest.raises(InputError, match="the onnx.ModelProto passed to convert_onnx is not an ONNX model"):
        load(onnx.ModelProto())
    with pytest.raises(InputError, match="takes a path to a .onnx file or an onnx.ModelProto, not int"):
        load(3)


def test_the_pipelines_path_still_gives_the_loader():
    assert convert_onnx.load is load and convert_onnx.Loaded is Loaded
