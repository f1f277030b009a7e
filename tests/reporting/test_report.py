"""The report: summary numbers, MAC counts, JSON schema, HTML page, terminal view."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser

import numpy as np
import pytest
import torch
from torch import nn

import amppass
from amppass.fx.view.macs import node_macs
from amppass.reporting.report import Report, Row, load_schema, write_atomic
from amppass.reporting.rows import decision_order
from amppass.reporting.terminal import render_text
from models import build

jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def cnn_report() -> Report:
    case = build("cnn", "small")
    return amppass.report(amppass.convert(case.model, case.example_inputs, dtype="fp16", plan_for="coverage"))


@pytest.fixture()
def calibrated_report() -> Report:
    """A report as a calibrated conversion with a tolerance search would store it."""
    rows = [
        Row("conv", "Conv", "fp16", "convolution: Tensor Core work", "policy", ["x_to_fp16"],
            {"macs": 3000, "absmax": 12.5, "min_nonzero": 1e-3}),
        Row("exp", "Exp", "fp32", "exp overflows fp16", "policy", [], {"absmax": 2.0e5, "min_nonzero": 1e-7}),
        Row("big", "MatMul", "fp32", "moved back to fp32: output error", "tolerance", [],
            {"macs": 1000, "absmax": 70000.0, "local_error": 3.2e-3}),
        Row("shape", "Shape", "-", "no float work", "policy"),
    ]
    info = {"front_end": "onnx", "dtype": "fp16", "casts": 3, "calibrated": True, "moved_by_tolerance": ["big"],
            "weight_bytes_before": 400, "weight_bytes_after": 220, "tolerance": 1e-3, "achieved_error": 4e-4,
            "tolerance_met": True}
    return Report(rows, info)


# -- summary and MACs ---------------------------------------------------------------------------------

def test_conv_and_linear_macs_come_from_the_example_shapes(cnn_report):
    macs = {row.name: row.macs for row in cnn_report.rows if row.macs is not None}
    # input 2x3x32x32; conv 3->16 3x3 same padding; pool /2; conv 16->32 3x3; linear 32->10
    assert macs == {"conv2d": 2 * 16 * 32 * 32 * 3 * 9, "conv2d_1": 2 * 32 * 16 * 16 * 16 * 9, "linear": 2 * 10 * 32}
    stats = cnn_report.stats()
    assert stats["macs"] == {"total": sum(macs.values()), "low": sum(macs.values()), "low_share": 1.0,
                             "counted_nodes": 3}
    assert sum(stats["by_precision"].values()) == stats["nodes"] == len(cnn_report.rows)
    assert stats["calibrated"] is False and stats["moved_by_tolerance"] is None
    assert 0 < stats["weight_bytes"]["after"] < stats["weight_bytes"]["before"]
    assert "heavy compute in fp16: 100.0% of" in cnn_report.summary()


def test_attention_macs_count_both_products():
    class Attention(nn.Module):
        def forward(self, q, k, v):
            return nn.functional.scaled_dot_product_attention(q, k, v)

    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 6, 16), torch.randn(2, 4, 6, 32)
    gm = amppass.convert(Attention(), (q, k, v), dtype="bf16", plan_for="coverage")
    sdpa = [n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert sdpa and sdpa[0].meta["amppass"]["evidence"]["macs"] == 2 * 4 * 8 * 6 * (16 + 32)


def test_node_macs_is_none_without_shapes():
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4)))
    assert all(node_macs(n) is None for n in gm.graph.nodes)


def test_summary_of_a_calibrated_tolerance_run(calibrated_report):
    stats = calibrated_report.stats()
    assert stats["moved_by_tolerance"] == 1 and stats["calibrated"] is True
    assert stats["macs"] == {"total": 4000, "low": 3000, "low_share": 0.75, "counted_nodes": 2}
    text = calibrated_report.summary()
    assert "75.0% of 4,000 MACs" in text and "tolerance search: 1 node\n" in text and "uncalibrated" not in text


class _Recurrent(nn.Module):
    """A 2-layer bidirectional LSTM (with projections) into a GRU cell: getitem outputs everywhere."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, num_layers=2, bidirectional=True, proj_size=4, batch_first=True)
        self.cell = nn.GRUCell(8, 12)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        y, (h, c) = self.lstm(x)
        return self.head(self.cell(y[:, -1]))


