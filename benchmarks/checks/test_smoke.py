"""Smoke tests of the benchmark entry point: quick mode runs and writes its outputs (timings are never asserted)."""

import pytest

import amppass
from benchmarks.__main__ import main


def _check_outputs(out, text):
    assert "## Machine" in text and "## Versions" in text
    assert "python -m benchmarks run --quick --only latency" in text
    assert (out / "latency.png").stat().st_size > 0
    if hasattr(amppass, "convert_onnx"):
        assert (out / "scaling.png").stat().st_size > 0
    else:
        assert "no `convert_onnx` yet" in text


def test_quick_latency_and_scaling_write_results_and_plots(tmp_path):
    assert main(["run", "--quick", "--out", str(tmp_path), "--only", "latency,scaling"]) == 0
    _check_outputs(tmp_path, (tmp_path / "RESULTS.md").read_text())


@pytest.mark.slow  # every section, the other engineers' included: over 60 s on the shared 2-core machine
def test_quick_mode_writes_every_section(tmp_path):
    assert main(["run", "--quick", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "RESULTS.md").read_text()
    _check_outputs(tmp_path, text)
    assert "FAILED" not in text


def test_only_replaces_its_section_and_keeps_the_others(tmp_path):
    from benchmarks import results
    from benchmarks.results import Section

    def section(title, value):
        made = Section(title, "", notes=[f"note {value}"])
        made.command = f"cmd {title}"
        made.tables.append(("", [{"x": value}]))
        return made

    path = tmp_path / "RESULTS.md"
    results.write_markdown(path, "full", [section("A", 1), section("B", 2)], "t0", "load")
    results.write_markdown(path, "quick", [section("B", 3), section("C", 4)], "t1", "load")
    text = path.read_text()
    assert text.count("## Machine") == 1 and "run --quick" in text
    assert text.index("## A") < text.index("## B") < text.index("## C")
    assert "note 1" in text and "note 3" in text and "note 4" in text and "note 2" not in text


def test_integrations_section_rows(monkeypatch):
    from benchmarks import integrations

    monkeypatch.setattr(integrations, "settings", lambda quick: integrations.Setting(16, 1, 8, 4, 3))
    monkeypatch.setattr(integrations, "TOOLS", {"accelerate": integrations.accelerate_loop})
    monkeypatch.setattr(integrations, "VARIANTS", ("fp32", "tool fp16", "amppass fp16"))
    rows = {r["variant"]: r for r in integrations.run(quick=False)}  # the settings above, the variants above
    assert rows["fp32"]["steps"] == rows["amppass fp16"]["steps"] == 3
    assert rows["fp32"]["trained"] == "fp32" and rows["amppass fp16"]["trained"] is not None
    assert rows["amppass fp16"]["curve_dev"] is not None and rows["amppass fp16"]["peak_MB"] > 0
    assert "trains fp32" in rows["tool fp16"]["note"]  # accelerate's fp16 does nothing on a CPU: the row says so


@pytest.mark.slow  # every tool, two variants each: a minute on the shared machine
def test_integrations_section_quick(tmp_path):
    assert main(["run", "--quick", "--out", str(tmp_path), "--only", "integrations"]) == 0
    text = (tmp_path / "RESULTS.md").read_text()
    assert "amppass bf16" in text and "| trained |" in text and "FAILED" not in text
