"""amppass.onnx.io.external_data: the numbers an external-data entry holds are read with bounds."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto

import amppass
from amppass import InputError
from amppass.cli import main
from amppass.onnx.io.external_data import MAX_DIGITS
from tests.helpers.small_models import matmul_model


def _saved(tmp_path, **fields: str) -> str:
    """matmul_model saved in ``tmp_path`` with W's bytes in ``w.data``, its external-data entry holding ``fields``."""
    model = matmul_model()
    weight = model.graph.initializer[0]
    (tmp_path / "w.data").write_bytes(weight.raw_data)
    weight.ClearField("raw_data")
    weight.data_location = TensorProto.EXTERNAL
    for key, value in {"location": "w.data", **fields}.items():
        weight.external_data.add(key=key, value=value)
    (tmp_path / "m.onnx").write_bytes(model.SerializeToString())
    return str(tmp_path / "m.onnx")


@pytest.mark.parametrize("key", ["offset", "length"])
@pytest.mark.parametrize("text", ["9" * 5000, "1" + "0" * MAX_DIGITS, "１２", "-1", "0x10", ""],
                         ids=["5000-digits", "20-digits", "fullwidth", "negative", "hex", "empty"])
def test_an_offset_or_length_that_is_not_a_bounded_whole_number_is_refused(tmp_path, key, text, capsys):
    path = _saved(tmp_path, **{key: text})
    with pytest.raises(InputError) as caught:
        amppass.convert_onnx(path)
    said = str(caught.value)
    assert "tensor 'W'" in said and f"external-data {key}" in said and f"at most {MAX_DIGITS} digits" in said
    assert "re-export" in said and len(said) < 400
    assert main(["convert", path, "-o", str(tmp_path / "out.onnx")]) == 1
    err = capsys.readouterr().err
    assert "amppass: error:" in err and "tensor 'W'" in err and "unexpected" not in err


def test_honest_numbers_with_spaces_read_as_before(tmp_path):
    size = matmul_model().graph.initializer[0].raw_data
    path = _saved(tmp_path, offset=" 0 ", length=f"{len(size)}")
    converted = amppass.convert_onnx(path)
    weight = next(t for t in converted.graph.initializer if t.name.startswith("W"))
    original = np.frombuffer(size, np.float32)
    assert np.allclose(onnx.numpy_helper.to_array(weight).astype(np.float32).ravel(), original, rtol=1e-3, atol=1e-3)
