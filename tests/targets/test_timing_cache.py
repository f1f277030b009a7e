"""The device facts profitability rests on: the timing cache on disk, the device fingerprint it is keyed by,
native low-precision support from ISA flags, disturbed-sample filtering, and the device prior.

Nothing here depends on the CPU that runs it: CPU facts are injected (``device.cpu_facts``), and every cache
lives in a temporary folder.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from amppass.dtypes import low_type
from amppass.targets import device, measure, timing_cache
from amppass.targets.timing_cache import TimingCache

BF16, FP16 = low_type("bf16"), low_type("fp16")
SAPPHIRE = device.CpuFacts("Intel(R) Xeon(R) Platinum 8481C", frozenset(
    {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "sse4_2"}))
AVX2 = device.CpuFacts("AMD EPYC 7B12", frozenset({"avx2", "fma", "sse4_2"}))


def fingerprint_of(monkeypatch, facts: device.CpuFacts) -> dict:
    monkeypatch.setattr(device, "cpu_facts", lambda: facts)
    return device.fingerprint(torch.device("cpu"))


def test_the_cache_folder_follows_AMPPASS_CACHE_then_XDG_CACHE_HOME(monkeypatch, tmp_path):
    monkeypatch.delenv("AMPPASS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert timing_cache.folder() == tmp_path / "xdg" / "amppass" / "timings"
    monkeypatch.setenv("AMPPASS_CACHE", str(tmp_path / "mine"))
    assert timing_cache.folder() == tmp_path / "mine"
    for off in ("off", "0", "false", "NONE", " no "):
        monkeypatch.setenv("AMPPASS_CACHE", off)
        assert timing_cache.folder() is None
    cache = TimingCache({"device": "cpu"})
    cache.add({"k": 1.0})  # disabled: nothing written, nothing raised
    assert not cache.enabled and cache.describe().startswith("off")
    assert not (tmp_path / "xdg").exists() and not (tmp_path / "mine").exists()


def test_the_fingerprint_names_cpu_isa_versions_and_threads(monkeypatch):
    found = fingerprint_of(monkeypatch, SAPPHIRE)
    assert found["cpu"] == SAPPHIRE.model and found["isa"] == sorted(SAPPHIRE.flags & set(device.ISA_FLAGS))
    assert "sse4_2" not in found["isa"]  # only the flags low-precision speed depends on
    assert found["torch"] == torch.__version__ and found["onednn"] and found["capability"]
    assert found["threads"] == torch.get_num_threads()
    other = fingerprint_of(monkeypatch, AVX2)
    assert device.digest(other) != device.digest(found)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert device.digest(fingerprint_of(monkeypatch, SAPPHIRE)) != device.digest(found)
    finally:
        torch.set_num_threads(threads)


def test_entries_persist_per_fingerprint_and_a_changed_fingerprint_reads_none(monkeypatch, tmp_path):
    found = fingerprint_of(monkeypatch, SAPPHIRE)
    TimingCache(found, tmp_path).add({"aten.linear|float32[4, 64]|cpu": 2e-6})
    TimingCache(found, tmp_path).add({"cast|[4, 64]|float32->bfloat16|cpu": 1e-6})
    assert TimingCache(found, tmp_path).entries == {"aten.linear|float32[4, 64]|cpu": 2e-6,
                                                    "cast|[4, 64]|float32->bfloat16|cpu": 1e-6}
    for change in ({"threads": found["threads"] + 1}, {"torch": "9.9.9"}, {"onednn": "0.1"}, {"isa": ["avx2"]}):
        assert TimingCache({**found, **change}, tmp_path).entries == {}
    # a file under this digest holding another fingerprint (a collision, a hand edit) is not this device's
    path = TimingCache(found, tmp_path).path
    path.write_text(json.dumps({"fingerprint": {**found, "cpu": "other"}, "entries": {"k": 1.0}}))
    assert TimingCache(found, tmp_path).entries == {}


def test_the_cache_keeps_the_entries_written_last_and_deletes_device_files_long_unwritten(monkeypatch, tmp_path):
    """A cache that only grows fills the disk over years of conversions: each file keeps MAX_ENTRIES, those
    written last (one measured again counts as new), and a device file not written for STALE_DAYS days
    (an older torch's) is deleted by the next write into the folder."""
    monkeypatch.setattr(timing_cache, "MAX_ENTRIES", 4)
    found = fingerprint_of(monkeypatch, SAPPHIRE)
    cache = TimingCache(found, tmp_path)
    cache.add({f"k{i}": float(i) for i in range(3)})
    cache.add({"k0": 9.0, "k3": 3.0, "k4": 4.0})  # k0 measured again; k1 and k2 are the oldest
    assert TimingCache(found, tmp_path).entries == {"k2": 2.0, "k0": 9.0, "k3": 3.0, "k4": 4.0}
    old, recent = (TimingCache({**found, "torch": version}, tmp_path) for version in ("1.0.0", "2.0.0"))
    old.add({"k": 1.0}), recent.add({"k": 1.0})
    long_ago = time.time() - (timing_cache.STALE_DAYS + 1) * 86400
    os.utime(old.path, (long_ago, long_ago))
    cache.add({"k5": 5.0})
    assert not old.path.exists() and not old.path.with_suffix(".lock").exists()
    assert recent.path.exists() and TimingCache({**found, "torch": "2.0.0"}, tmp_path).entries == {"k": 1.0}


def test_a_corrupt_cache_file_reads_as_empty_and_the_next_update_replaces_it(monkeypatch, tmp_path):
    found = fingerprint_of(monkeypatch, SAPPHIRE)
    path = TimingCache(found, tmp_path).path
    path.write_text('{"fingerprint": {"dev')  # a file cut short by something else
    cache = TimingCache(found, tmp_path)
    assert cache.entries == {}
    cache.add({"k": 3e-6})
    assert json.loads(path.read_text())["entries"] == {"k": 3e-6}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".amppass-")] == []  # no temporaries left


