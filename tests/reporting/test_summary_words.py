"""The summary's speed-check lines in words a newcomer reads on the first screen (it said
``profitability: ... regions timed: 13 prior`` and ``not compared with the original module: the machine was too
busy``). They say what was measured, what the prior is, and what to do when the machine was busy."""

from __future__ import annotations

import pytest

from amppass.reporting.report import Report
from tests.helpers.docs import blocks
from tests.helpers.docs import check_summary_sample as check
from tests.helpers.paths import ROOT

INFO = {"front_end": "fx", "dtype": "bf16", "mode": "inference"}
BUSY = {"skipped": "the machine was too busy for the timings to agree"}


def _summary(profitability=None, whole=None) -> list[str]:
    info = {**INFO, **({"profitability": profitability} if profitability else {}),
            **({"whole_model": whole} if whole else {})}
    return Report([], info).summary().splitlines()


def test_a_busy_first_run_says_what_was_estimated_and_what_to_do():
    lines = _summary({"nodes_fp32": 84, "regions_fp32": 24, "timing": {"prior": 25}}, BUSY)
    text = "\n".join(lines)
    assert ("speed check: 84 nodes in 24 groups of connected bf16 ops stay fp32, because bf16 (with its casts) was "
            "judged no faster than fp32 for them on this machine") in lines
    assert ("how the speed of each group of connected ops was known: 25 groups estimated from a one-time speed probe "
            "of this device (the 'prior'), because the machine was too busy to time them steadily") in lines
    assert any(line.startswith("whole model: not timed against your original module in fp32, because the machine "
                               "was too busy") and "used without that check" in line for line in lines)
    advice = [line for line in lines if "convert again when it is idle" in line]
    assert len(advice) == 1 and "uptime" in advice[0] and "costs=" in advice[0]  # said once, after both
    for jargon in ("regions timed", "profitability:", "node(s)", "region(s)", "not compared with the original"):
        assert jargon not in text


@pytest.mark.parametrize("timing, words", [
    ({"measured": 3}, "3 groups timed on this machine"),
    ({"cached": 1}, "1 group timed on this machine by an earlier conversion (kept in the timing cache)"),
    ({"table": 2}, "2 groups read from the cost table passed as costs="),
    ({"measured": 2, "prior": 1}, "2 groups timed on this machine; 1 group estimated from a one-time speed probe"),
])
def test_each_way_a_speed_was_known_is_said(timing, words):
    lines = _summary({"nodes_fp32": 1, "regions_fp32": 1, "timing": timing})
    assert any(words in line for line in lines), lines
    assert any("1 node in 1 group" in line for line in lines)
    assert any("convert again when it is idle" in line for line in lines) == ("prior" in timing)


def test_nothing_kept_fp32_and_a_measured_whole_model_need_no_advice():
    lines = _summary({"nodes_fp32": 0, "regions_fp32": 0, "timing": {"measured": 4}},
                     {"converted_ms": 1.5, "original_ms": 2.5})
    assert ("speed check: no bf16 op stays fp32 for speed: bf16 was judged faster than fp32 on this machine "
            "wherever it was checked") in lines
    assert "whole model per call: 1.5 ms converted, 2.5 ms for the original module in fp32" in lines
    assert not any("idle" in line for line in lines)


def test_the_readme_sample_is_checked_against_what_prints():
    """tests/test_docs.py rule 5 holds the README's sample summary to what the summary prints: the sample as
    committed passes against a run with other figures; the old wording, or a line left out, fails."""
    from dataclasses import replace


    sample = next(b for b in blocks(ROOT / "README.md") if b.printed_on)
    printed = sample.code.replace("308 nodes", "310 nodes").replace("casts inserted: 50", "casts inserted: 52")
    check(sample, printed)
    old = ("profitability: 0 node(s) in 0 region(s) kept fp32, slower in low precision on this machine, regions "
           "timed: 25 prior")
    with pytest.raises(AssertionError, match="not printed here"):
        check(replace(sample, code=sample.code + "\n" + old), printed)
    with pytest.raises(AssertionError, match="also prints"):
        check(replace(sample, code=sample.code.replace("casts inserted: 50\n", "")), printed)
    with pytest.raises(AssertionError, match="not a line the summary prints"):
        check(replace(sample, code=sample.code.replace("25 groups estimated", "25 groups guessed")), printed)


# what the README's block prints on other CPUs (written as the summary reads; the sample must hold against each)
AVX2_ONLY = """\
amppass fx plan, bf16 for cpu (torch 2.13.0 on cpu) (inference): 1 node: 1 fp32
casts inserted: 0
weight bytes: 437,928,960 -> 437,928,960 (1.00 of fp32)
decided by: 1 profitability
speed check: 85 nodes in 25 groups of connected bf16 ops stay fp32, because bf16 (with its casts) was judged no \
faster than fp32 for them on this machine
how the speed of each group of connected ops was known: 25 groups not timed: bf16 cannot be faster on this CPU
not timed: this CPU has none of amx_bf16, avx512_bf16 (torch capability AVX2)
returned: your original module, in fp32, unchanged: this CPU has no bf16 instructions, so bf16 runs slower than \
fp32 here and no op was converted
to convert it anyway: plan_for='coverage' runs in bf16 every op the numerics allow (the same plan on every machine; \
slower on this CPU); to plan for the machine the model will run on, convert there (a CPU with bf16 instructions), \
or pass target='cuda' for a GPU
uncalibrated: decisions come from op semantics and weights only"""
KEPT_ORIGINAL = """\
amppass fx plan, bf16 for cpu (torch 2.13.0 on cpu) (inference): 1 nodes: 1 fp32
casts inserted: 0
weight bytes: 437,928,960 -> 437,928,960 (1.00 of fp32)
decided by: 1 profitability
whole model per call: 45.2 ms converted, 39.8 ms for the original module in fp32
returned: your original module, in fp32, unchanged: the converted graph was not faster than it here
to convert it anyway: plan_for='coverage' runs low every op the numerics allow (the same plan on every machine), or \
pass costs= from a conversion made on the machine the model will run on
uncalibrated: decisions come from op semantics and weights only"""
IDLE_AMX = """\
amppass fx plan, bf16 for cpu (torch 2.13.0 on cpu) (inference): 308 nodes: 206 bf16, 81 fp32, 21 -
heavy compute in bf16: 100.0% of 2,728,525,824 MACs (85 matmul, conv, attention or RNN nodes)
casts inserted: 50
weight bytes: 437,928,960 -> 266,712,576 (0.61 of fp32)
decided by: 177 painting, 110 policy
speed check: no bf16 op stays fp32 for speed: bf16 was judged faster than fp32 on this machine wherever it was \
checked
how the speed of each group of connected ops was known: 25 groups timed on this machine
whole model per call: 11.2 ms converted, 20.5 ms for the original module in fp32
uncalibrated: decisions come from op semantics and weights only"""


@pytest.mark.parametrize("printed", [AVX2_ONLY, KEPT_ORIGINAL, IDLE_AMX], ids=["avx2", "kept-original", "idle-amx"])
def test_the_readme_sample_holds_on_other_cpus(printed):

    sample = next(b for b in blocks(ROOT / "README.md") if b.printed_on)
    check(sample, printed)
