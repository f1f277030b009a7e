"""Inference latency, output error, weight bytes and peak memory: fp32 against bf16 done four ways.

For each model and input shape, in one process and on the same inputs:

- ``fp32``: the model as built, eager.
- ``autocast``: the same model under ``torch.autocast("cpu", dtype=torch.bfloat16)``.
- ``bf16_model``: a deep copy converted with ``.bfloat16()`` (floating inputs cast to bf16 too).
- ``amppass``: ``amppass.convert(model, inputs, torch.bfloat16)``; ``amppass_lowtables`` adds
  ``low_weight_tables=True``. Each is converted once per shape and the conversion time is kept.

Everything runs under ``torch.inference_mode()``. After warm-up the variants are timed interleaved
(one call of each per round, so load from other processes hits them alike) and the median is kept.

Error is ``||out - ref|| / ||ref||`` over all floating outputs, against fp32 and against an fp64 copy
(``.double()``) of the model. Peak memory is the high-water mark of torch's CPU allocations made during
one forward call, read from ``torch.profiler`` memory events: activations plus any weight copies the
call makes (autocast re-casts weights on every call), not counting the weights already resident.
Process RSS is not used: the allocator keeps freed pages and models built earlier in the same process
would hide the figure.
"""

from __future__ import annotations

import copy
import functools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

import amppass
from amppass.pipelines.stages import weight_bytes
from models import build
from tests.helpers.numerics import rel_error

LOW = torch.bfloat16
VARIANTS = ("fp32", "autocast", "bf16_model", "amppass", "amppass_lowtables")


@dataclass(frozen=True)
class Setting:
    """One benchmark point: a zoo model at a size and input shape."""

    model: str
    size: str
    batch: int
    seq: int

    @property
    def label(self) -> str:
        return f"{self.model}-{self.size} {self.batch}x{self.seq}"


def settings(quick: bool) -> list[Setting]:
    """The target points (BERT and GPT-2 at 1x16 and 8x128); full mode adds the rest of the zoo at batch 1.
    ``quick``: the small BERT at 1x16 alone, a smoke run of every column (the profile reuses its conversions)."""
    if quick:
        return [Setting("bert", "small", 1, 16)]
    points = [Setting(m, "base", b, s) for m in ("bert", "gpt2") for b, s in ((1, 16), (8, 128))]
    return points + [Setting(m, "base", 1, 16) for m in ("mlp", "cnn", "resnet", "vit", "llama")]


@dataclass
class _Variant:
    call: Callable[[], Any]
    module: torch.nn.Module
    convert_s: float | None = None


def _cast_floats(inputs: tuple, dtype: torch.dtype) -> tuple:
    return tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)


def _variants(model: torch.nn.Module, inputs: tuple) -> dict[str, _Variant]:
    def autocast() -> Any:
        with torch.autocast("cpu", dtype=LOW):
            return model(*inputs)

    bf16 = copy.deepcopy(model).to(LOW)
    bf16_inputs = _cast_floats(inputs, LOW)
    found = {
        "fp32": _Variant(lambda: model(*inputs), model),
        "autocast": _Variant(autocast, model),
        "bf16_model": _Variant(lambda: bf16(*bf16_inputs), bf16),
    }
    for name, tables in (("amppass", False), ("amppass_lowtables", True)):
        start = time.perf_counter()
        gm = amppass.convert(model, inputs, LOW, low_weight_tables=tables)
        found[name] = _Variant(lambda gm=gm: gm(*inputs), gm, time.perf_counter() - start)
    return found


@functools.lru_cache(maxsize=1)
def _built(point: Setting) -> tuple[Any, dict[str, _Variant]]:
    """The zoo case of ``point`` and its variants, converted under ``torch.inference_mode()``; the last point's
    are kept, so that :func:`profile_top` on the point just measured (the quick run's one point) converts
    nothing again."""
    case = build(point.model, size=point.size, batch=point.batch, seq=point.seq)
    with torch.inference_mode():
        return case, _variants(case.model, case.example_inputs)


