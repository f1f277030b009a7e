"""``amppass.save`` of an ONNX model (amppass.pipelines.save): the streamed, atomic ONNX save behind the public name,
and the refusals where a model and the format its path names disagree."""

from __future__ import annotations

import os
import re

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import amppass


@pytest.fixture(scope="module")
def converted() -> onnx.ModelProto:
    """An fp16 conversion of a MatMul + Softmax model whose weight (16 KiB) the save streams as a payload."""
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"), helper.make_node("Softmax", ["y"], ["z"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 64])], [weight])
    return amppass.convert_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))


def test_an_onnx_model_round_trips_through_amppass_save(converted, tmp_path):
    path = tmp_path / "m.fp16.onnx"
    amppass.save(converted, path)
    loaded = onnx.load(str(path))
    onnx.checker.check_model(loaded, full_check=True)
    assert loaded == converted
    assert os.listdir(tmp_path) == ["m.fp16.onnx"]  # weights inside, no temporary left
    assert amppass.report(str(path)).rows == amppass.report(converted).rows


def test_external_data_puts_the_weights_beside_the_model(converted, tmp_path):
    path = tmp_path / "m.onnx"
    amppass.save(converted, str(path), external_data=True)
    data = [name for name in os.listdir(tmp_path) if name != "m.onnx"]
    assert len(data) == 1 and re.fullmatch(r"m\.onnx\.[0-9a-f]{8}\.data", data[0])
    onnx.checker.check_model(str(path), full_check=True)
    loaded = onnx.load(str(path))
    assert [numpy_helper.to_array(t).tobytes() for t in loaded.graph.initializer] == \
        [numpy_helper.to_array(t).tobytes() for t in converted.graph.initializer]
    amppass.save(converted, path, False)  # positional, as amppass.onnx.convert.save took it: inline again
    assert os.listdir(tmp_path) == ["m.onnx"]  # the data file the replaced model named is removed
    assert onnx.load(str(path)) == converted


def test_an_onnx_model_is_not_saved_as_a_pt2_file(converted, tmp_path):
    with pytest.raises(amppass.InputError, match=r"model is an onnx\.ModelProto.*names a torch\.export program.*"
                                                 r"name the file \.onnx"):
        amppass.save(converted, tmp_path / "m.PT2")
    assert not os.listdir(tmp_path)


def test_a_torch_model_is_not_saved_as_an_onnx_file(tmp_path):
    with pytest.raises(amppass.InputError, match=r"model is a Linear, not an onnx\.ModelProto.*names an ONNX "
                                                 r"model.*name the file \.pt2, or write an ONNX model with "
                                                 r"amppass\.export_onnx"):
        amppass.save(torch.nn.Linear(2, 2), tmp_path / "m.onnx")
    with pytest.raises(amppass.InputError, match=r"external_data is for ONNX models.*leave external_data out"):
        amppass.save(torch.nn.Linear(2, 2), tmp_path / "m.pt2", external_data=True)
    assert not os.listdir(tmp_path)
