"""Load and timing-cache settings for tests and benchmarks of plans made under load."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from typing import Iterator

from amppass.targets import cost_model, device

BUSY = 4  # busy processes: twice the cores of a 2-core machine
_SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


@contextlib.contextmanager
def busy_processes(count: int = BUSY, seconds: float = 600.0) -> Iterator[list[subprocess.Popen]]:
    """``count`` processes that each keep one core busy for the block, at most ``seconds`` (each also ends
    by itself then, should this process die first); every one is killed and reaped when the block ends."""
    spinners: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            spinners.append(subprocess.Popen([sys.executable, "-c", _SPIN.format(seconds=seconds)],
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(0.5)  # interpreters started and spinning
        yield spinners
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()


@contextlib.contextmanager
def timing_cache(folder: str) -> Iterator[None]:
    """Conversions in the block use the timing cache in ``folder`` and nothing this process measured before."""
    before = os.environ.get("AMPPASS_CACHE")
    os.environ["AMPPASS_CACHE"] = folder
    cost_model.forget()
    try:
        yield
    finally:
        cost_model.forget()
        if before is None:
            os.environ.pop("AMPPASS_CACHE", None)
        else:
            os.environ["AMPPASS_CACHE"] = before


NATIVE_BF16 = device.CpuFacts("Test CPU with AMX", frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_fp16",
                                                              "amx_tile", "amx_bf16"}))


def native_bf16_cpu(monkeypatch) -> None:
    """For one test, the CPU's flags say native bf16 (and fp16, as a Sapphire Rapids' AMX and avx512_fp16 do)
    whatever machine runs it: on an AVX2-only CPU the profitability rule keeps every region fp32 without timing a
    kernel, and a train-mode plan for speed is the original in fp32; a test of the timing, or of the plan a CPU with
    those instructions gets, needs it."""
    monkeypatch.setattr(device, "cpu_facts", lambda: NATIVE_BF16)


@contextlib.contextmanager
def read_as_native_cpu() -> Iterator[None]:
    """:func:`native_bf16_cpu` for the block, where there is no ``monkeypatch`` (the zoo harnesses' steps)."""
    real = device.cpu_facts
    device.cpu_facts = lambda: NATIVE_BF16
    try:
        yield
    finally:
        device.cpu_facts = real


AVX2 = device.CpuFacts("Test CPU with AVX2 only", frozenset({"avx", "avx2", "fma"}))


def avx2_cpu(monkeypatch) -> None:
    """For one test, the CPU's flags say AVX2 only (no bf16 or fp16 instructions, as most laptops and CI runners)
    whatever machine runs it: a plan for speed keeps every op fp32 there without timing a kernel."""
    monkeypatch.setattr(device, "cpu_facts", lambda: AVX2)