def peak_alloc_bytes(call: Callable[[], Any]) -> int:
    """High-water mark of torch CPU allocations during one ``call()`` (profiler memory events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    return peak_of(prof)


def peak_of(prof: profile) -> int:
    """High-water mark of the torch CPU allocations a finished ``profile(profile_memory=True)`` recorded."""
    # The raw kineto events hold every allocation (+) and free (-); FunctionEvent totals hide their order.
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def time_interleaved(calls: dict[str, Callable[[], Any]], warmup: int, repeats: int,
                 sample_s: float = 0.02) -> dict[str, list[float]]:
    """Seconds per call of each variant, one sample per round.

    Each round times every variant once, in an order rotated from round to round (on this CPU a variant run
    right after bf16 kernels can run a few percent slower). ``repeats`` rounds, three times as many where
    every variant takes under 0.2 s; a sample of a fast model averages ``ceil(sample_s / call)`` calls, so
    that it is not one timer tick of noise."""
    first: dict[str, float] = {}
    for _ in range(warmup):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            first[name] = time.perf_counter() - start
    slowest = max(first.values(), default=1.0)
    inner = max(1, math.ceil(sample_s / max(slowest, 1e-6)))
    rounds = repeats if slowest > 0.2 else 3 * repeats
    names = list(calls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            call = calls[name]
            start = time.perf_counter()
            for _ in range(inner):
                call()
            samples[name].append((time.perf_counter() - start) / inner)
    return samples


def measure(point: Setting, warmup: int, repeats: int) -> list[dict]:
    """One row per variant for ``point``: latency, error against fp32 and fp64, bytes, conversion time."""
    case, variants = _built(point)
    model, inputs = case.model, case.example_inputs
    with torch.inference_mode():
        ref32 = model(*inputs)
        ref64 = copy.deepcopy(model).double()(*_cast_floats(inputs, torch.float64))
        outputs = {name: v.call() for name, v in variants.items()}
        samples = time_interleaved({name: v.call for name, v in variants.items()}, warmup, repeats)
        latency = {name: statistics.median(values) for name, values in samples.items()}
        peaks = {name: peak_alloc_bytes(v.call) for name, v in variants.items()}
    fp32_bytes = weight_bytes(model)
    rows = []
    for name, variant in variants.items():
        size = weight_bytes(variant.module)
        rows.append({
            "model": f"{point.model}-{point.size}",
            "shape": f"{point.batch}x{point.seq}" if case.kind == "transformer" else f"batch {point.batch}",
            "variant": name,
            "latency_ms": latency[name] * 1e3,
            "min_ms": min(samples[name]) * 1e3,
            "vs_autocast": latency["autocast"] / latency[name],
            "err_vs_fp32": rel_error(outputs[name], ref32),
            "err_vs_fp64": rel_error(outputs[name], ref64),
            "weight_MB": size / 2**20,
            "weight_ratio": size / fp32_bytes,
            "peak_alloc_MB": peaks[name] / 2**20,
            "convert_s": variant.convert_s,
        })
    return rows


def run(quick: bool) -> list[dict]:
    """Every setting of the mode, one row per (setting, variant)."""
    warmup, repeats = (1, 3) if quick else (3, 9)
    rows: list[dict] = []
    for point in settings(quick):
        rows += measure(point, warmup, repeats)
    return rows


def target_verdict(rows: list[dict]) -> list[dict]:
    """The latency targets per BERT/GPT-2 point: amppass against autocast.

    Targets: >= 1.5x autocast's speed at batch 1, >= 1.0x at batch 8, error against fp32 at most 1.1x
    autocast's (10% slack for rounding noise between two bf16 paths), weight bytes <= 0.55 of fp32.
    """
    verdicts = []
    by_point: dict[tuple[str, str], dict[str, dict]] = {}
    for row in rows:
        by_point.setdefault((row["model"], row["shape"]), {})[row["variant"]] = row
    for (model, shape), found in by_point.items():
        if not model.startswith(("bert", "gpt2")):
            continue
        ac, amp = found["autocast"], found["amppass"]
        speed_target = 1.5 if shape.startswith("1x") else 1.0
        err_ratio = amp["err_vs_fp32"] / ac["err_vs_fp32"]
        verdicts.append(
            {
                "model": model,
                "shape": shape,
                "autocast_ms": ac["latency_ms"],
                "amppass_ms": amp["latency_ms"],
                "speedup": amp["vs_autocast"],
                "speed_target": speed_target,
                "err_ratio": err_ratio,
                "weight_ratio": amp["weight_ratio"],
                "met": "yes"
                if amp["vs_autocast"] >= speed_target and err_ratio <= 1.1 and amp["weight_ratio"] <= 0.55
                else "no",
            }
        )
    return verdicts


def profile_top(point: Setting, ops: int = 8) -> list[dict]:
    """Where the time goes: self CPU time of the heaviest ATen ops, autocast against amppass, one call each."""
    _, variants = _built(point)
    rows = []
    with torch.inference_mode():
        for name in ("autocast", "amppass"):
            call = variants[name].call
            for _ in range(3):
                call()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    call()
            stats = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
            total = sum(e.self_cpu_time_total for e in stats)
            for event in stats[:ops]:
                rows.append({
                    "variant": name,
                    "op": event.key,
                    "calls_per_forward": event.count // 3,
                    "self_ms_per_forward": event.self_cpu_time_total / 3e3,
                    "share": event.self_cpu_time_total / total,
                })
    return rows

