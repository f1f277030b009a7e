"""Reading an .onnx file without its weights (amppass.onnx.io.lazy_read): the same model, with large tensors as
references into the file, and nothing but AmpPassError for damaged files."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import amppass
from amppass import InputError
from amppass.onnx.io import lazy_read
from amppass.onnx.io.weight_store import WeightStore
from amppass.onnx.view import tensors

F32 = TensorProto.FLOAT


def model() -> onnx.ModelProto:
    """A large initializer, a large Constant, a large If-body initializer and a small initializer."""
    big = numpy_helper.from_array(np.arange(64 * 64, dtype=np.float32).reshape(64, 64) / 4096, "W")
    constant = helper.make_node("Constant", [], ["C"], name="c",
                                value=numpy_helper.from_array(np.full((64, 64), 0.5, np.float32), "cv"))
    body = helper.make_graph([helper.make_node("MatMul", ["h", "B"], ["yb"], name="mb")], "then", [],
                             [helper.make_tensor_value_info("yb", F32, [64, 64])],
                             [numpy_helper.from_array(np.full((64, 64), 0.25, np.float32), "B")])
    other = helper.make_graph([helper.make_node("Identity", ["h"], ["ye"], name="ie")], "else", [],
                              [helper.make_tensor_value_info("ye", F32, [64, 64])])
    nodes = [constant, helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
             helper.make_node("Add", ["m", "C"], ["a"], name="add"),
             helper.make_node("Add", ["a", "S"], ["h"], name="add_s"),
             helper.make_node("If", ["cond"], ["y"], name="if", then_branch=body, else_branch=other)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, [64, 64]),
                                           helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", F32, [64, 64])],
                              [big, numpy_helper.from_array(np.ones(64, np.float32), "S")])
    built = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    built.ir_version = 10
    return built


def test_large_tensors_become_references_into_the_file_and_read_back_equal(tmp_path):
    original = model()
    path = tmp_path / "m.onnx"
    path.write_bytes(original.SerializeToString())
    read = lazy_read.load(str(path))
    by_name = {t.name: t for t in tensors(read.graph)}
    assert {n for n, t in by_name.items() if t.data_location == TensorProto.EXTERNAL} == {"W", "cv", "B"}
    assert by_name["S"].raw_data and not by_name["W"].raw_data  # small tensors stay inline
    assert [(e.key, e.value) for e in by_name["W"].external_data][0] == ("location", "m.onnx")
    store = WeightStore(str(tmp_path), "m.onnx")
    for tensor in tensors(original.graph):
        np.testing.assert_array_equal(store.array(by_name[tensor.name]), numpy_helper.to_array(tensor))
    stripped = onnx.ModelProto()
    stripped.CopyFrom(read)
    for tensor in tensors(stripped.graph):
        tensor.Clear()
    again = onnx.ModelProto()
    again.CopyFrom(original)
    for tensor in tensors(again.graph):
        tensor.Clear()
    assert stripped == again  # everything but the tensors parses as onnx.load parses it


def test_a_converted_file_matches_the_conversion_of_the_loaded_proto(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(model().SerializeToString())
    from_path, from_proto = amppass.convert_onnx(str(path)), amppass.convert_onnx(model())
    assert from_path.graph == from_proto.graph


@pytest.mark.parametrize("cut", [3, 100, 9000, -5])
def test_truncated_files_are_input_errors(tmp_path, cut):
    data = model().SerializeToString()
    path = tmp_path / "m.onnx"
    path.write_bytes(data[:cut])
    with pytest.raises(InputError, match="m.onnx"):
        amppass.convert_onnx(str(path))


@pytest.mark.parametrize("cut", [9000, 20000])
def test_a_truncated_file_names_the_damage_not_a_closing_mmap(tmp_path, cut):
    """A file cut inside a walked message said "cannot close exported pointers exist": the BufferError of
    the mmap closing while the walk's memory views were alive replaced the real cause."""
    path = tmp_path / "m.onnx"
    path.write_bytes(model().SerializeToString()[:cut])
    for read in (amppass.convert_onnx, amppass.report):
        with pytest.raises(InputError) as caught:
            read(str(path))
        message = str(caught.value)
        assert "m.onnx" in message and "runs past the end of its message" in message, message
        assert "cut short or damaged" in message and "exported pointers" not in message
    with pytest.raises(InputError, match="runs past the end"):
        lazy_read.load(str(path))


def test_the_reader_counts_nodes_and_initializers_against_the_cap_exactly(tmp_path, monkeypatch):
    """Nodes of bodies and local functions count; a model holding as many as the cap is read, one more is
    refused while the file is read (lazy_read.load itself), naming the count and how to raise the cap."""
    from amppass.onnx.io import validate

    with_function = model()
    body = [helper.make_node("Add", ["a", "a"], ["t"]), helper.make_node("Relu", ["t"], ["b"])]
    with_function.functions.append(helper.make_function("local", "Twice", ["a"], ["b"], body,
                                                        [helper.make_opsetid("", 17)]))
    many_weights = model()
    many_weights.graph.initializer.extend(numpy_helper.from_array(np.ones(2, np.float32), f"u{i}") for i in range(20))
    for built, what in ((with_function, "nodes"), (many_weights, "initializers")):
        nodes, initializers, exact = validate.count(built)
        assert exact and (nodes, initializers) == ((9, 3) if what == "nodes" else (7, 23))
        path = tmp_path / f"{what}.onnx"
        path.write_bytes(built.SerializeToString())
        monkeypatch.setenv("AMPPASS_MAX_NODES", str(max(nodes, initializers)))
        lazy_read.load(str(path))
        monkeypatch.setenv("AMPPASS_MAX_NODES", str(max(nodes, initializers) - 1))
        with pytest.raises(InputError, match=f"holds at least {max(nodes, initializers)} {what}.*AMPPASS_MAX_NODES"):
            lazy_read.load(str(path))
