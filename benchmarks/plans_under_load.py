"""Plans under load: the speed plan made on a quiet machine, and made while 4 busy processes share its cores.

For every zoo model (``models/zoo.py``) at batch 1 (sequence 16), bf16 on this CPU, the default speed plan
(``amppass.convert(model, inputs, "bf16")``) is made three times, each starting without the times this
process measured before (:func:`amppass.targets.cost_model.forget`):

- ``quiet``: on the machine as it is, with an empty timing cache (a fresh ``AMPPASS_CACHE`` folder);
- ``busy, empty cache``: while :data:`BUSY` busy-looping processes run (4 on this 2-core machine), again
  with an empty cache: the regions whose timings load disturbed are decided on the device prior;
- ``busy, quiet cache``: under the same load, with the cache the quiet plan filled.

Columns: ``heavy`` the matmul/conv/attention nodes of the converted graph; ``low_*`` how many of them run
bf16 in each plan ("kept fp32" where the whole original module was kept, measured faster);
``same_as_quiet`` whether that plan gives every node the quiet plan's precision; ``timing_*`` how many
regions each source decided (measured, cached, prior, device); ``convert_s_*`` the conversion time.
Then, on the machine as it is again (the busy processes ended): ``quiet_ms`` and ``busy_empty_ms``, the
latencies of the quiet plan and of the busy plan with an empty cache, with ``fp32_ms`` and ``autocast_ms``
(medians of interleaved rounds, ``benchmarks.latency.time_interleaved``), and ``load_busy``, the 1-minute
load average when the busy plans were made.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

import torch

import amppass
from amppass.serving.fp32_original import Fp32Original
from models import ZOO, build
from tests.helpers.load import busy_processes, timing_cache

from .latency import time_interleaved

NOTES = __doc__.split("\n\n", 1)[1]


def _plan(model: torch.nn.Module, inputs: tuple, kwargs: dict) -> tuple[torch.nn.Module, dict[str, Any], float]:
    start = time.perf_counter()
    converted = amppass.convert(model, inputs, "bf16", example_kwargs=kwargs or None)
    seconds = time.perf_counter() - start
    report = amppass.report(converted)
    precisions = {r.name: r.precision for r in report.rows}
    heavy = [r for r in report.rows if r.evidence.get("macs")]
    profitability = report.info.get("profitability", {})
    return converted, {
        "kept": isinstance(converted, Fp32Original), "precisions": precisions, "heavy": len(heavy),
        "low": sum(r.precision == "bf16" for r in heavy),
        "timing": " ".join(f"{n} {s}" for s, n in profitability.get("timing", {}).items()) or "-",
    }, seconds


def _low(found: dict[str, Any]) -> Any:
    return "kept fp32" if found["kept"] else found["low"]


def measure(name: str, size: str, repeats: int) -> dict[str, Any]:
    """One row: the three plans of the model, then the latencies of two of them on the machine as it is."""
    case = build(name, size=size, batch=1, seq=16)
    model, inputs, kwargs = case.model, case.example_inputs, case.example_kwargs
    with tempfile.TemporaryDirectory() as quiet_cache, tempfile.TemporaryDirectory() as empty_cache:
        with timing_cache(quiet_cache):
            quiet, quiet_plan, quiet_s = _plan(model, inputs, kwargs)
        with busy_processes():
            load_busy = os.getloadavg()[0]
            with timing_cache(empty_cache):
                busy, busy_plan, busy_s = _plan(model, inputs, kwargs)
            with timing_cache(quiet_cache):
                _, cached_plan, cached_s = _plan(model, inputs, kwargs)
            load_busy = max(load_busy, os.getloadavg()[0])

    def autocast() -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(*inputs, **kwargs)

    calls = {"fp32": lambda: model(*inputs, **kwargs), "autocast": autocast,
             "quiet": lambda: quiet(*inputs, **kwargs), "busy_empty": lambda: busy(*inputs, **kwargs)}
    with torch.inference_mode():
        samples = time_interleaved(calls, 2, repeats)
    ms = {key: statistics.median(values) * 1e3 for key, values in samples.items()}
    reference = quiet_plan["precisions"]
    return {
        "model": f"{name}-{size}", "heavy": max(p["heavy"] for p in (quiet_plan, busy_plan, cached_plan)),
        "low_quiet": _low(quiet_plan), "low_busy_empty": _low(busy_plan), "low_busy_cached": _low(cached_plan),
        "same_as_quiet_empty": busy_plan["precisions"] == reference,
        "same_as_quiet_cached": cached_plan["precisions"] == reference,
        "timing_quiet": quiet_plan["timing"], "timing_busy_empty": busy_plan["timing"],
        "timing_busy_cached": cached_plan["timing"],
        "convert_s_quiet": quiet_s, "convert_s_busy_empty": busy_s, "convert_s_busy_cached": cached_s,
        "quiet_ms": ms["quiet"], "busy_empty_ms": ms["busy_empty"], "fp32_ms": ms["fp32"],
        "autocast_ms": ms["autocast"], "load_busy": round(load_busy, 1),
    }


QUICK = "mlp"  # --quick: the small MLP, converted in well under a second: the busy processes spin that long


def run(quick: bool) -> list[dict[str, Any]]:
    """Every zoo model (quick: the small MLP) at batch 1."""
    names, size = ((QUICK,), "small") if quick else (ZOO, "base")
    return [measure(name, size, 3 if quick else 9) for name in names]
