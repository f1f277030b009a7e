"""The weight store: skeleton copies without payloads, conversions through torch, external files mapped."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from amppass.dtypes import BF16, FP16
from amppass.errors import InputError
from amppass.onnx.io.weight_store import LIFT_BYTES, WeightStore, tensors

RNG = np.random.default_rng(3)


def _model(big: np.ndarray, small: np.ndarray) -> onnx.ModelProto:
    """Y = X @ W (W big) + b (b small), with W also a Constant inside an If branch."""
    branch = helper.make_graph(
        [helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(big, "cval"))], "then", [],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, list(big.shape))])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["h"]), helper.make_node("Add", ["h", "b"], ["Y"]),
         helper.make_node("If", ["cond"], ["Z"], then_branch=branch, else_branch=branch)],
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, big.shape[0]]),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, big.shape[1]]),
         helper.make_tensor_value_info("Z", TensorProto.FLOAT, list(big.shape))],
        [numpy_helper.from_array(big, "W"), numpy_helper.from_array(small, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_skeleton_leaves_the_source_alone_and_materialize_restores_every_byte():
    big = RNG.standard_normal((64, 32)).astype(np.float32)
    model = _model(big, np.ones(32, np.float32))
    before = model.SerializeToString()
    store = WeightStore()
    work = store.skeleton(model)
    assert model.SerializeToString() == before
    lifted = [t for t in tensors(work.graph) if t.data_location == TensorProto.EXTERNAL]
    assert len(lifted) == 3 and not any(t.raw_data for t in lifted)  # W and both branch constants
    assert all(len(t.raw_data) <= LIFT_BYTES for t in tensors(work.graph) if t not in lifted)
    np.testing.assert_array_equal(store.array(work.graph.initializer[0]), big)
    store.materialize(work)
    assert work.SerializeToString() == before


def test_lower_rounds_like_numpy_and_torch_and_clamps_with_a_count():
    values = RNG.standard_normal(600).astype(np.float32) * 100
    values[:3] = [7e4, -1e5, np.inf]
    values[3] = np.nan
    source = numpy_helper.from_array(values, "w")
    store = WeightStore()
    work = store.skeleton(helper.make_model(helper.make_graph([], "g", [], [], [source])))
    tensor = work.graph.initializer[0]
    assert store.absmax(tensor) == pytest.approx(1e5)  # largest finite magnitude

    half = onnx.TensorProto(name="w_fp16")
    assert store.lower(tensor, FP16, half) == 2  # 7e4 and -1e5; inf and NaN are kept
    got = store.array(half).view(np.float16)
    want = np.clip(values, -65504, 65504).astype(np.float16)
    want[2] = np.inf
    np.testing.assert_array_equal(got[4:], want[4:])
    assert list(got[:3]) == [65504, -65504, np.inf] and np.isnan(got[3])
    assert half.name == "w_fp16" and half.data_type == TensorProto.FLOAT16

    brain = onnx.TensorProto()
    store.lower(tensor, BF16, brain)
    bits = values.view(np.uint32)
    rne = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest, ties to even
    np.testing.assert_array_equal(store.array(brain)[4:], rne[4:])
    assert brain.name == "w"

    again = onnx.TensorProto(name="w_again")
    store.lower(tensor, FP16, again)  # the same entry converted twice: one payload
    assert again.external_data[1].value == half.external_data[1].value


def test_external_data_is_mapped_from_the_source_folder(tmp_path):
    big = RNG.standard_normal((64, 64)).astype(np.float32)
    model = _model(big, np.ones(64, np.float32))
    onnx.save_model(model, tmp_path / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0)
    on_disk = onnx.load(tmp_path / "m.onnx", load_external_data=False)
    store = WeightStore(str(tmp_path))
    work = store.skeleton(on_disk)
    weight = work.graph.initializer[0]
    assert _mapped(store.array(weight))  # a view of the memory-mapped file, not a copy
    assert store.absmax(weight) == pytest.approx(float(np.abs(big).max()))
    store.materialize(work)
    np.testing.assert_array_equal(numpy_helper.to_array(work.graph.initializer[0]), big)

    (tmp_path / "m.data").unlink()
    with pytest.raises(InputError, match="'W'.*m.data.*missing"):
        WeightStore(str(tmp_path)).array(on_disk.graph.initializer[0])
    with pytest.raises(InputError, match="pass the .onnx path"):
        WeightStore().array(on_disk.graph.initializer[0])


def _mapped(array: np.ndarray) -> bool:
    """Whether ``array`` views a memory map (through any chain of views)."""
    import mmap

    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, (mmap.mmap, memoryview)) and not array.flags.owndata
