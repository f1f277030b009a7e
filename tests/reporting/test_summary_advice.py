"""The summary's advice fits the reason it gives, and no message prints a placeholder for a time never measured.

On a CPU without bf16/fp16 instructions (AVX2 only: most laptops and CI runners) ``convert`` returns the original
module, kept in fp32; the summary then says so, and what converts anyway (``plan_for="coverage"``, or a plan made
for the machine the model will run on), never "convert again when the machine is idle", which cannot help there.
The real conversion runs on any CPU: the CPU's facts are injected as an AVX2 one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amppass
from amppass.errors import InputError
from amppass.reporting.report import Report, Row
from amppass.serving.fp32_original import Fp32Original, keep_original
from amppass.targets import device
from tests.helpers.load import timing_cache

AVX2 = device.CpuFacts("Test CPU without native bf16", frozenset({"avx2", "fma"}))
X = (torch.randn(8, 64, generator=torch.Generator().manual_seed(0)),)
INFO = {"front_end": "fx", "dtype": "bf16", "mode": "inference"}
BUSY = "the machine was too busy for the timings to agree"
KEPT = Row("Net", "module", "fp32", "profitability: the original runs, in fp32", "profitability", rule="whole-model")
NO_BF16 = {"native_low": False, "why": "this CPU has none of amx_bf16, avx512_bf16"}


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.LayerNorm(64)).eval()


@pytest.fixture
def avx2_cpu(tmp_path, monkeypatch):
    """This machine read as a CPU without bf16 instructions, with a timing cache of its own."""
    monkeypatch.setattr(device, "cpu_facts", lambda: AVX2)
    with timing_cache(str(tmp_path)):
        yield


def test_a_cpu_without_bf16_says_the_original_came_back_and_how_to_convert_anyway(avx2_cpu, tmp_path):
    model = net()
    kept = amppass.convert(model, X, "bf16")
    assert isinstance(kept, Fp32Original)
    summary = amppass.report(kept).summary()
    lines = summary.splitlines()
    assert lines[0].endswith("1 node: 1 fp32")
    assert any(line.startswith("returned: your original module, in fp32, unchanged: this CPU has no bf16 "
                               "instructions") for line in lines), summary
    advice = [line for line in lines if line.startswith("to convert it anyway: ")]
    assert len(advice) == 1 and "plan_for='coverage'" in advice[0] and "target='cuda'" in advice[0]
    for wrong in ("idle", "used without that check", "?"):
        assert wrong not in summary, summary
    with pytest.raises(InputError) as saving:
        amppass.save(kept, tmp_path / "model.pt2")
    message = str(saving.value)
    assert "?" not in message and "nothing in the plan runs low on this device" in message
    assert "plan_for='coverage'" in message
    # the advice works: a coverage plan converts on this CPU, with bf16's error against fp32
    converted = amppass.convert(model, X, "bf16", plan_for="coverage")
    assert not isinstance(converted, Fp32Original) and amppass.report(converted).counts().get("bf16", 0) > 0
    with torch.no_grad():
        want, got = model(*X), converted(*X)
    assert (got - want).norm() / want.norm() < 3e-2


def _summary(rows, whole, device_facts=None, timing="measured") -> list[str]:
    profit = {"nodes_fp32": 2, "regions_fp32": 1, "timing": {timing: 1}, "device": device_facts or {}}
    return Report(rows, {**INFO, "profitability": profit, "whole_model": whole}).summary().splitlines()


# each reason the whole model ends as it does -> (line that says it, advice that fits, advice that would not)
REASONS = {
    "no bf16 instructions, original kept": (
        [KEPT], {"skipped": "nothing in the plan runs low on this device"}, NO_BF16, "device",
        "returned: your original module, in fp32, unchanged: this CPU has no bf16 instructions",
        "to convert it anyway: plan_for='coverage'", "idle"),
    "converted graph slower, original kept": (
        [KEPT], {"converted_ms": 45.2, "original_ms": 39.8}, {"native_low": True}, "measured",
        "returned: your original module, in fp32, unchanged: the converted graph was not faster than it here",
        "costs= from a conversion made on the machine the model will run on", "idle"),
    "every group slower, original kept": (
        [KEPT], {"skipped": "nothing in the plan runs low on this device"}, {"native_low": True}, "measured",
        "returned: your original module, in fp32, unchanged: nothing in the plan runs low on this device",
        "to convert it anyway: plan_for='coverage'", "idle"),
    "too busy to time, converted graph returned": (
        [], {"skipped": BUSY}, {"native_low": True}, "prior",
        "whole model: not timed against your original module in fp32, because the machine was too busy",
        "to time on this machine instead: convert again when it is idle", "to convert it anyway"),
}


@pytest.mark.parametrize("reason", REASONS)
def test_every_reason_gets_the_advice_that_fits_it(reason):
    rows, whole, facts, timing, says, fits, never = REASONS[reason]
    lines = _summary(rows, whole, facts, timing)
    text = "\n".join(lines)
    assert any(line.startswith(says) for line in lines), text
    assert sum(fits in line for line in lines) == 1, text
    assert never not in text and "?" not in text


def test_a_faster_converted_graph_needs_no_advice():
    lines = _summary([], {"converted_ms": 11.2, "original_ms": 20.5}, {"native_low": True})
    assert "whole model per call: 11.2 ms converted, 20.5 ms for the original module in fp32" in lines
    assert not any(line.startswith(("returned", "to convert it anyway", "to time")) for line in lines)


def test_saving_a_kept_original_says_its_times_or_why_none_were_taken(tmp_path):
    timed = keep_original(net(), {**INFO, "target": {"name": "cpu"}, "weight_bytes_before": 1,
                                  "whole_model": {"converted_ms": 45.2, "original_ms": 39.8}})
    with pytest.raises(InputError, match=r"took 45\.2 ms per call on this CPU against 39\.8 ms"):
        amppass.save(timed, tmp_path / "a.pt2")
    untimed = keep_original(net(), {**INFO, "whole_model": {}})
    with pytest.raises(InputError) as saving:
        amppass.save(untimed, tmp_path / "b.pt2")
    assert "the converted graph was not timed against it" in str(saving.value) and "?" not in str(saving.value)
    assert not list(tmp_path.iterdir())  # nothing written
