"""amppass.reporting.rows: the parts every report view reads: a row's numbers from its evidence (only finite ones),
the groups of an op, the target in words, and the summary's sentences from a report's info and stats (a stand-in
report here, so the sentences are tested apart from the report class)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest

from amppass.reporting.rows import LOW_PRECISIONS, PRECISIONS, OpGroup, Row, finite, summary_lines, target_phrase


@dataclass
class Stub:
    """A :class:`~amppass.reporting.rows.Summarised` with the stats a report of its rows would give."""

    rows: list[Row] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    numbers: dict[str, Any] = field(default_factory=dict)

    def stats(self) -> dict[str, Any]:
        return {"nodes": 3, "by_precision": {"fp32": 1, "bf16": 2}, "casts": 4,
                "macs": {"total": 0, "low": 0, "low_share": None, "counted_nodes": 0},
                "weight_bytes": {"before": None, "after": None}, "moved_by_tolerance": None, "calibrated": True,
                "sources": {}, "unknown_ops": [], **self.numbers}


INFO = {"front_end": "fx", "dtype": "bf16", "mode": "inference",
        "target": {"name": "cpu", "runtime": "torch 2.13.0 on cpu"}}


@pytest.mark.parametrize("value, expected", [
    (3, 3.0), (2.5, 2.5), (-1e-7, -1e-7), (0, 0.0),
    (True, None), (False, None), ("3", None), (None, None), ([1.0], None),
    (math.nan, None), (math.inf, None), (-math.inf, None), (10 ** 400, None),
])
def test_finite_takes_only_finite_numbers(value, expected):
    assert finite(value) == expected


def test_a_rows_numbers_come_from_its_evidence_when_finite():
    row = Row("mm", "MatMul", "fp16", "matrix multiply", "policy", ["x_to_fp16"],
              {"macs": 4096.0, "local_error": 2e-3, "absmax": 12.5, "min_nonzero": 1e-4})
    assert row.macs == 4096 and isinstance(row.macs, int)
    assert row.local_error == 2e-3 and row.observed == (12.5, 1e-4)
    assert row.rule == "" and row.casts == ["x_to_fp16"]


@pytest.mark.parametrize("evidence, macs, local_error, observed", [
    ({}, None, None, None),
    ({"macs": "many", "local_error": True, "absmax": math.nan}, None, None, None),
    ({"macs": 10 ** 400, "local_error": math.inf, "absmax": 0.0, "min_nonzero": math.inf}, None, None, (0.0, None)),
    ({"absmax": 3, "min_nonzero": "tiny"}, None, None, (3.0, None)),
])
def test_a_rows_numbers_are_none_where_the_evidence_holds_none(evidence, macs, local_error, observed):
    row = Row("n", "op", "fp32", "why", "policy", evidence=evidence)
    assert row.macs == macs and row.local_error == local_error and row.observed == observed


def test_rows_do_not_share_their_default_lists():
    first, second = Row("a", "op", "fp16", "r", "policy"), Row("b", "op", "fp16", "r", "policy")
    first.casts.append("c")
    first.evidence["macs"] = 1
    assert second.casts == [] and second.evidence == {}


def test_an_op_groups_nodes_are_the_sum_of_its_precisions():
    assert OpGroup("MatMul", {"fp16": 3, "fp32": 2, "-": 1}).nodes == 6 and OpGroup("Add").nodes == 0


def test_precision_words():
    assert set(LOW_PRECISIONS) < set(PRECISIONS) and "fp32" in PRECISIONS and "-" in PRECISIONS


@pytest.mark.parametrize("info, phrase", [
    (INFO, "bf16 for cpu (torch 2.13.0 on cpu)"),
    ({"dtype": "fp16", "target": {"name": "cuda"}}, "fp16 for cuda (?)"),
    ({"dtype": "fp16", "target": "cpu"}, "target fp16"),  # converted by an amppass without targets
    ({"dtype": "fp16", "target": {"name": 3}}, "target fp16"),
    ({}, "target None"),
])
def test_target_phrase(info, phrase):
    assert target_phrase(info) == phrase


def test_the_first_line_counts_nodes_by_precision_in_a_fixed_order():
    lines = summary_lines(Stub(info=INFO))
    assert lines[0] == "amppass fx plan, bf16 for cpu (torch 2.13.0 on cpu) (inference): 3 nodes: 2 bf16, 1 fp32"
    assert lines[1:] == ["casts inserted: 4"]  # calibrated, nothing else recorded: nothing else said


def test_heavy_compute_weight_bytes_and_sources():
    stub = Stub(info=INFO, numbers={"macs": {"total": 12000, "low": 9000, "low_share": 0.75, "counted_nodes": 2},
                                    "weight_bytes": {"before": 4000, "after": 2000},
                                    "sources": {"policy": 2, "calibration": 1}})
    lines = summary_lines(stub)
    assert "heavy compute in bf16: 75.0% of 12,000 MACs (2 matmul, conv, attention or RNN nodes)" in lines
    assert "weight bytes: 4,000 -> 2,000 (0.50 of fp32)" in lines
    assert "decided by: 2 policy, 1 calibration" in lines


@pytest.mark.parametrize("moved, line", [(1, "moved to fp32 by the tolerance search: 1 node"),
                                         (3, "moved to fp32 by the tolerance search: 3 nodes")])
def test_nodes_moved_by_the_tolerance_search(moved, line):
    assert line in summary_lines(Stub(info=INFO, numbers={"moved_by_tolerance": moved}))


@pytest.mark.parametrize("extra, line", [
    ({"achieved_error": 1.234e-3, "tolerance": 5e-3}, "output error 0.00123 against a tolerance of 0.005"),
    ({"achieved_error": 8e-3, "tolerance": 5e-3, "tolerance_met": False},
     "output error 0.008 against a tolerance of 0.005 (not met)"),
    ({"achieved_error": 1e-3, "tolerance": 5e-3, "held_out_error": 2e-3},
     "output error 0.001 against a tolerance of 0.005; 0.002 on inputs the search held out"),
])
def test_the_tolerance_line(extra, line):
    assert line in summary_lines(Stub(info={**INFO, **extra}))


def test_saved_for_backward_with_its_split_by_dtype():
    info = {**INFO, "mode": "train",
            "backward": {"saved_bytes": 3072, "saved_bytes_by_dtype": {"bf16": 1024, "fp32": 2048, "bad": "x"}}}
    lines = summary_lines(Stub(info=info))
    assert "saved for backward by one forward on the example: 3,072 bytes (bf16 1,024, fp32 2,048)" in lines
    assert "(train)" in lines[0]


def test_fixed_dims_unknown_ops_and_uncalibrated():
    stub = Stub(info={**INFO, "fixed_dims": ["x dim 1 is fixed at 40"]},
                numbers={"unknown_ops": ["my.Foo"], "calibrated": False})
    lines = summary_lines(stub)
    assert lines[-3:] == [
        "sizes fixed at the example's in the file (the export does not run at others): x dim 1 is fixed at 40",
        "ops not in the policy table (followed their inputs): my.Foo",
        "uncalibrated: decisions come from op semantics and weights only",
    ]


@pytest.mark.parametrize("how, words", [
    ("device", "1 group not timed: bf16 cannot be faster on this CPU"),
    ("low kernel failed", "1 group not timed: their bf16 kernel failed, so they run fp32"),
    ("unmeasured", "1 group not timed, as their ops cannot run on their own: kept as planned"),
    ("a way a newer amppass knows", "1 group a way a newer amppass knows"),
])
def test_how_a_groups_speed_was_known_names_the_dtype(how, words):
    lines = summary_lines(Stub(info={**INFO, "profitability": {"nodes_fp32": 0, "timing": {how: 1}}}))
    assert f"how the speed of each group of connected ops was known: {words}" in lines


def test_a_device_that_cannot_run_the_low_dtype_natively_says_why():
    profit = {"nodes_fp32": 0, "device": {"native_low": False, "why": "this CPU has no bf16 instructions"}}
    assert "not timed: this CPU has no bf16 instructions" in summary_lines(Stub(info={**INFO, "profitability": profit}))


def test_a_model_converted_by_parts():
    parts = {"converted": ["encoder", "head"], "why_whole": "data-dependent control flow", "macs_total": 1000,
             "macs_low": 250, "eager": {"decoder": "it does not capture"}}
    lines = summary_lines(Stub(info={**INFO, "parts": parts}))
    start = lines.index("converted by parts (the whole model does not capture: data-dependent control flow): "
                        "2 parts: encoder, head")
    assert lines[start + 1:start + 3] == [
        "heavy compute of the whole model, eager code included: 25.0% of 1,000 MACs in low precision",
        "runs as the model's own code, in fp32: decoder (it does not capture)",
    ]


def test_stored_values_of_the_wrong_kind_are_left_out_not_raised():
    """A report read back from a model file holds whatever the file says: a field of the wrong type or an
    unbounded number is not said, and the rest of the summary still is."""
    info = {**INFO, "backward": "x", "parts": {"converted": "encoder"}, "profitability": {"nodes_fp32": "many"},
            "whole_model": 5, "fixed_dims": "x", "achieved_error": 10 ** 400, "tolerance": 1e-3,
            "target": ["cpu"]}
    lines = summary_lines(Stub(info=info))
    assert lines == ["amppass fx plan, target bf16 (inference): 3 nodes: 2 bf16, 1 fp32", "casts inserted: 4"]
