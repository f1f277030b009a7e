"""The benchmark section "gpu" writes its tables whatever happens on the device: parts out of time say so,
a part that raises leaves one row naming the error, and the others still run (timings are never asserted)."""

from __future__ import annotations

import pytest

from benchmarks import gpu
from benchmarks.__main__ import main


def test_parts_out_of_time_leave_rows_that_say_so(monkeypatch):
    monkeypatch.setattr(gpu, "BUDGET_S", dict.fromkeys(gpu.BUDGET_S, -1.0))
    described, tables = gpu.run(quick=True)
    assert described.startswith("CPU") or "SMs" in described
    assert len(tables) == len(gpu.PARTS)
    for _, rows in tables:
        assert rows and all(row["failed"] == gpu.SKIPPED for row in rows)


def test_a_part_that_raises_leaves_a_row_naming_the_error_and_the_others_run(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(gpu, "build", broken)
    monkeypatch.setattr(gpu, "BUDGET_S", {**dict.fromkeys(gpu.BUDGET_S, -1.0), "inference": 60.0})
    _, tables = gpu.run(quick=True)
    inference = tables[0][1]
    assert [row["failed"] for row in inference] == ["RuntimeError: CUDA error: an illegal memory access was "
                                                    "encountered"] * len(gpu.points(quick=True))
    assert all(rows for _, rows in tables[1:])


@pytest.mark.slow  # every part on the small zoo: minutes on the 2-core CPU
def test_quick_gpu_section_runs_every_part(tmp_path):
    assert main(["run", "--quick", "--out", str(tmp_path), "--only", "gpu"]) == 0
    text = (tmp_path / "RESULTS.md").read_text()
    assert "## GPU" in text and "FAILED" not in text and "Error" not in text
