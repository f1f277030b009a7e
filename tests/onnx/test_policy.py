"""amppass.onnx.policy: the ONNX op table (rows by domain, op and opset; training forms), the QDQ sections kept
fp32, schema input names, and a node's classification for a target: category, reason, kept slots, and what blocks
the low dtype (schema, kernel conditions), with its evidence."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from amppass.analysis.plan import Category, Precision, Source
from amppass.onnx.policy import (
    CUSTOM_REASON,
    POLICY,
    QDQ_REASON,
    TRAINING,
    UNKNOWN_REASON,
    classify,
    in_training,
    input_names,
    kernel_attributes,
    lookup,
    quantized_nodes,
)
from amppass.targets import onnx_target

CPU = onnx_target("cpu", "fp16")
CUDA = onnx_target("cuda", "fp16")  # a packaged kernel table: the same answers on every machine
CUDA_BF16 = onnx_target("cuda", "bf16")


def test_every_default_domain_op_of_the_table_is_an_onnx_op():
    """A misspelt op in the table would never match a node."""
    for row in POLICY + TRAINING:
        if row.domain == "":
            for op in row.ops:
                assert onnx.defs.has(op), f"{op} ({row.kind.name}) is not an ONNX op"


@pytest.mark.parametrize("domain, op, opset, category", [
    ("", "MatMul", 17, Category.LOW),
    ("ai.onnx", "MatMul", 17, Category.LOW),  # the default domain by its other name
    ("", "ReduceMean", 18, Category.FP32),
    ("", "Softmax", 13, Category.FOLLOW),
    ("", "Shape", 15, Category.KEEP),
    ("com.microsoft", "Attention", 1, Category.LOW),
    ("com.microsoft", "SkipLayerNormalization", 1, Category.FP32),
])
def test_lookup_finds_the_row_of_an_op(domain, op, opset, category):
    row = lookup(domain, op, opset)
    assert row is not None and op in row.ops and row.category is category


def test_lookup_respects_opset_ranges_and_domains():
    assert lookup("", "Attention", 22) is None and lookup("", "Attention", 23).category is Category.LOW
    assert lookup("", "NoSuchOp", 17) is None
    assert lookup("my.custom", "MatMul", 1) is None  # a custom domain's MatMul is not ONNX's


def test_lookup_picks_the_training_row_only_for_ops_that_have_one():
    assert lookup("", "BatchNormalization", 15).category is Category.FOLLOW
    assert lookup("", "BatchNormalization", 15, training=True).category is Category.FP32
    assert lookup("", "MatMul", 17, training=True) is lookup("", "MatMul", 17)


@pytest.mark.parametrize("node, training", [
    (helper.make_node("BatchNormalization", list("xsbmv"), ["y"], training_mode=1), True),
    (helper.make_node("BatchNormalization", list("xsbmv"), ["y"], training_mode=0), False),
    (helper.make_node("BatchNormalization", list("xsbmv"), ["y", "mean", "var"]), True),  # opsets 7-13
    (helper.make_node("BatchNormalization", list("xsbmv"), ["y", "", ""]), False),
    (helper.make_node("BatchNormalization", list("xsbmv"), ["y"]), False),
    (helper.make_node("Dropout", ["x", "r", "t"], ["y", "mask"], seed=1), False),
    (helper.make_node("BatchNormalization", list("xsbmv"), ["y"], domain="my.custom", training_mode=1), False),
])
def test_in_training(node, training):
    assert in_training(node) is training


def test_input_names_from_the_schema():
    assert input_names("", "MatMul", 13, 2) == ["A", "B"]
    assert input_names("", "Resize", 13, 4) == ["X", "roi", "scales", "sizes"]
    assert input_names("", "Sum", 13, 3) == ["data_0"] * 3  # the variadic last one repeated
    assert input_names("", "Resize", 13, 2) == ["X", "roi"]
    assert input_names("my.custom", "Foo", 1, 2) == ["", ""]


def test_classify_a_heavy_op_low_with_the_targets_words():
    found = classify("", "MatMul", 17, 2, CUDA)
    assert found.category is Category.LOW and not found.unknown and not found.low_blocked
    assert found.reason == "matrix multiply: Tensor Core work, accumulates in fp32 inside the kernel"
    assert "CPU's fp16 matrix instructions" in classify("", "MatMul", 17, 2, CPU).reason
    assert found.kept_slots == frozenset() and dict(found.evidence) == {}


def test_classify_keeps_the_slots_the_row_names():
    found = classify("", "Resize", 17, 4, CUDA)
    assert found.category is Category.FP32 and found.kept_slots == frozenset({1, 2, 3})  # roi, scales, sizes
    assert classify("", "Reshape", 17, 2, CUDA).kept_slots == frozenset({1})  # the shape
    assert classify("", "Dropout", 13, 3, CUDA).kept_slots == frozenset({1, 2})  # ratio, training_mode


def test_classify_an_op_the_table_does_not_know():
    found = classify("", "Det", 17, 1, CUDA)
    assert (found.category, found.reason, found.unknown) == (Category.FOLLOW, UNKNOWN_REASON, True)


def test_classify_a_custom_op_fp32_naming_the_fix():
    found = classify("my.custom", "Foo", 1, 1, CUDA)
    assert found.category is Category.FP32 and found.unknown
    assert found.reason == CUSTOM_REASON.format(op="Foo", domain="my.custom")
    assert "force_low=['Foo']" in found.reason and dict(found.evidence) == {"custom_op": True}


def test_classify_blocks_what_the_schema_does_not_allow():
    found = classify("", "MatMul", 9, 2, CUDA_BF16)  # MatMul takes bf16 from opset 13
    reason = "the ONNX schema of MatMul (opset 9) does not allow bf16 inputs; kept fp32"
    assert (found.category, found.reason, found.low_blocked) == (Category.FP32, reason, reason)
    assert dict(found.evidence) == {"no_low_kernel": True}
    assert classify("", "MatMul", 13, 2, CUDA_BF16).category is Category.LOW


def test_classify_blocks_a_kernel_the_target_refuses_for_an_attribute():
    refused = helper.make_node("ScatterND", ["data", "indices", "updates"], ["out"], reduction="add")
    plain = helper.make_node("ScatterND", ["data", "indices", "updates"], ["out"])
    assert kernel_attributes(refused, CPU) == (("reduction", "add"),) and kernel_attributes(plain, CPU) == ()
    assert kernel_attributes(refused, CUDA) == ()  # a target without that condition reads no attribute
    found = classify("", "ScatterND", 18, 3, CPU, False, kernel_attributes(refused, CPU))
    assert found.category is Category.FP32 and found.evidence["no_low_kernel"] is True
    assert found.reason.startswith("onnxruntime CPUExecutionProvider has no fp16 kernel for ScatterND with "
                                   "reduction='add'") and found.reason.endswith("; kept fp32")
    assert found.kept_slots == frozenset({1})  # the indices


def test_classify_picks_the_training_row():
    found = classify("", "BatchNormalization", 15, 5, CUDA, True)
    assert found.category is Category.FP32 and "training mode" in found.reason
    assert found.facts == frozenset({"normalisation"})


def test_classify_is_cached_and_its_evidence_read_only():
    first = classify("my.custom", "Foo", 1, 1, CUDA)
    assert classify("my.custom", "Foo", 1, 1, CUDA) is first
    with pytest.raises(TypeError):
        first.evidence["custom_op"] = False  # type: ignore[index]


def _qdq(extra_reader: bool = False, output_float: bool = False) -> onnx.GraphProto:
    """x -> Q -> DQ -> Relu -> Q -> DQ -> y (with ``extra_reader``, Relu also feeds a Sigmoid)."""
    scale = numpy_helper.from_array(np.array(0.1, np.float32), "scale")
    zero = numpy_helper.from_array(np.array(0, np.uint8), "zero")
    nodes = [helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["xq"], name="q0"),
             helper.make_node("DequantizeLinear", ["xq", "scale", "zero"], ["xd"], name="dq0"),
             helper.make_node("Relu", ["xd"], ["r"], name="relu"),
             helper.make_node("QuantizeLinear", ["r", "scale", "zero"], ["rq"], name="q1"),
             helper.make_node("DequantizeLinear", ["rq", "scale", "zero"], ["y"], name="dq1")]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])]
    if extra_reader:
        nodes.append(helper.make_node("Sigmoid", ["r"], ["s"], name="sig"))
        outputs.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, [4]))
    if output_float:
        outputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [4]))
    return helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])], outputs,
                             [scale, zero])


def test_a_node_between_dequantize_and_quantize_is_kept_fp32():
    found = quantized_nodes(_qdq())
    assert list(found) == ["relu"]
    decision = found["relu"]
    assert (decision.precision, decision.reason, decision.source, decision.rule) == (
        Precision.FP32, QDQ_REASON, Source.POLICY, "qdq")
    assert decision.evidence == {"qdq": True}


@pytest.mark.parametrize("graph", [_qdq(extra_reader=True), _qdq(output_float=True)], ids=["float-reader", "output"])
def test_a_node_whose_result_leaves_the_quantized_section_is_not(graph):
    assert quantized_nodes(graph) == {}


def test_a_graph_without_dequantize_has_no_quantized_nodes():
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    assert quantized_nodes(graph) == {}
