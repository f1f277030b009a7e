"""Never slower than fp32 or torch.autocast on this machine: amppass's target-aware plans, measured.

For every model of ``models/`` (the zoo and the architectures of ``models/arch.py`` that torch.export
captures whole) at batch 1 and at a large batch, bf16 on this CPU, in one process on the same inputs:
``fp32`` eager, ``autocast`` (``torch.autocast("cpu", torch.bfloat16)``) and ``amppass``
(``amppass.convert(model, inputs, "bf16")``: target "cpu", profitability measured). Latencies are medians
of interleaved rounds (``benchmarks.latency.time_interleaved``: the variants' order rotates from round to
round, and a sample of a fast model averages enough calls to take ~20 ms). Columns:

- ``vs_best`` = amppass's latency / min(fp32, autocast): at most 1.0 is the goal; ``met`` allows 2% for
  timing noise between interleaved medians on a shared 2-core machine.
- ``err_ratio`` = amppass's error / autocast's, each ``||out - out_fp32|| / ||out_fp32||`` over all
  floating outputs (goal: at most 1.1).
- ``fp32_nodes``: nodes profitability kept fp32 (its regions were not faster low here); ``convert_s``: the
  conversion, measurements included.

A second table compiles BERT-base at 1x16 with inductor and freezing (``torch._inductor.config.freezing``):
``torch.compile(amppass_graph)`` against ``torch.compile(model)`` run under autocast; compile time is the
first call's.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Callable

import torch

import amppass
from models import build
from models.arch import ARCHS, build_arch

from .latency import rel_error, time_interleaved
from .results import not_run

NOTES = __doc__.split("\n\n", 1)[1]
LOW = torch.bfloat16
NOISE = 0.02

# (name, builder(batch) -> (model, inputs)); large batches that keep a row under ~1 s per call here
_ZOO_LARGE = {"mlp": 64, "cnn": 8, "resnet": 8, "bert": 8, "gpt2": 8, "vit": 8, "llama": 8}
_ARCH_LARGE = {"lstm": 16, "gru": 16, "transformer_encoder": 16, "mamba": 8, "mistral": 8, "qwen2": 8,
               "t5_small": 8, "distilbert": 8, "audio_cqt": 8}
_SKIP = {"detector", "mistral_cache"}  # not capturable whole by torch.export: the shapes section covers them
QUICK_ZOO, QUICK_ARCHS = ("mlp",), ()  # --quick: the small MLP at batch 1 alone (its capture takes ~0.3 CPU s)


def cases(quick: bool) -> list[tuple[str, int, Callable[[], tuple[torch.nn.Module, tuple, dict]]]]:
    """(label, batch, builder) for every row."""
    found = []
    zoo = QUICK_ZOO if quick else tuple(_ZOO_LARGE)
    for name in zoo:
        size = "small" if quick else "base"
        for batch in (1,) if quick else (1, _ZOO_LARGE[name]):
            seq = 16 if batch == 1 else 128

            def make(name=name, size=size, batch=batch, seq=seq):
                case = build(name, size=size, batch=batch, seq=seq)
                return case.model, case.example_inputs, case.example_kwargs

            found.append((f"{name}-{size}", batch, make))
    archs = QUICK_ARCHS if quick else [a for a in ARCHS if a not in _SKIP]
    for name in archs:
        for batch in (1, _ARCH_LARGE.get(name, 8)):
            def make(name=name, batch=batch):
                case = build_arch(name, batch=batch)
                return case.model, case.example_inputs, case.example_kwargs

            found.append((name, batch, make))
    return found


def measure(label: str, batch: int, make: Callable, warmup: int, repeats: int) -> dict[str, Any]:
    model, inputs, kwargs = make()
    with torch.inference_mode():
        start = time.perf_counter()
        converted = amppass.convert(model, inputs, LOW, example_kwargs=kwargs or None)
        convert_s = time.perf_counter() - start

        def autocast() -> Any:
            with torch.autocast("cpu", dtype=LOW):
                return model(*inputs, **kwargs)

        calls = {"fp32": lambda: model(*inputs, **kwargs), "autocast": autocast,
                 "amppass": lambda: converted(*inputs, **kwargs)}
        ref = calls["fp32"]()
        errors, missing = {}, ""
        try:  # autocast's own kernels may fail on this CPU (an RNN primitive): the row says so, the run goes on
            errors["autocast"] = rel_error(autocast(), ref)
        except Exception as err:  # noqa: BLE001 - the baseline's failure is this row's result
            missing = f"autocast {not_run(err)}"
            del calls["autocast"]
        errors["amppass"] = rel_error(calls["amppass"](), ref)
        samples = time_interleaved(calls, warmup, repeats)
    latency = {name: statistics.median(values) * 1e3 for name, values in samples.items()}
    report = amppass.report(converted)
    vs_best = latency["amppass"] / min(latency["fp32"], latency.get("autocast", float("inf")))
    err_ratio = errors["amppass"] / errors["autocast"] if errors.get("autocast") else float("nan")
    return {
        "model": label, "batch": batch,
        "fp32_ms": latency["fp32"], "autocast_ms": latency.get("autocast"), "amppass_ms": latency["amppass"],
        "vs_best": vs_best, "err_autocast": errors.get("autocast"), "err_amppass": errors["amppass"],
        "err_ratio": err_ratio, "fp32_nodes": sum(r.source == "profitability" for r in report.rows),
        "convert_s": convert_s,
        "met": "yes" if vs_best <= 1 + NOISE and not err_ratio > 1.1 else "no",
        **({"note": missing} if missing else {}),
    }


# --quick: the small MLP at batch 1 through dynamo with no code generation (inductor compiles take ~15 CPU s each here)
QUICK_COMPILED = ("mlp", "eager")


def compiled(quick: bool) -> list[dict[str, Any]]:
    """compile(amppass) against compile(model) under autocast, inductor with freezing, BERT-base at 1x16
    (``quick``: :data:`QUICK_COMPILED`, to run the path without inductor's compiles)."""
    import torch._dynamo
    import torch._inductor.config as inductor

    name, backend = QUICK_COMPILED if quick else ("bert", "inductor")
    case = build(name, size="small" if quick else "base", batch=1, seq=16)
    label = f"{name}-{'small' if quick else 'base'} {'1x16' if case.kind == 'transformer' else 'batch 1'}"
    model, inputs = case.model, case.example_inputs
    rows = []
    with torch.inference_mode(), inductor.patch(freezing=True):
        converted = amppass.convert(model, inputs, LOW)
        ref = model(*inputs)
        variants = {}
        for name, module, use_autocast in (("compile(model) + autocast", model, True),
                                           ("compile(amppass)", converted, False)):
            torch._dynamo.reset()
            fn = torch.compile(module, backend=backend)

            def call(fn=fn, use_autocast=use_autocast) -> Any:
                with torch.autocast("cpu", dtype=LOW, enabled=use_autocast):
                    return fn(*inputs)

            start = time.perf_counter()
            out = call()
            variants[name] = (call, time.perf_counter() - start, rel_error(out, ref))
        samples = time_interleaved({n: v[0] for n, v in variants.items()}, 3, 5 if quick else 15)
    base = statistics.median(samples["compile(model) + autocast"])
    for name, (_, compile_s, error) in variants.items():
        latency = statistics.median(samples[name])
        rows.append({"model": label, "variant": name, "backend": backend,
                     "latency_ms": latency * 1e3, "vs_compiled_autocast": latency / base,
                     "compile_s": compile_s, "err_vs_fp32": error})
    return rows


def kept_cost(quick: bool) -> list[dict[str, Any]]:
    """What the module amppass returns when it keeps the original costs per call, against calling the original:
    on a model small enough (two 8x8 linears, batch 1; and the small architectures profitability keeps) that a
    wrapper's microseconds show. Both never_slower sections show this table: the quick run measures it once."""
    if quick:
        return _quick_kept_cost()
    return _kept_cost(quick)


@functools.cache
def _quick_kept_cost() -> list[dict[str, Any]]:
    """The quick run's table, measured by the first of the two sections that asks."""
    return _kept_cost(True)


def _kept_cost(quick: bool) -> list[dict[str, Any]]:
    from amppass.serving.fp32_original import keep_original

    models = [("mlp 8x8, batch 1", lambda: (torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(),
                                                                torch.nn.Linear(8, 8)).eval(),
                                            (torch.randn(1, 8),), {}))]
    for name in ("gru", "qwen2") if not quick else ():
        def make(name=name):
            case = build_arch(name, batch=1)
            return case.model.eval(), case.example_inputs, case.example_kwargs or {}

        models.append((f"{name}, batch 1", make))
    rows = []
    for label, make in models:
        model, inputs, kwargs = make()
        kept = keep_original(model, {"whole_model": {}})
        with torch.inference_mode():
            samples = time_interleaved({"original": functools.partial(model, *inputs, **kwargs),
                                        "kept": functools.partial(kept, *inputs, **kwargs)}, 3, 7 if quick else 21)
        original, held = (statistics.median(samples[n]) * 1e6 for n in ("original", "kept"))
        rows.append({"model": label, "original_us": original, "kept_us": held, "overhead_us": held - original,
                     "ratio": held / original})
    return rows


