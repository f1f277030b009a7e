"""Timing on a shared machine: interleaved comparisons that leave out what load disturbed, and the device probe.

A kernel timed alone on a busy machine measures the load as much as the kernel. Load does not even hit the
two sides of a comparison alike: on this project's 2-core machine at a load of 4.5, a 4x256x64 linear took
12 µs in fp32 (MKL runs it on one thread) and 13.5 ms in bf16 (oneDNN runs it on both threads, and every
parallel region waits for the descheduled worker): a thousandfold ratio that is all load. So profitability
compares fp32 and low-precision kernels in interleaved rounds (:func:`interleaved`): each sample notes how
long this process's threads waited for a CPU meanwhile (Linux schedstat, :func:`waited`), and on a virtual
machine how long the hypervisor took its CPUs (steal time, :func:`stolen`); a round with a disturbed sample
is left out, and the comparison counts only when enough undisturbed rounds agree
(:func:`agree`). On a machine too busy for that, the caller falls back to cached times or a prior.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..dtypes import LowType

PROBE_SIZE = 256  # the probe multiplies two square matrices of this side
PROBE_COPY = 1 << 22  # and copies an fp32 tensor of this many values
WAIT_SHARE = 0.05  # a sample is disturbed when this process's threads waited for a CPU this share of it


def probe(device: torch.device, low: LowType, rounds: int = 7) -> tuple[dict[str, float], float]:
    """Once per device and dtype: seconds of a square matrix product in fp32 and in ``low``, of copying a
    large fp32 tensor, and of a tiny op (call overhead), with the spread of the interleaved product
    ratios (:func:`interleaved`). :mod:`amppass.targets.prior` derives a device's cost prior from these."""
    n = PROBE_SIZE
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a_low, b_low = a.to(low.torch), b.to(low.torch)
    big, tiny = torch.randn(PROBE_COPY, device=device), torch.ones(1, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    calls = [lambda: a @ b, lambda: a_low @ b_low, big.clone, lambda: tiny + tiny]
    found = interleaved(calls, [0, 1, None, None], lambda ratios: len(ratios) >= rounds, 2 * rounds, sync=sync)
    return dict(zip(("gemm_fp32", "gemm_low", "copy_fp32", "call"), found.medians, strict=False)), spread(found.ratios)


@dataclass
class Timings:
    """What :func:`interleaved` found: each call's median seconds over its undisturbed samples, the ratio of
    each undisturbed round, and how many rounds ran."""

    medians: list[float]
    ratios: list[float]
    rounds: int


def interleaved(calls: list[Callable[[], Any]], sides: list[int | None], settled: Callable[[list[float]], bool],
                max_rounds: int, weights: list[int] | None = None, sync: Callable[[], None] | None = None,
                sample_s: float = 1e-3) -> Timings:
    """Time ``calls`` in interleaved rounds, so that both sides of a comparison meet the same machine.

    ``sides[i]`` puts call ``i`` on side 0 or 1 of the comparison (None: timed, not compared), counted
    ``weights[i]`` times. Each round times every call once (a sample batches enough calls to take about
    ``sample_s``), side 0 before side 1 in even rounds and after it in odd ones, and yields the ratio
    (weighted sum of side 1) / (weighted sum of side 0). A sample during which this process's threads waited
    for a CPU (:func:`waited`) is disturbed: it and its round are left out.

    Measuring stops once three or more undisturbed rounds are ``settled`` (given their ratios), and after
    ``max_rounds`` rounds in all. It gives up after three rounds none of which was undisturbed, and before
    the first round where the first timing of every call, or of most of eight or more, was disturbed."""
    weights = weights or [1] * len(calls)

    def once(call: Callable[[], Any], repeat: int) -> tuple[float, bool]:
        before = waited()
        start = time.perf_counter()
        for _ in range(repeat):
            call()
        if sync is not None:
            sync()
        seconds = time.perf_counter() - start
        return seconds / repeat, waited() - before > WAIT_SHARE * seconds

    with torch.no_grad():
        repeats, hits = [], 0
        for count, call in enumerate(calls, 1):
            call()  # warm-up: kernel selection, allocator
            seconds, hit = once(call, 1)
            repeats.append(max(1, min(1000, int(sample_s / max(seconds, 1e-7)))))
            hits += hit
            if hits == len(calls) or count >= 8 and hits > count / 2:  # a machine this busy gives no rounds
                return Timings([0.0] * len(calls), [], 0)
        groups = [[i for i, side in enumerate(sides) if side == wanted] for wanted in (0, 1, None)]
        clean: list[list[float]] = [[] for _ in calls]
        every: list[list[float]] = [[] for _ in calls]
        ratios: list[float] = []
        index = 0
        while index < max_rounds and (index < 3 or ratios):
            first, second, rest = groups if index % 2 == 0 else (groups[1], groups[0], groups[2])
            disturbed = False
            for i in first + second + rest:
                seconds, hit = once(calls[i], repeats[i])
                every[i].append(seconds)
                disturbed |= hit
                if not hit:
                    clean[i].append(seconds)
            index += 1
            if not disturbed:
                base, other = (sum(weights[i] * every[i][-1] for i in group) for group in groups[:2])
                ratios.append(other / base if base > 0 else 1.0)
                if len(ratios) >= 3 and settled(ratios):
                    break
    return Timings([statistics.median(c or e) for c, e in zip(clean, every, strict=False)], ratios, index)


def waited() -> float:
    """Seconds this process's threads have spent runnable but waiting for a CPU (Linux schedstat), plus the
    seconds a hypervisor took from this machine's CPUs (:func:`stolen`); 0 where the system does not say."""
    return _run_delay() + stolen()


def stolen() -> float:
    """Seconds of steal time on all CPUs of this (virtual) machine: time the hypervisor ran other guests,
    which the guest's own scheduler, and so schedstat, cannot see (``/proc/stat``, counted in clock ticks of
    10 ms, so a sample is flagged once a whole tick was stolen during it). 0 where the system does not say."""
    try:
        with open("/proc/stat", "rb") as stat:
            fields = stat.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, AttributeError):
        return 0.0


def _run_delay() -> float:
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/schedstat", "rb") as stat:
                total += int(stat.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


def spread(ratios: list[float]) -> float:
    """How far apart a comparison's round ratios lie: their interquartile range over their median (0 for a
    perfectly steady measurement; infinite with no ratio)."""
    if not ratios:
        return float("inf")
    low, middle, high = _quartiles(ratios)
    return (high - low) / middle if middle > 0 else float("inf")


def agree(ratios: list[float], threshold: float, limit: float) -> bool:
    """Whether undisturbed rounds tell a comparison against ``threshold``: at least three of them, and either
    narrow (:func:`spread` at most ``limit``: the median decides even a near-even comparison) or with
    ``threshold`` outside the median's notch, ``median ± 1.57 IQR / sqrt(n)`` (the approximate 95% interval
    of a median that box plots draw, McGill, Tukey and Larsen 1978): a wide spread that cannot change the
    answer."""
    if len(ratios) < 3:
        return False
    low, middle, high = _quartiles(ratios)
    notch = 1.57 * (high - low) / math.sqrt(len(ratios))
    return spread(ratios) <= limit or middle + notch < threshold or middle - notch > threshold


def _quartiles(ratios: list[float]) -> tuple[float, float, float]:
    """Lower quartile, median and upper quartile (with fewer than four values: smallest, median, largest)."""
    if len(ratios) < 4:
        return min(ratios), statistics.median(ratios), max(ratios)
    low, middle, high = statistics.quantiles(ratios, n=4)
    return low, middle, high