def test_an_unwritable_cache_folder_is_logged_and_the_conversion_goes_on(monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = TimingCache(fingerprint_of(monkeypatch, SAPPHIRE), blocker / "timings")
    with caplog.at_level(logging.WARNING, logger="amppass"):
        cache.add({"k": 1.0})
    assert "not written" in caplog.text and "AMPPASS_CACHE" in caplog.text and not cache.enabled


def test_an_unwritable_cache_folder_is_warned_about_once_per_process(monkeypatch, tmp_path, caplog):
    """A conversion opens the cache twice (regions, then the whole model) and a script converts many models:
    the user is told once, not once per cache opened."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    found = fingerprint_of(monkeypatch, SAPPHIRE)
    with caplog.at_level(logging.WARNING, logger="amppass"):
        for _ in range(3):
            TimingCache(found, blocker / "timings").add({"k": 1.0})
    assert caplog.text.count("not written") == 1


def test_entries_that_are_not_finite_times_read_as_absent(monkeypatch, tmp_path):
    """A hand-edited file: JSON's Infinity/NaN, booleans, negative or non-numeric values are not times."""
    found = fingerprint_of(monkeypatch, SAPPHIRE)
    path = TimingCache(found, tmp_path).path
    path.write_text('{"fingerprint": %s, "entries": {"ok": 2e-06, "inf": Infinity, "nan": NaN, "yes": true, '
                    '"neg": -1.0, "text": "1e-6", "zero": 0}}' % json.dumps(found))
    assert TimingCache(found, tmp_path).entries == {"ok": 2e-6, "zero": 0.0}


_WRITER = """
import pathlib, sys
from amppass.targets.timing_cache import TimingCache
for i in range(40):
    TimingCache({"device": "cpu", "format": 1}, pathlib.Path(sys.argv[1])).add({f"{sys.argv[2]}|{i}": i * 1e-6})
"""


def _write_at_once(folder, start_writers) -> None:
    """Writers add 40 entries each while this thread reads the file: every read is a whole JSON file, and in
    the end no writer's entry is lost."""
    found = {"device": "cpu", "format": 1}
    path = TimingCache(found, folder).path
    wait = start_writers()
    reads = 0
    while not wait():
        if path.exists():
            json.loads(path.read_text())  # always a whole file: the old one or the new one
            reads += 1
        time.sleep(0.001)
    entries = TimingCache(found, folder).entries
    assert set(entries) == {f"w{n}|{i}" for n in range(4) for i in range(40)} and reads > 0


def test_threads_writing_at_once_keep_every_entry_and_readers_never_see_half_a_file(tmp_path):
    def start():
        def write(name):
            for i in range(40):
                TimingCache({"device": "cpu", "format": 1}, tmp_path).add({f"{name}|{i}": i * 1e-6})

        writers = [threading.Thread(target=write, args=(f"w{n}",)) for n in range(4)]
        for writer in writers:
            writer.start()
        return lambda: not any(w.is_alive() for w in writers)

    _write_at_once(tmp_path, start)


@pytest.mark.slow  # four interpreters importing torch at once: about 20 s on the shared 2-core machine
def test_processes_writing_at_once_keep_every_entry_and_readers_never_see_half_a_file(tmp_path):
    writers = []

    def start():
        writers.extend(subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), f"w{n}"]) for n in range(4))
        return lambda: all(w.poll() is not None for w in writers)

    try:
        _write_at_once(tmp_path, start)
    finally:
        for writer in writers:
            writer.kill()
            writer.wait()
    assert all(w.returncode == 0 for w in writers)


@pytest.mark.parametrize("facts, low, native", [
    (SAPPHIRE, BF16, True), (SAPPHIRE, FP16, True), (AVX2, BF16, False), (AVX2, FP16, False),
    (device.CpuFacts("Neoverse-V1", frozenset({"asimd", "bf16", "fphp", "asimdhp", "sve"})), BF16, True),
    (device.CpuFacts("Cortex-A72", frozenset({"asimd", "crc32"})), FP16, False),
])
def test_native_low_precision_comes_from_the_isa_flags(monkeypatch, facts, low, native):
    verdict = device.native_low(fingerprint_of(monkeypatch, facts), low)
    assert verdict.known and verdict.native is native
    if not native:
        assert "none of" in verdict.reason and "slower than fp32" in verdict.reason