def test_recurrent_layers_count_in_the_mac_share_and_getitem_is_known():
    x = torch.randn(2, 5, 8)
    report = amppass.report(amppass.convert(_Recurrent().eval(), (x,), dtype="fp16", target="cuda",
                                            plan_for="coverage"))  # CUDA: every recurrent layer has low kernels
    rows = {r.op: r for r in report.rows}
    steps = 2 * 5  # batch x sequence
    # per step: layer 1 w_ih (64x8) + w_hh (64x4) + w_hr (4x16); layer 2 w_ih (64x8) + ...; both directions
    lstm = steps * 2 * (2 * (64 * 8 + 64 * 4 + 4 * 16))
    cell = 2 * (36 * 8 + 36 * 12)
    assert rows["aten.lstm"].macs == lstm and rows["aten.gru_cell"].macs == cell
    assert report.stats()["macs"] == {"total": lstm + cell + 2 * 3 * 12, "low": lstm + cell + 2 * 3 * 12,
                                      "low_share": 1.0, "counted_nodes": 3}
    getitems = [r for r in report.rows if r.op == "getitem"]
    assert getitems and all("not in the policy table" not in r.reason for r in getitems)
    assert report.stats()["unknown_ops"] == [] and "not in the policy table" not in report.summary()


def test_onnx_recurrent_ops_count_and_sequence_and_constant_ops_are_known():
    from onnx import TensorProto, helper, numpy_helper

    f, rng = TensorProto.FLOAT, np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((2, 64, 8)).astype(np.float32), "w")  # 2 directions
    r = numpy_helper.from_array(rng.standard_normal((2, 64, 16)).astype(np.float32), "r")
    index = helper.make_node("Constant", [], ["i"], value=numpy_helper.from_array(np.array(0, np.int64)), name="index")
    graph = helper.make_graph(
        [index,
         helper.make_node("LSTM", ["x", "w", "r"], ["y"], hidden_size=16, direction="bidirectional", name="lstm"),
         helper.make_node("SplitToSequence", ["y"], ["seq"], axis=0, name="split"),
         helper.make_node("SequenceAt", ["seq", "i"], ["step"], name="at"),
         helper.make_node("Relu", ["step"], ["out"], name="relu")],
        "g", [helper.make_tensor_value_info("x", f, [5, 2, 8])], [helper.make_tensor_value_info("out", f, None)],
        [w, r])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    report = amppass.report(amppass.convert_onnx(model, "fp16", target="cuda"))  # the CPU provider has no fp16 LSTM
    rows = {row.name: row for row in report.rows}
    assert rows["lstm"].macs == 5 * 2 * (2 * 64 * 8 + 2 * 64 * 16) and rows["lstm"].precision == "fp16"
    assert report.stats()["unknown_ops"] == []
    assert rows["split"].precision == rows["at"].precision == "-" and "sequence" in rows["at"].reason
    assert rows["index"].precision == "-" and "constant" in rows["index"].reason


# -- JSON ---------------------------------------------------------------------------------------------

def test_json_of_a_converted_model_follows_the_schema(cnn_report, tmp_path):
    path = tmp_path / "r.json"
    cnn_report.to_json(path)
    data = json.loads(path.read_text())
    jsonschema.validate(data, load_schema())
    assert [r["name"] for r in data["rows"]] == [r.name for r in cnn_report.rows]
    assert data["summary"] == json.loads(json.dumps(cnn_report.stats()))


