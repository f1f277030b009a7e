"""Speed plans that do not depend on the load during conversion (amppass.analysis.profitability, with the timing
cache, device facts and prior of amppass.targets.cost_model, and the FX timings of amppass.fx.runners.region_timing).

Timings on a shared machine are not asserted on. What is: where each region's times came from, that the
cache and the recorded table reproduce a plan, that untrusted timings fall back to the prior and are never
cached, and that a device without native low precision is not timed at all. CPU facts are injected, and
every cache lives in a temporary folder.
"""

from __future__ import annotations

import importlib
import logging

import pytest
import torch
from torch import nn

import amppass
from amppass.dtypes import low_type
from amppass.fx.runners import region_timing
from amppass.serving.fp32_original import Fp32Original
from amppass.targets import cost_model, device
from amppass.targets.measure import Timings
from amppass.targets.timing_cache import TimingCache
from tests.helpers.load import busy_processes, timing_cache

X = (torch.randn(16, 256, generator=torch.Generator().manual_seed(0)),)
NATIVE = device.CpuFacts("Test CPU with AMX", frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}))
AVX2 = device.CpuFacts("Test CPU without native bf16", frozenset({"avx2", "fma"}))
PROBE = {"gemm_fp32": 3e-4, "gemm_low": 1e-4, "copy_fp32": 2e-3, "call": 3e-6}  # a probe, as the cache keeps it


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256), nn.LayerNorm(256),
                         nn.Linear(256, 64)).eval()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh timing cache folder, nothing measured before in this process, and the device's probe in it
    (so that the prior, where one is needed, does not depend on the load when the probe would be taken), on a
    CPU whose flags say native bf16 unless a test says otherwise: the tests run on AVX2-only machines too."""
    monkeypatch.setattr(device, "cpu_facts", lambda: NATIVE)
    with timing_cache(str(tmp_path)):
        TimingCache(device.fingerprint(torch.device("cpu"))).add({f"probe|bf16|{k}": v for k, v in PROBE.items()})
        yield tmp_path


def _time_with(monkeypatch, timer) -> None:
    """Every interleaved timing (a region's kernels, the converted graph against the original) is ``timer``'s."""
    monkeypatch.setattr(cost_model, "interleaved", timer)
    monkeypatch.setattr(region_timing, "interleaved", timer)


def _outcome(converted) -> list[tuple[str, str]]:
    return [(r["first"], r["runs"]) for r in amppass.report(converted).info["profitability"]["regions"]]


def _timing(converted) -> list[str]:
    return [r["timing"] for r in amppass.report(converted).info["profitability"]["regions"]]


def test_a_plan_made_under_load_equals_the_quiet_plan_given_the_cache(cache):
    """The plan made beside 4 busy processes on this machine, with the cache the first conversion filled,
    decides every region as the first did; a region the first measured is read from the cache."""
    model = net()
    quiet = amppass.convert(model, X, "bf16")
    cost_model.forget()  # as a new process would: only the cache on disk remembers
    with busy_processes(4, seconds=120):
        loaded = amppass.convert(model, X, "bf16")
    assert _outcome(loaded) == _outcome(quiet)
    assert all(
        after == "cached"
        for before, after in zip(_timing(quiet), _timing(loaded), strict=False)
        if before == "measured"
    )
    if isinstance(quiet, torch.fx.GraphModule) and isinstance(loaded, torch.fx.GraphModule):
        assert loaded.code == quiet.code


def test_the_report_names_where_every_region_s_times_came_from(cache):
    model = net()
    first = amppass.convert(model, X, "bf16")
    report = amppass.report(first)
    regions = report.info["profitability"]["regions"]
    assert regions and all(r["timing"] in ("measured", "prior") for r in regions)
    assert report.info["profitability"]["device"]["timing_cache"].startswith(str(cache))
    assert "how the speed of each group of connected ops was known:" in report.summary()
    for row in report.rows:  # a kept original module's one row says why with the whole model's times
        if row.evidence.get("rule") == "profitability":
            assert row.evidence["timing"] in ("measured", "prior") and ("measured" in row.reason
                                                                       or "device prior" in row.reason)
    cost_model.forget()
    again = amppass.convert(model, X, "bf16")
    assert all(
        after == "cached" for before, after in zip(_timing(first), _timing(again), strict=False) if before == "measured"
    )
    table = amppass.convert(model, X, "bf16", costs=report.info["costs"])
    assert set(_timing(table)) == {"table"} and _outcome(table) == _outcome(first)


def test_timings_disturbed_by_load_fall_back_to_the_prior_and_are_never_cached(cache, monkeypatch):
    def disturbed(calls, sides, settled, max_rounds, **options):  # every round had a sample that waited
        return Timings([1e-3] * len(calls), [], 3)

    _time_with(monkeypatch, disturbed)
    model = net()
    converted = amppass.convert(model, X, "bf16")
    assert set(_timing(converted)) == {"prior"}
    report = amppass.report(converted)
    for row in report.rows:
        if row.evidence.get("rule") == "profitability":
            assert "estimated from the device prior" in row.reason and row.evidence["timing"] == "prior"
    stored = TimingCache(device.fingerprint(torch.device("cpu"))).entries
    assert set(stored) == {f"probe|bf16|{k}" for k in PROBE}  # the prior's estimates are not timings
    again = amppass.convert(model, X, "bf16", costs=report.info["costs"])
    assert _outcome(again) == _outcome(converted)  # the recorded table reproduces a prior-decided plan


def test_a_cpu_without_native_bf16_keeps_fp32_without_timing_a_kernel(cache, monkeypatch, caplog):
    monkeypatch.setattr(device, "cpu_facts", lambda: AVX2)
    # the line is said once per process: on an AVX2 machine an earlier test may have said it already
    monkeypatch.setattr(importlib.import_module("amppass.pipelines.stages"), "_WARNED", set())

    def never(*args, **kwargs):
        raise AssertionError("a kernel was timed on a device where nothing can win")

    monkeypatch.setattr(cost_model, "interleaved", never)
    monkeypatch.setattr(cost_model, "probe", never)
    monkeypatch.setattr(
        region_timing, "whole_model", lambda *args, **kwargs: None
    )  # the graph against eager: not a kernel timing
    model = net()
    with caplog.at_level(logging.WARNING, logger="amppass"):
        first = amppass.convert(model, X, "bf16")
        amppass.convert(model, X, "bf16")
    said = [r.message for r in caplog.records if "none of amx_bf16" in r.message]
    assert len(said) == 1 and "without timing" in said[0]  # one line, once per process
    report = amppass.report(first)
    assert report.info["profitability"]["device"]["native_low"] is False
    assert set(_timing(first)) == {"device"} and all(runs == "fp32" for _, runs in _outcome(first))
    assert "not timed: this CPU has none of amx_bf16" in report.summary()
    # nothing runs low: the original itself comes back (never slower than it), saying why
    assert isinstance(first, Fp32Original) and [r.precision for r in report.rows] == ["fp32"]
    assert "nothing in the plan runs low" in report.rows[0].reason and "none of amx_bf16" in report.rows[0].reason


def test_a_given_table_decides_even_on_a_device_without_native_support(cache, monkeypatch):
    """costs= keeps a conversion deterministic: a table made where bf16 wins gives the same plan here."""
    model = net()
    made = amppass.convert(model, X, "bf16", costs=None)
    costs = amppass.report(made).info["costs"]
    monkeypatch.setattr(device, "cpu_facts", lambda: AVX2)
    again = amppass.convert(model, X, "bf16", costs=costs)
    assert _outcome(again) == _outcome(made) and set(_timing(again)) == {"table"}


def test_where_the_flags_cannot_be_read_the_device_is_probed_once_and_the_probe_cached(cache, monkeypatch):
    monkeypatch.setattr(device, "cpu_facts", lambda: device.CpuFacts("unknown", frozenset()))
    probes = []

    def probe(dev, low, rounds=7):
        probes.append(low.name)
        return {"gemm_fp32": 1e-4, "gemm_low": 3e-3, "copy_fp32": 2e-3, "call": 3e-6}, 0.01  # 30x slower low

    monkeypatch.setattr(cost_model, "probe", probe)
    facts = cost_model.DeviceFacts(torch.device("cpu"), low_type("bf16"))
    assert probes == ["bf16"] and facts.native.known and not facts.native.native
    assert "probed 30.00x" in facts.native.reason
    cost_model.forget()
    again = cost_model.DeviceFacts(torch.device("cpu"), low_type("bf16"))
    assert probes == ["bf16"] and not again.native.native  # read back from the cache, not probed again


def test_a_probe_with_no_undisturbed_round_says_so_in_words(cache, monkeypatch, caplog):
    """The log line a busy machine gives names what happened, never a spread of "inf%"."""
    monkeypatch.setattr(device, "cpu_facts", lambda: device.CpuFacts("unknown", frozenset()))
    monkeypatch.setattr(cost_model, "probe", lambda dev, low, rounds=7: (dict(PROBE), float("inf")))
    with caplog.at_level(logging.INFO, logger="amppass"):
        cost_model.DeviceFacts(torch.device("cpu"), low_type("fp16"))
    assert "no round of it was undisturbed" in caplog.text and "inf%" not in caplog.text


def test_AMPPASS_CACHE_off_reads_and_writes_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with timing_cache("off"):
        converted = amppass.convert(net(), X, "bf16")
    assert amppass.report(converted).info["profitability"]["device"]["timing_cache"] == "off (AMPPASS_CACHE=off)"
    assert list(tmp_path.iterdir()) == []


def test_whole_model_times_are_cached_under_the_converted_graph_s_own_digest(cache, monkeypatch):
    """A later conversion of the same model reads the comparison with the original from the cache; a model
    of the same class and input shapes but other layer sizes does not."""
    def steady(calls, sides, settled, max_rounds, **options):  # converted 1 ms, original 2 ms: agreed
        return Timings([1e-3, 2e-3] if sides == [1, 0] else [1e-3] * len(calls), [0.5] * 9, 9)

    _time_with(monkeypatch, steady)
    first = amppass.convert(net(), X, "bf16")
    assert amppass.report(first).info["whole_model"] == {"converted_ms": 1.0, "original_ms": 2.0}

    def never(*args, **kwargs):
        raise AssertionError("timed again")

    _time_with(monkeypatch, never)
    cost_model.forget()
    again = amppass.convert(net(), X, "bf16")
    assert amppass.report(again).info["whole_model"] == {"converted_ms": 1.0, "original_ms": 2.0}

    torch.manual_seed(0)
    wider = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.LayerNorm(256),
                          nn.Linear(256, 64)).eval()
    sides = []
    _time_with(monkeypatch, lambda *a, **k: sides.append(a[1]) or steady(*a, **k))
    amppass.convert(wider, X, "bf16")
    assert [1, 0] in sides  # its whole-model comparison (converted, original) was timed, not read