def test_without_flags_the_probe_decides_and_on_a_gpu_the_compute_capability(monkeypatch):
    unknown = fingerprint_of(monkeypatch, device.CpuFacts("unknown", frozenset()))
    assert not device.native_low(unknown, BF16).known  # nothing to go on yet: the caller probes
    slow = {"gemm_fp32": 1e-3, "gemm_low": 2e-2, "copy_fp32": 1e-3, "call": 1e-6}
    assert device.native_low(unknown, BF16, slow).native is False
    assert device.native_low(unknown, BF16, {**slow, "gemm_low": 4e-4}).native is True
    gpu = {"device": "cuda", "name": "Tesla T4", "capability": "7.5"}
    assert device.native_low(gpu, FP16).native and not device.native_low(gpu, BF16).native


def test_disturbed_rounds_are_left_out_of_the_comparison(monkeypatch):
    """A sample during which the process waited for a CPU is dropped with its round; with no round
    undisturbed, measuring gives up (at once where the first timing of every call waited)."""
    reads = {"count": 0, "total": 0.0}

    def fake_waited() -> float:
        """Cumulative wait: two reads per sample (before, after), two calls, so reads 0-3 are the warm-up
        and round k's first sample ends at read 5 + 4k; in rounds 1 and 2 that sample waited a second."""
        index = reads["count"]
        reads["count"] += 1
        if index >= 4 and (index - 5) % 4 == 0 and (index - 5) // 4 in (1, 2):
            reads["total"] += 1.0
        return reads["total"]

    monkeypatch.setattr(measure, "waited", fake_waited)
    found = measure.interleaved([lambda: None, lambda: None], [0, 1], lambda ratios: len(ratios) >= 5, 10)
    assert found.rounds == 7 and len(found.ratios) == 5  # rounds 1 and 2 left out, two more taken
    monkeypatch.setattr(measure, "waited", lambda: time.perf_counter())  # every sample waits all along
    given_up = measure.interleaved([lambda: sum(range(100))] * 2, [0, 1], lambda ratios: len(ratios) >= 9, 18)
    assert given_up.rounds == 0 and given_up.ratios == [] and measure.spread(given_up.ratios) == float("inf")


def test_steal_time_a_hypervisor_took_disturbs_a_sample_its_scheduler_cannot_see(monkeypatch, tmp_path):
    """On a virtual machine the hypervisor runs other guests on its CPUs; the guest's schedstat does not see it,
    ``/proc/stat``'s steal column does (clock ticks). A sample during which a tick was stolen is disturbed."""
    stat = tmp_path / "stat"
    ticks = {"steal": 0}

    def fake_open(path, mode="r", *args, **kwargs):
        if path == "/proc/stat":
            stat.write_text(f"cpu  10 0 10 100 0 0 0 {ticks['steal']} 0 0\ncpu0 5 0 5 50 0 0 0 0 0 0\n")
            return real_open(stat, mode, *args, **kwargs)
        return real_open(path, mode, *args, **kwargs)

    real_open = open
    monkeypatch.setattr("builtins.open", fake_open)
    monkeypatch.setattr(measure, "_run_delay", lambda: 0.0)
    ticks["steal"] = 7
    assert measure.stolen() == pytest.approx(7 / os.sysconf("SC_CLK_TCK"))

    def stealing():
        ticks["steal"] += 1  # every call loses a tick to another guest
    found = measure.interleaved([stealing, stealing], [0, 1], lambda ratios: len(ratios) >= 3, 6)
    assert found.rounds == 0 and found.ratios == []
    calm = measure.interleaved([lambda: None, lambda: None], [0, 1], lambda ratios: len(ratios) >= 3, 6)
    assert len(calm.ratios) == 3


def test_spread_is_the_interquartile_range_over_the_median():
    assert measure.spread([1.0] * 9) == 0
    assert measure.spread([0.5, 0.5, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0]) > 1
    assert measure.spread([0.9, 1.0, 1.1]) == pytest.approx(0.2)


def test_rounds_tell_a_comparison_when_narrow_or_when_the_median_s_interval_excludes_the_threshold():
    wide_but_fast = [1.03, 0.76, 0.85, 0.57, 0.73, 0.61, 0.78, 0.57, 1.39]  # a real region on a calm machine
    assert measure.spread(wide_but_fast) > 0.25 and measure.agree(wide_but_fast, 0.95, 0.25)
    straddling = [0.6, 1.3, 0.7, 1.2, 0.8, 1.1, 0.9, 1.4, 0.65]
    assert not measure.agree(straddling, 0.95, 0.25)
    assert measure.agree([0.94, 0.96, 0.95, 0.95], 0.95, 0.25)  # narrow: the median decides a near-even region
    assert not measure.agree([0.5, 0.5], 0.95, 0.25)  # too few undisturbed rounds