SMALL_NOTES = (
    "Small models at batch 1 (`models/arch.py`: a 2-layer LSTM, a 2-layer transformer encoder, a 4-layer Mistral, "
    "MobileNetV3-small, DistilBERT and Qwen2 from transformers configs), bf16, measured as the table above "
    "(`measure`) with 31 interleaved rounds: a call takes 1 to 10 ms here, so a wrapper's microseconds and a kept "
    "original's cost show. `vs_best` at most 1.02 is met. The second table: the module `keep_original` returns "
    "against the original itself, per call.")
# models whose call takes well under 10 ms at batch 1, where a wrapper's microseconds show
SMALL = ("lstm", "transformer_encoder", "mistral", "mobilenet_v3_small", "distilbert", "qwen2")
QUICK_SMALL = ("distilbert",)  # --quick: ~5 CPU s here, where the LSTM's capture alone takes ~7


def small(quick: bool) -> list[dict[str, Any]]:
    """The small models at batch 1, with more repeats than the full table: a 2% difference is a few
    microseconds here."""
    names = QUICK_SMALL if quick else SMALL
    rows = []
    for name in names:
        def make(name=name):
            case = build_arch(name, batch=1)
            return case.model, case.example_inputs, case.example_kwargs

        rows.append(measure(name, 1, make, 1 if quick else 5, 3 if quick else 31))
    return rows


def run(quick: bool) -> list[dict[str, Any]]:
    warmup, repeats = (1, 3) if quick else (3, 9)
    return [measure(label, batch, make, warmup, repeats) for label, batch, make in cases(quick)]
