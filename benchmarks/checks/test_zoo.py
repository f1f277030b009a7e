"""The benchmark section "zoo" counts the transformers zoo's outcomes per step from the harness's JSON."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from benchmarks import zoo  # after the skip: the harness imports transformers
from benchmarks.__main__ import SECTIONS
from tests.conformance import zoo_harness as harness


def test_benchmark_section_counts_each_step(tmp_path, capsys):
    results = [vars(harness.Result("A", "causal-lm", True, steps={
        "generate": {"outcome": "pass", "detail": ""}, "train": {"outcome": "fail", "detail": "ValueError: x"},
        "compile": {"outcome": "n/a", "detail": ""}})), vars(harness.Result("B", "base", False, "KeyError: y"))]
    counts, failing, unbuilt = (rows for _, rows in zoo.section(results, "two classes").tables)
    by_step = {row["step"]: row for row in counts}
    assert (by_step["build"]["pass"], by_step["build"]["unbuilt"]) == (1, 1)
    assert (by_step["generate"]["pass"], by_step["train"]["fail"], by_step["compile"]["n/a"]) == (1, 1, 1)
    assert by_step["export-onnx"]["not run"] == 1
    assert failing == [{"class": "A", "kind": "causal-lm", "generate": "pass", "train": "fail: ValueError: x",
                        "compile": "n/a"}]
    assert unbuilt == [{"classes": 1, "reason": "KeyError: y", "e.g.": "B"}]
    path = tmp_path / "outcomes.json"
    harness.write_json(path, {"versions": harness.versions(), "results": results})
    zoo.main([str(path)])
    assert "| train | 0 | 1 | 0 | 0 | 0 |  |" in capsys.readouterr().out
    assert "zoo" in SECTIONS
