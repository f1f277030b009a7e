"""scripts/demo times fp32, autocast and amppass interleaved, prints each one's spread, and warns when the machine was
busy (bare medians misled: back-to-back runs on a busy machine printed amppass at 41.8, 25.7, 247.6 and 432.9 ms).

The warning's rules are checked on made-up timings, so no test depends on how busy this machine is; one run of
the script itself checks what it prints around them.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "demo"


@pytest.fixture(scope="module")
def demo():
    loader = importlib.machinery.SourceFileLoader("amppass_demo", str(SCRIPT))  # a script without .py
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[loader.name] = module  # dataclasses look their module up there
    loader.exec_module(module)
    yield module
    del sys.modules[loader.name]


def _steady(demo, ms=(10.0, 10.1, 10.2, 9.9, 10.0, 10.1), waited=0.0):
    seconds = [m / 1e3 for m in ms]
    return demo.Timed({"fp32": seconds, "autocast": [s * 1.2 for s in seconds], "amppass": [s * 0.6 for s in seconds]},
                      seconds=1.0, waited=waited)


def test_a_quiet_machine_gets_no_warning(demo):
    assert demo.busy_warning(_steady(demo), load=0.1, cores=4, cpu="Some CPU") is None


def test_a_high_load_average_is_a_warning_naming_the_cpu_and_what_to_do(demo):
    warning = demo.busy_warning(_steady(demo), load=3.5, cores=2, cpu="Intel(R) Xeon(R), torch CPU capability AVX512")
    assert warning.startswith("warning: the machine was busy")
    assert "load average was 3.50 on 2 cores" in warning and "Intel(R) Xeon(R)" in warning
    assert "idle machine" in warning and "uptime" in warning


def test_waiting_for_a_cpu_while_timing_is_a_warning(demo):
    warning = demo.busy_warning(_steady(demo, waited=0.3), load=None, cores=2, cpu="cpu")
    assert "while timing (1.0 s), this process's threads spent 0.3 s in all waiting for a CPU" in warning


def test_a_wide_spread_is_a_warning(demo):
    """The issue's four runs as one run's samples: the spread says what a single median hid."""
    wild = _steady(demo)
    wild.samples["amppass"][:] = [0.0418, 0.0257, 0.2476, 0.4329, 0.0300, 0.0350]
    warning = demo.busy_warning(wild, load=0.1, cores=4, cpu="cpu")
    assert "the middle half of the samples spans" in warning and "for amppass" in warning
    assert "for fp32" not in warning


def test_each_variant_gets_median_quartiles_and_extremes(demo):
    lines = demo.latency_lines(_steady(demo, ms=(10, 11, 12, 13, 14)))
    assert "median" in lines[0] and "IQR" in lines[0] and "min .. max" in lines[0]
    fp32 = next(line for line in lines if line.startswith("fp32"))
    spread = demo.Spread.of([m / 1e3 for m in (10, 11, 12, 13, 14)])
    assert (spread.median, spread.low, spread.high) == pytest.approx((12.0, 10.0, 14.0))
    assert spread.q1 < spread.median < spread.q3
    assert f"{spread.median:6.2f} ms" in fp32 and "10.00 .. " in fp32 and "14.00 ms" in fp32
    assert any(line.startswith("amppass / fp32, round by round: median 0.60") for line in lines)


def test_the_variants_take_turns(demo):
    """Interleaved, not one after another: every round calls each variant once, and the order rotates."""
    calls: list[str] = []

    def call(name: str) -> None:
        calls.append(name)
        time.sleep(0.025)  # a call long enough that each sample times one call, as a model's does

    found = demo.timed({name: (lambda name=name: call(name)) for name in ("a", "b", "c")}, rounds=2)
    timed = calls[2 * 3:]  # after the two warm-up rounds
    rounds = [timed[i:i + 3] for i in range(0, len(timed), 3)]
    assert len(rounds) == found.rounds >= 2 and all(sorted(r) == ["a", "b", "c"] for r in rounds)
    assert rounds[0] != rounds[1]  # the order rotates
    assert found.seconds > 0 and found.waited >= 0


def test_the_demo_runs_and_prints_the_cpu_the_spread_and_the_load():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--no-setup", "--size", "small", "--rounds", "2", "--rows", "3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "CPU: " in out and "torch CPU capability" in out and "load average before" in out
    assert "interleaved rounds" in out and "middle half (IQR)" in out
    assert all(any(line.startswith(name) for line in out.splitlines()) for name in ("fp32", "autocast", "amppass"))