def test_schema_rejects_what_it_does_not_describe(calibrated_report):
    schema = load_schema()
    jsonschema.validate(json.loads(calibrated_report.to_json()), schema)
    bad = json.loads(calibrated_report.to_json())
    bad["rows"][0]["precision"] = "fp4"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    del bad["summary"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_non_finite_evidence_is_written_as_null(calibrated_report):
    calibrated_report.rows.append(
        Row("zeros", "Mul", "fp16", "all zero", "painting", [], {"absmax": 0.0, "min_nonzero": float("inf")}))
    data = json.loads(calibrated_report.to_json())
    assert data["rows"][-1]["evidence"] == {"absmax": 0.0, "min_nonzero": None}
    jsonschema.validate(data, load_schema())
    assert len(_parse(calibrated_report.to_html()).ranges) == 3  # nothing to draw on a log axis


def test_failed_write_leaves_no_file(tmp_path, monkeypatch):
    target = tmp_path / "r.json"

    def refuse(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError):
        write_atomic(target, "x" * 1000)
    assert list(tmp_path.iterdir()) == []


# -- HTML ---------------------------------------------------------------------------------------------

class _Page(HTMLParser):
    """Collects the elements the report page is made of."""

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.body_rows: list[dict] = []
        self.strip_cells: list[dict] = []
        self.ranges: list[dict] = []
        self.limits = 0
        self.external: list[str] = []
        self.ids: set[str] = set()
        self.headers = 0
        self.table = ""

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.ids.add(attrs.get("id", ""))
        for key in ("src", "href"):
            if attrs.get(key):
                self.external.append(attrs[key])
        if tag == "link" or (tag == "script" and "src" in attrs):
            self.external.append(tag)
        if tag == "table":
            self.table = attrs.get("id", "")
        if tag == "tr" and "tbody" in self.stack and self.table == "rows":  # the decisions, not the rollups
            self.body_rows.append(attrs)
        if tag == "th" and self.table == "rows":
            self.headers += 1
        if tag == "rect" and "node" in attrs.get("class", ""):
            self.strip_cells.append(attrs)
        if tag == "rect" and attrs.get("class") == "range":
            self.ranges.append(attrs)
        if tag == "line" and attrs.get("class") == "limit":
            self.limits += 1
        self.stack.append(tag)

    def handle_endtag(self, tag):
        while self.stack and self.stack.pop() != tag:
            pass


def _parse(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    return page


def test_html_page_is_self_contained_with_a_row_and_a_cell_per_node(cnn_report, tmp_path):
    path = tmp_path / "r.html"
    cnn_report.to_html(path)
    text = path.read_text(encoding="utf-8")
    page = _parse(text)
    assert page.external == []
    assert not re.search(r"(src|href)=\"https?:", text) and "@import" not in text
    order = decision_order(cnn_report.rows)  # the decisions that matter first; the # column keeps graph order
    assert [r["data-precision"] for r in page.body_rows] == [cnn_report.rows[i].precision for i in order]
    assert [c["data-precision"] for c in page.strip_cells] == [r.precision for r in cnn_report.rows]
    assert {"rows", "filter", "precision", "strip", "ranges-note"} <= page.ids
    assert page.headers == 9 and page.ranges == []


def test_html_plots_observed_ranges_against_fp16_limits(calibrated_report):
    page = _parse(calibrated_report.to_html())
    assert "ranges" in page.ids and page.limits == 2
    assert len(page.ranges) == 3
    # log scale: exp's range (1e-7 .. 2e5) starts left of conv's (1e-3 .. 12.5) and is wider
    conv, exp = page.ranges[0], page.ranges[1]
    assert float(exp["x"]) < float(conv["x"]) and float(exp["width"]) > float(conv["width"])


def test_html_shows_the_target_the_tolerance_and_what_local_error_means(calibrated_report, cnn_report):
    text = calibrated_report.to_html()
    page = _parse(text)
    assert "terms" in page.ids and page.headers == 10  # the local error column joins the nine
    target = re.search(r'<div class="muted" id="target">([^<]*)</div>', text).group(1)
    assert "target fp16, inference mode, tolerance 0.001 on the output error (reached 0.0004)" in target
    assert "output error, within 0.001" in text
    header = re.search(r'<th title="([^"]*)">local error</th>', text).group(1)
    assert header.startswith("local error: ||y_low - y_fp32|| / ||y_fp32||") and "no unit" in header
    big = re.search(r'<tr data-precision="fp32"[^>]*><td class="num">2</td>.*?</tr>', text).group(0)
    assert '>0.0032</td>' in big
    tip = re.search(r"<title>(big · [^<]*)</title>", text).group(1)
    assert "local error 0.0032 (relative to the fp32 output&#x27;s norm, no unit)" in tip
    plain = cnn_report.to_html()  # no tolerance, no local errors: neither the terms nor the column
    assert 'id="terms"' not in plain and _parse(plain).headers == 9
    assert "fp16 for cpu (torch " in plain and ", inference mode" in plain


def test_html_escapes_node_text():
    report = Report([Row("<script>alert(1)</script>", "op&", "fp16", "a < b", "override")],
                    {"front_end": "fx", "dtype": "fp16"})
    text = report.to_html()
    assert "<script>alert(1)" not in text and "&lt;script&gt;alert(1)" in text


def _chromium_dom(url: str) -> str:
    with tempfile.TemporaryDirectory() as profile:
        result = subprocess.run(
            ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
             "--dump-dom", url],
            capture_output=True, text=True, timeout=60,
        )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian chromium is not installed")
def test_html_table_runs_in_headless_chromium(cnn_report, tmp_path):
    path = tmp_path / "r.html"
    cnn_report.to_html(path)
    n = len(cnn_report.rows)
    dom = _chromium_dom(path.as_uri())
    assert 'data-ready="1"' in dom  # the inline script ran to its end
    assert f"{n} of {n} nodes shown" in dom
    assert len(_parse(dom).body_rows) == n
    # the filter, driven from the URL: only the two convolutions stay visible
    dom = _chromium_dom(path.as_uri() + "#filter=aten.conv2d")
    assert f"2 of {n} nodes shown" in dom
    visible = [r for r in _parse(dom).body_rows if "hidden" not in r]
    assert len(visible) == 2


# -- terminal -----------------------------------------------------------------------------------------

def test_terminal_view_lists_every_node_and_the_summary(cnn_report):
    text = render_text(cnn_report, width=200)
    for row in cnn_report.rows:
        assert row.name in text
    for line in cnn_report.summary().splitlines():
        assert line in text
    assert "\x1b[" not in text


def test_terminal_view_can_cut_long_tables(cnn_report):
    text = render_text(cnn_report, width=200, max_rows=2)
    assert f"{len(cnn_report.rows) - 2} more rows" in text
    assert cnn_report.rows[-1].name + " " not in text.split("more rows")[0]


def _long_report() -> Report:
    reasons = ["matrix multiply: Tensor Core work, accumulates in fp32 inside the kernel",
               "normalisation: mean and variance statistics need fp32", "reads shape metadata only"]
    rows = [Row(f"/encoder/layer.{i}/attention/self/query_projection_with_a_long_scope/{op}_{i}", op, prec,
                reasons[i % 3], "policy", [], {"macs": 10**9 + i} if op == "MatMul" else {})
            for i, (op, prec) in enumerate([("MatMul", "fp16"), ("LayerNormalization", "fp32"), ("Shape", "-")] * 4)]
    return Report(rows, {"front_end": "onnx", "dtype": "fp16", "casts": 3})


@pytest.mark.parametrize("width", [60, 80, 100, 120, 160])
def test_terminal_view_fits_its_width_one_line_per_row_summary_first(width):
    report = _long_report()
    lines = render_text(report, width=width).splitlines()
    assert max(len(line) for line in lines) <= width
    header = next(i for i, line in enumerate(lines) if line.startswith("node "))
    assert lines[0].startswith("╭─ amppass onnx") and any("casts inserted: 3" in line for line in lines[:header])
    rows = [line for line in lines if line.startswith("layer.")]
    assert len(rows) == len(report.rows)  # one line each: the heavy ops first, then fp32 work, then shapes
    order = sorted(report.rows, key=lambda r: (r.macs is None, r.precision == "-", r.precision != "fp32",
                                               -(r.macs or 0)))
    assert len({line.split()[0] for line in rows}) == len(rows)  # shortened, still apart
    for line, row in zip(rows, order, strict=False):
        shown = line.split()[0]
        index = row.name.split("/")[2]
        assert len(shown) < len(row.name) and (shown.startswith(index + "/") or width < 80)  # the layer stays
        assert line.split()[2] == row.precision
    assert ("source" in lines[header]) is (width >= 100) and ("MACs" in lines[header]) is (width >= 120)
    assert "shortened to fit" in " ".join(lines)


def test_terminal_view_filters_and_groups_by_op():
    report = _long_report()
    text = render_text(report, width=120, precision=["low"], op=["matmul"])
    assert "4 of 12 nodes: precision low; op matmul" in text
    assert sum(line.startswith("layer.") for line in text.splitlines()) == 4  # the shared "/encoder/" dropped
    groups = report.by_op()
    assert [(g.op, g.nodes, g.by_precision, g.macs) for g in groups] == [
        ("LayerNormalization", 4, {"fp32": 4}, None), ("MatMul", 4, {"fp16": 4}, 4 * 10**9 + 0 + 3 + 6 + 9),
        ("Shape", 4, {"-": 4}, None)]
    grouped = render_text(report, width=80, by_op=True, precision=["fp32", "none"])
    assert "8 of 12 nodes" in grouped and "MatMul" not in grouped and "LayerNormalization" in grouped
    assert [r.name for r in report.select(precision=["none"], op=["shape", "SHAPE"])] == \
        [r.name for r in report.rows if r.op == "Shape"]
    with pytest.raises(amppass.InputError, match="'fp4' is not one of fp8, fp16, bf16, fp32, low, none"):
        report.select(precision=["fp4"])


def test_the_summary_says_whether_the_whole_model_was_compared_with_the_original():
    """A conversion on a busy machine skips that comparison (a warning in the log); the summary, which is
    what the terminal and the HTML page show, says so too, and gives both times where it was made."""
    info = {"front_end": "fx", "dtype": "bf16", "mode": "inference"}
    skipped = Report([], {**info, "whole_model": {"skipped": "the machine was too busy for the timings to agree"}})
    assert ("whole model: not timed against your original module in fp32, because the machine was too busy"
            in skipped.summary()) and "too busy" in skipped.to_html()
    assert "convert again when it is idle" in skipped.summary()  # what to do about it
    measured = Report([], {**info, "whole_model": {"converted_ms": 0.1983, "original_ms": 0.1616}})
    assert "whole model per call: 0.198 ms converted, 0.162 ms for the original module in fp32" in measured.summary()
    assert "whole model" not in Report([], info).summary()


def test_a_decision_by_profitability_follows_the_schema(calibrated_report):
    """A module kept whole in fp32 reports one row decided by profitability; its JSON must validate."""
    calibrated_report.rows.append(Row("Sequential", "module", "fp32", "profitability: the original was faster",
                                      "profitability", [], {"converted_ms": 0.2, "original_ms": 0.1}))
    jsonschema.validate(json.loads(calibrated_report.to_json()), load_schema())
