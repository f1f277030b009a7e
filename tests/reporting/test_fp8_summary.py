"""An fp8 plan's report, the same from both front ends: products lowered to fp8 are rows of precision "fp8" with
their scales in the evidence, every other matrix product says why it is not fp8, and the summary gives the share
of the products' MACs in fp8, the low dtype and fp32 and the products left out counted by why. Records saved
before that shape (torch's products as numbers, ONNX's MACs under "low") still read."""

from __future__ import annotations

import copy
import json
import logging

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper
from torch import nn

import amppass
from amppass.analysis.record import META_KEY, fp8_why_not
from amppass.errors import InputError
from amppass.reporting import stored_record
from amppass.reporting.report import Report, Row
from amppass.reporting.rows import fp8_scales
from amppass.reporting.terminal import render_text
from tests.helpers.onnx_graphs import model_of, vinfo, weight

RNG = np.random.default_rng(0)
RULE = "Report.fp8_rows(): each product's scales, or why it is not fp8"


class Products(nn.Module):
    """A convolution, attention in one SDPA kernel, two products of activations, a linear layer of odd size and one
    of even size: every kind of product a torch fp8 plan meets."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Conv1d(16, 16, 3, padding=1), nn.Linear(16, 10), nn.Linear(16, 32)])

    def forward(self, x):  # x: (batch, 16, length)
        conv, odd, even = self.layers
        h = conv(x).transpose(1, 2)
        attended = nn.functional.scaled_dot_product_attention(h, h, h)
        return odd(h @ h.transpose(1, 2) @ attended), even(attended)


@pytest.fixture(scope="module")
def torch_report():
    logging.disable(logging.WARNING)  # the CPU target's "testing only" warning
    try:
        torch.manual_seed(0)
        converted = amppass.convert(Products().eval(), (torch.randn(2, 16, 8),), dtype="fp8", plan_for="coverage")
    finally:
        logging.disable(logging.NOTSET)
    return amppass.report(converted)


def _three_matmuls() -> onnx.ModelProto:
    """x [8, 64] -> first -> Relu -> second -> Relu -> third -> y [8, 16]; x's feature 0 is an outlier that W1
    ignores (its row is zero), so one per-tensor scale for x leaves the rest to e4m3's subnormals."""
    w1 = RNG.standard_normal((64, 64)).astype(np.float32) / 8
    w1[0] = 0.0
    w2 = (RNG.standard_normal((64, 32)) / 8 * np.logspace(-5, 0, 32)[None, :]).astype(np.float32)  # one scale each
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"], name="first"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "W2"], ["g"], name="second"),
             helper.make_node("Relu", ["g"], ["s"], name="relu_2"),
             helper.make_node("MatMul", ["s", "W3"], ["y"], name="third")]
    return model_of(nodes, [vinfo("x", shape=(8, 64))], [vinfo("y", shape=(8, 16))],
                    [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2"), weight("W3", 32, 16)])


def _outlier_feed() -> dict[str, np.ndarray]:
    x = (RNG.standard_normal((8, 64)) * 0.01).astype(np.float32)
    x[:, 0] = 1000.0
    return {"x": x}


@pytest.fixture(scope="module")
def onnx_converted():
    return amppass.convert_onnx(_three_matmuls(), "fp8", calibration=[_outlier_feed() for _ in range(4)],
                                tolerance=0.1, keep_fp32=["third"])


def test_a_torch_fp8_row_has_precision_fp8_and_its_scales(torch_report):
    rows = {row.name: row for row in torch_report.fp8_rows()}
    lowered = [row for row in rows.values() if row.precision == "fp8"]
    assert [row.op for row in lowered] == ["aten.linear"]
    evidence = lowered[0].evidence["fp8"]
    assert evidence["format"] == "e4m3" and 0 < evidence["weight_scale"] < float("inf")
    assert evidence["input_scale"] == "dynamic"  # no calibration: computed on every call
    assert all(row.precision == "bf16" and row.evidence["fp8"]["why_not"] for row in rows.values()
               if row.precision != "fp8")
    assert torch_report.counts()["fp8"] == 1
    assert [r.name for r in torch_report.select(precision=["fp8"])] == [lowered[0].name]
    assert lowered[0] in torch_report.select(precision=["low"])


def test_the_views_show_an_fp8_rows_scales(torch_report, onnx_converted):
    lowered = next(row for row in torch_report.rows if row.precision == "fp8")
    weight = lowered.evidence["fp8"]["weight_scale"]
    assert fp8_scales(lowered) == f"scales: weight {weight:.3g}, input dynamic"
    assert f"scales: weight {weight:.3g}, input dynamic; fp8: e4m3" in render_text(torch_report, width=400)
    assert f'title="scales: weight {weight:.3g}, input dynamic">fp8</span>' in torch_report.to_html()
    second = next(row for row in amppass.report(onnx_converted).rows if row.name == "second")
    x, w = second.evidence["fp8"]["operands"]
    assert fp8_scales(second) == (f"scales: input {x['scale']:.3g}, weight per channel "
                                  f"{w['weight_scales']['min']:.3g} to {w['weight_scales']['max']:.3g}")
    assert all(fp8_scales(row) == "" for row in torch_report.rows if row.precision != "fp8")
    damaged = Row("n", "MatMul", "fp8", "r", "policy", evidence={"fp8": {"operands": [
        {"weight": True, "scale": "{0}" * 30}, "nothing", {"scale": float("nan")}]}})
    assert fp8_scales(damaged) == "scales: weight " + "{0}" * 13 + "{"  # cut short, never formatted


def test_the_torch_record_counts_products_and_macs_by_precision_and_why_not(torch_report):
    record = torch_report.info["fp8"]
    rows = torch_report.fp8_rows()
    assert record["products"] == {"fp8": 1, "bf16": 5, "fp32": 0}
    assert record["why_not"] == {"no fp8 kernel for the op (convolution, attention)": 2,
                                 "no stored operand to scale at conversion": 2, "sizes not multiples of 16": 1}
    by_precision = {p: sum(r.macs or 0 for r in rows if r.precision == p) for p in ("fp8", "bf16")}
    assert record["macs"] == {**by_precision, "fp32": 0} and record["macs"]["fp8"] == 2 * 8 * 16 * 32


def test_the_torch_summary_gives_mac_shares_and_the_products_not_in_fp8_by_why(torch_report):
    macs = torch_report.info["fp8"]["macs"]
    share = macs["fp8"] / (macs["fp8"] + macs["bf16"])
    lines = torch_report.summary().splitlines()
    assert (f"fp8 (e4m3): 1 of 6 matrix products; MACs: fp8 {share:.1%}, bf16 {1 - share:.1%}, fp32 0.0%; "
            "scales: weights: once at conversion; inputs: dynamic") in "\n".join(lines)
    assert (f"not fp8: 2 no fp8 kernel for the op (convolution, attention); 2 no stored operand to scale at "
            f"conversion; 1 sizes not multiples of 16 ({RULE})") in lines
    assert "heavy compute in bf16 or fp8:" in torch_report.summary()


def test_an_onnx_fp8_row_has_precision_fp8_its_scales_and_the_others_say_why(onnx_converted):
    report = amppass.report(onnx_converted)
    rows = {row.name: row for row in report.rows}
    assert (rows["first"].precision, rows["second"].precision, rows["third"].precision) == ("fp16", "fp8", "fp32")
    scales = [o["scale"] for o in rows["second"].evidence["fp8"]["operands"]]
    assert len(scales) == 2 and all(0 < s < float("inf") for s in scales)
    assert rows["first"].evidence["fp8"]["why_not"].startswith("stays fp16, not e4m3")
    assert rows["third"].evidence["fp8"]["why_not"] == "not e4m3: the fp16 plan keeps this product in fp32"
    assert [r.name for r in report.fp8_rows()] == ["first", "second", "third"]


def test_the_onnx_record_and_summary_have_the_torch_shape(onnx_converted):
    report = amppass.report(onnx_converted)
    record = report.info["fp8"]
    assert record["products"] == {"fp8": 1, "fp16": 1, "fp32": 1}
    assert record["macs"] == {"fp8": 8 * 64 * 32, "fp16": 8 * 64 * 64, "fp32": 8 * 32 * 16}
    assert record["why_not"] == {"output error beyond the tolerance": 1, "kept fp32 by the plan": 1}
    lines = report.summary().splitlines()
    total = 8 * 64 * 32 + 8 * 64 * 64 + 8 * 32 * 16
    assert (f"fp8 (e4m3): 1 of 3 matrix products; MACs at the first calibration batch's shapes: fp8 "
            f"{8 * 64 * 32 / total:.1%}, fp16 {8 * 64 * 64 / total:.1%}, fp32 {8 * 32 * 16 / total:.1%}; scales: "
            "weights: once at conversion, per tensor; activations: static, per tensor, from calibration") in lines
    assert f"not fp8: 1 kept fp32 by the plan; 1 output error beyond the tolerance ({RULE})" in lines
    html = report.to_html()
    assert '<span class="pill" style="background:#9c36b5" title="scales: input ' in html
    assert "heavy compute in fp16 or fp8" in html
    text = render_text(report, width=120, precision=["fp8"])
    assert "1 of" in text and "second" in text and "first" not in text.split("precision fp8")[-1]


def test_an_onnx_record_saved_before_the_shared_shape_reads_the_same(onnx_converted):
    old = copy.deepcopy(onnx_converted)
    for entry in old.metadata_props:  # the record as an earlier amppass wrote it
        if entry.key == META_KEY:
            info = json.loads(entry.value)
            info["fp8"] = {"format": "e4m3", "candidates": 2, "products": 1, "macs": {
                "fp8": 8 * 64 * 32, "low": 8 * 64 * 64, "fp32": 8 * 32 * 16, "fp8_share": 0.5, "low_share": 0.3,
                "fp32_share": 0.2, "counted_at": {"x": [8, 64]}}}
            entry.value = json.dumps(info)
    for node in old.graph.node:  # candidates left out had no "fp8" evidence, products kept fp32 had none at all
        for entry in node.metadata_props:
            decision = json.loads(entry.value)
            if entry.key == META_KEY and "why_not" in decision.get("evidence", {}).get("fp8", {}):
                del decision["evidence"]["fp8"]
                entry.value = json.dumps(decision)
    report, now = amppass.report(old), amppass.report(onnx_converted)
    assert [r.precision for r in report.rows] == [r.precision for r in now.rows]
    lines = report.summary().splitlines()
    total = 8 * 64 * 32 + 8 * 64 * 64 + 8 * 32 * 16  # the products kept fp32 are not counted: no record of them
    assert (f"fp8 (e4m3): 1 of 2 matrix products; MACs at the first calibration batch's shapes: fp8 "
            f"{8 * 64 * 32 / total:.1%}, fp16 {8 * 64 * 64 / total:.1%}, fp32 {8 * 32 * 16 / total:.1%}") in lines
    assert f"not fp8: 1 output error beyond the tolerance ({RULE})" in lines


def test_a_torch_record_saved_before_the_shared_shape_reads_the_same():
    rows = [Row("a", "aten.linear", "fp8", "fp8: e4m3", "policy", evidence={"macs": 300, "fp8": {"format": "e4m3"}}),
            Row("b", "aten.linear", "bf16", "stays bf16: its sizes (in 10, out 3) are not multiples of 16",
                "policy", evidence={"macs": 100, "fp8": {"why_not": "stays bf16: its sizes (in 10, out 3) are not "
                                                                    "multiples of 16"}})]
    info = {"dtype": "bf16", "front_end": "torch", "fp8": {"format": "e4m3", "products": 2, "fp8": 1, "scales": "s",
                                                           "macs": {"fp8": 300, "bf16": 100, "fp32": 0,
                                                                    "fp8_share": 0.75}}}
    lines = Report(rows, info).summary().splitlines()
    assert "fp8 (e4m3): 1 of 2 matrix products; MACs: fp8 75.0%, bf16 25.0%, fp32 0.0%; scales: s" in lines
    assert f"not fp8: 1 sizes not multiples of 16 ({RULE})" in lines


def test_a_stored_fp8_decision_reads_as_an_fp8_row_and_a_damaged_one_is_refused():
    lowered = {"precision": "low", "op": "MatMul", "reason": "r", "source": "tolerance",
               "evidence": {"fp8": {"format": "e4m3", "operands": []}}}
    assert stored_record.row("m", lowered, "fp16").precision == "fp8"
    left = {**lowered, "evidence": {"fp8": {"why_not": "stays fp16, not e4m3: ..."}}}
    assert stored_record.row("m", left, "fp16").precision == "fp16"
    with pytest.raises(InputError, match=r"node 'm'.*field 'evidence.fp8.format' is '8'.*convert the original"):
        stored_record.row("m", {**lowered, "evidence": {"fp8": {"format": 8}}}, "fp16")
    with pytest.raises(InputError, match=r"field 'fp8.why_not\[\"range\"\]'"):
        stored_record.model_info({"dtype": "bf16", "fp8": {"why_not": {"range": -1}}}, "the summary")


@pytest.mark.parametrize("reason, kind", [
    ("not fp8: the bf16 plan keeps this product in fp32", "kept fp32 by the plan"),
    ("not e4m3: the fp16 plan keeps this product in fp32", "kept fp32 by the plan"),
    ("stays fp16, not e4m3: its input v was not observed by calibration, so it has no static scale",
     "an operand calibration did not observe"),
    ("stays bf16: something new: the rest; more", "something new"),
])
def test_a_reason_names_its_kind_and_an_unknown_one_its_first_clause(reason, kind):
    assert fp8_why_not(reason) == kind
