"""convert_onnx on hand-built graphs: structure, numerics against fp32, validity, and the ONNX traps."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import amppass
from amppass.analysis.plan import Category
from amppass.onnx import policy
from amppass.onnx.io.save import save
from amppass.targets import onnx_target, onnxruntime_facts
from tests.helpers.onnx_graphs import check_converted, heavy_low_share, meta, model_of, session, vinfo, weight

F32, F16, BF16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16
RNG = np.random.default_rng(0)


def x_feed(shape=(2, 8)) -> dict:
    return {"x": RNG.standard_normal(shape).astype(np.float32)}


# -- hand-built graphs -------------------------------------------------------------------------------
def test_shared_initializer_gets_one_low_copy_beside_fp32():
    model = model_of(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),  # low reader of W
         helper.make_node("Add", ["z", "W"], ["a"], name="add_fp32"),  # fp32 reader: z is a graph input
         helper.make_node("MatMul", ["h", "a"], ["y"], name="mm2")],
        [vinfo("x"), vinfo("z", shape=(8, 8))], [vinfo("y")], [weight("W", 8, 8)],
    )
    converted = amppass.convert_onnx(model)
    check_converted(model, converted, {**x_feed(), "z": RNG.standard_normal((8, 8)).astype(np.float32)})
    inits = {i.name: i.data_type for i in converted.graph.initializer}
    assert inits == {"W": F32, "W__fp16": F16}
    nodes = {n.name: n for n in converted.graph.node}
    assert nodes["mm"].input[1] == "W__fp16" and nodes["add_fp32"].input[1] == "W"
    assert amppass.report(converted).info["weight_copies"] == 1


def test_resize_runs_fp32_and_keeps_roi_scales_untouched():
    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    roi = numpy_helper.from_array(np.zeros(0, np.float32), "roi")
    model = model_of(
        [helper.make_node("Conv", ["x", "Wc"], ["c"], name="conv", pads=[1, 1, 1, 1]),
         helper.make_node("Resize", ["c", "roi", "scales"], ["r"], name="resize", mode="linear"),
         helper.make_node("Conv", ["r", "Wc2"], ["y"], name="conv2", pads=[1, 1, 1, 1])],
        [vinfo("x", shape=(1, 3, 8, 8))], [vinfo("y", shape=(1, 4, 16, 16))],
        [weight("Wc", 4, 3, 3, 3), weight("Wc2", 4, 4, 3, 3), scales, roi],
    )
    converted = amppass.convert_onnx(model)
    check_converted(model, converted, x_feed((1, 3, 8, 8)))
    resize = next(n for n in converted.graph.node if n.op_type == "Resize")
    assert list(resize.input[1:]) == ["roi", "scales"]
    assert meta(resize)["precision"] == "fp32" and "resampling" in meta(resize)["reason"]
    inits = {i.name: i.data_type for i in converted.graph.initializer}
    assert inits["scales"] == F32 and inits["roi"] == F32


def test_existing_casts_retargeted_and_fp16_round_trip_kept():
    model = model_of(
        [helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"),
         helper.make_node("Cast", ["h"], ["hc"], name="cast_f32", to=F32),  # between two low ops
         helper.make_node("MatMul", ["hc", "W2"], ["h2"], name="mm2"),
         helper.make_node("Cast", ["h2"], ["h16"], name="to_half", to=F16),  # the model's own rounding
         helper.make_node("Cast", ["h16"], ["y"], name="back", to=F32)],
        [vinfo("x")], [vinfo("y")], [weight("W1", 8, 8), weight("W2", 8, 8)],
    )
    converted = amppass.convert_onnx(model)
    check_converted(model, converted, x_feed())
    nodes = {n.name: n for n in converted.graph.node}
    assert helper.get_attribute_value(nodes["cast_f32"].attribute[0]) == F16
    assert meta(nodes["cast_f32"])["precision"] == "low"
    assert helper.get_attribute_value(nodes["to_half"].attribute[0]) == F16
    assert helper.get_attribute_value(nodes["back"].attribute[0]) == F32, "fp32->fp16->fp32 is never removed"


def test_unnamed_nodes_get_unique_names():
    model = model_of(
        [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "W2"], ["h2"]), helper.make_node("Softmax", ["h2"], ["y"])],
        [vinfo("x")], [vinfo("y")], [weight("W1", 8, 8), weight("W2", 8, 8)],
    )
    converted = amppass.convert_onnx(model)
    check_converted(model, converted, x_feed())
    names = [n.name for n in converted.graph.node]
    assert all(names) and len(set(names)) == len(names)
    assert all(n.name == "" for n in model.graph.node), "the caller's model is untouched"
    rows = amppass.report(converted).rows
    assert {r.op for r in rows} == {"MatMul", "Relu", "Softmax"} and all(r.reason for r in rows)


def test_graph_output_consumed_inside_stays_fp32_without_extra_cast():
    model = model_of(
        [helper.make_node("MatMul", ["x", "W1"], ["y1"], name="mm1"),
         helper.make_node("MatMul", ["y1", "W2"], ["y2"], name="mm2")],
        [vinfo("x")], [vinfo("y1"), vinfo("y2")], [weight("W1", 8, 8), weight("W2", 8, 8)],
    )
    converted = amppass.convert_onnx(model)
    check_converted(model, converted, x_feed())
    nodes = {n.name: n for n in converted.graph.node}
    assert nodes["mm2"].input[0] == nodes["mm1"].output[0] != "y1", "reads the low value, not a re-cast"
    assert [o.type.tensor_type.elem_type for o in converted.graph.output] == [F32, F32]
    free = amppass.convert_onnx(model, keep_io_types=False)
    onnx.checker.check_model(free, full_check=True)
    assert [o.type.tensor_type.elem_type for o in free.graph.output] == [F16, F16]
    assert session(free).run(None, x_feed())[1].dtype == np.float16


def _if_model() -> onnx.ModelProto:
    then_g = helper.make_graph(
        [helper.make_node("MatMul", ["h", "Wt"], ["t1"], name="then_mm"),
         helper.make_node("Relu", ["t1"], ["t_out"], name="then_relu")],
        "then", [], [vinfo("t_out")], [weight("Wt", 8, 8)])
    else_g = helper.make_graph(
        [helper.make_node("MatMul", ["h", "W_outer"], ["e1"], name="else_mm"),  # outer-scope weight
         helper.make_node("Add", ["e1", "x"], ["e_out"], name="else_add")],  # outer-scope graph input
        "else", [], [vinfo("e_out")])
    return model_of(
        [helper.make_node("MatMul", ["x", "W0"], ["h"], name="mm0"),
         helper.make_node("If", ["cond"], ["b"], name="branch", then_branch=then_g, else_branch=else_g),
         helper.make_node("MatMul", ["b", "W_outer"], ["y"], name="mm_out")],
        [vinfo("x"), vinfo("cond", TensorProto.BOOL, ())], [vinfo("y")],
        [weight("W0", 8, 8), weight("W_outer", 8, 8)],
    )


@pytest.mark.parametrize("cond", [True, False])
def test_if_branches_converted_with_outer_captures(cond):
    model = _if_model()
    converted = amppass.convert_onnx(model)
    feeds = {**x_feed(), "cond": np.array(cond)}
    check_converted(model, converted, feeds)
    assert heavy_low_share(converted) == (4, 4)
    branch = next(n for n in converted.graph.node if n.op_type == "If")
    else_g = next(a.g for a in branch.attribute if a.name == "else_branch")
    else_mm = next(n for n in else_g.node if n.name == "else_mm")
    assert else_mm.input[1] == "W_outer", "the shared outer weight is converted once, in the outer graph"
    assert {o.type.tensor_type.elem_type for a in branch.attribute for o in a.g.output} == {F32}


def test_loop_body_keeps_carried_state_type():
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"], name="keep_going"),
         helper.make_node("MatMul", ["s_in", "W"], ["m"], name="body_mm"),  # W: outer-scope capture
         helper.make_node("Tanh", ["m"], ["s_out"], name="body_tanh"),
         helper.make_node("Softmax", ["m"], ["scan_out"], name="body_softmax")],
        "body", [vinfo("i", TensorProto.INT64, ()), vinfo("cond_in", TensorProto.BOOL, ()), vinfo("s_in")],
        [vinfo("cond_out", TensorProto.BOOL, ()), vinfo("s_out"), vinfo("scan_out")],
    )
    trip = numpy_helper.from_array(np.array(3, np.int64), "trip")
    keep = numpy_helper.from_array(np.array(True), "keep")
    model = model_of(
        [helper.make_node("MatMul", ["x", "W"], ["s0"], name="pre_mm"),
         helper.make_node("Loop", ["trip", "keep", "s0"], ["s_final", "scans"], name="loop", body=body),
         helper.make_node("MatMul", ["s_final", "W"], ["y"], name="post_mm")],
        [vinfo("x")], [vinfo("y"), vinfo("scans", shape=(3, 2, 8))], [weight("W", 8, 8, scale=0.4), trip, keep],
    )
    converted = amppass.convert_onnx(model)
    check_converted(model, converted, x_feed())
    loop = next(n for n in converted.graph.node if n.op_type == "Loop")
    body_out = loop.attribute[0].g
    assert body_out.input[2].type.tensor_type.elem_type == F32
    assert body_out.output[1].type.tensor_type.elem_type == F32, "loop-carried state keeps fp32 across iterations"
    assert heavy_low_share(converted) == (3, 3)


def test_scan_body_converted():
    body = helper.make_graph(
        [helper.make_node("MatMul", ["x_t", "W"], ["m"], name="scan_mm"),
         helper.make_node("Add", ["acc_in", "m"], ["acc_out"], name="scan_acc"),
         helper.make_node("Identity", ["m"], ["y_t"], name="scan_emit")],
        "scan_body", [vinfo("acc_in", shape=(8,)), vinfo("x_t", shape=(8,))],
        [vinfo("acc_out", shape=(8,)), vinfo("y_t", shape=(8,))],
    )
    model = model_of(
        [helper.make_node("Scan", ["acc0", "x"], ["acc", "ys"], name="scan", body=body, num_scan_inputs=1)],
        [vinfo("acc0", shape=(8,)), vinfo("x", shape=(4, 8))], [vinfo("acc", shape=(8,)), vinfo("ys", shape=(4, 8))],
        [weight("W", 8, 8)],
    )
    converted = amppass.convert_onnx(model)
    feeds = {"acc0": np.zeros(8, np.float32), "x": RNG.standard_normal((4, 8)).astype(np.float32)}
    check_converted(model, converted, feeds)
    assert heavy_low_share(converted) == (1, 1)


def test_bf16_keeps_ops_without_a_cpu_kernel_fp32():
    model = model_of(
        [helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm"),
         helper.make_node("Transpose", ["h"], ["y"], name="t", perm=[1, 0])],
        [vinfo("x")], [vinfo("y", shape=(8, 2))], [weight("W1", 8, 8)],
    )
    found = policy.classify("", "MatMul", 17, 2, onnx_target("cpu", "bf16"))
    assert found.category is Category.FP32 and "kernel" in found.reason
    # with no heavy op left to run bf16, the conversion is refused (it would write an all-fp32 model); ops without
    # a heavy op beside them keep the per-node check: tests/guarantees/test_fuzz_regressions.py (a forced bf16
    # Softmax stays fp32 and runs)
    with pytest.raises(amppass.InputError, match="dtype='bf16' with target='cpu'.*no bf16 kernel for MatMul"):
        amppass.convert_onnx(model, "bf16")


def test_policy_table_checked_against_schema_and_runtime():
    assert policy.classify("", "MatMul", 17, 2, onnx_target("cpu", "fp16")).category is Category.LOW
    assert policy.classify("", "LogSoftmax", 17, 1, onnx_target("cpu", "fp16")).category is Category.FP32
    assert policy.classify("", "Softmax", 17, 1, onnx_target("cpu", "fp16")).category is Category.FOLLOW
    resize = policy.classify("", "Resize", 19, 4, onnx_target("cpu", "fp16"))
    assert resize.kept_slots == frozenset({1, 2, 3})
    unknown = policy.classify("my.domain", "Frobnicate", 1, 1, onnx_target("cpu", "fp16"))
    assert unknown.unknown and unknown.category is Category.FP32 and "custom op" in unknown.reason
    for row in policy.POLICY:
        assert row.reason and row.ops
    assert 10 <= onnxruntime_facts.max_ir_version() < onnx.IR_VERSION + 1 and onnxruntime_facts.max_opset() >= 17


def test_force_low_clamps_out_of_range_weight_with_report_entry():
    big = numpy_helper.from_array(np.full((8, 8), 1e5, np.float32), "Wbig")
    model = model_of([helper.make_node("MatMul", ["x", "Wbig"], ["y"], name="mm")], [vinfo("x")], [vinfo("y")],
                     [big])
    plain = amppass.convert_onnx(model)
    assert meta(plain.graph.node[0])["precision"] == "fp32", "range rule keeps it fp32"
    assert "Wbig" in meta(plain.graph.node[0])["reason"]
    forced = amppass.convert_onnx(model, force_low=["mm"])
    assert amppass.report(forced).info["clamped"] == {"Wbig": 64}


def test_keep_fp32_override_and_user_errors(tmp_path):
    model = _if_model()
    kept = amppass.convert_onnx(model, keep_fp32=["then_mm"])
    assert amppass.report(kept).rows and heavy_low_share(kept) == (3, 4)
    with pytest.raises(amppass.InputError, match="dtype"):
        amppass.convert_onnx(model, "int8")
    with pytest.raises(amppass.InputError, match="not a file"):
        amppass.convert_onnx(tmp_path / "missing.onnx")
    with pytest.raises(amppass.InputError, match="keep_fp32"):
        amppass.convert_onnx(model, keep_fp32=["NoSuchOp"])
    with pytest.raises(amppass.InputError, match="no amppass decisions"):
        amppass.report(model)
    again = amppass.convert_onnx(kept)
    assert again.SerializeToString() == kept.SerializeToString(), "tests/guarantees/test_idempotence.py"


def test_path_round_trip_with_external_data(tmp_path):
    model = _if_model()
    source = tmp_path / "in.onnx"
    on_disk = onnx.ModelProto.FromString(model.SerializeToString())  # save_model moves the bytes out of it
    onnx.save_model(on_disk, source, save_as_external_data=True, location="in.onnx.data", size_threshold=0)
    converted = amppass.convert_onnx(source)
    target = tmp_path / "out.onnx"
    save(converted, target, external_data=True)
    assert len(list(tmp_path.glob("out.onnx.*.data"))) == 1 and not list(tmp_path.glob(".amppass-*"))
    feeds = {**x_feed(), "cond": np.array(True)}
    want = session(model).run(None, feeds)[0]
    got = session(str(target)).run(None, feeds)[0]
    assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)
    assert amppass.report(str(target)).info["front_end"] == "onnx"


def test_policy_facts_reach_the_report():
    """What the policy learned from onnxruntime's kernel registry is evidence on the node's row."""
    f = TensorProto.FLOAT
    w = numpy_helper.from_array(np.ones((8, 8), np.float32), "w")
    model = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("x", f, [2, 8])], [helper.make_tensor_value_info("y", f, [2, 8])], [w]),
        opset_imports=[helper.make_opsetid("", 17)])
    softmax = helper.make_model(helper.make_graph(
        [helper.make_node("Softmax", ["x"], ["y"], name="sm")], "g",
        [helper.make_tensor_value_info("x", f, [2, 8])], [helper.make_tensor_value_info("y", f, [2, 8])]),
        opset_imports=[helper.make_opsetid("", 17)])
    bf16 = {row.name: row for row in amppass.report(amppass.convert_onnx(softmax, "bf16")).rows}["sm"]
    assert bf16.precision == "fp32" and bf16.evidence["no_low_kernel"] and "no bf16 kernel" in bf16.reason
    fp16 = {row.name: row for row in amppass.report(amppass.convert_onnx(model, "fp16")).rows}["mm"]
    assert fp16.precision == "fp16" and "casts around it" in fp16.evidence["onnxruntime_cpu"]
