"""Benchmark sections "shapes" and "compile".

"shapes": each architecture is ``(name, builder)``; the builder returns a :class:`tests.helpers.shape_models.ShapeCase`
(a model, its conversion example and three more calls). A model export can capture is converted with
``amppass.convert``; one it cannot (data-dependent control flow) goes through
``torch.compile(backend="amppass")``. Every call's output error against the fp32 model is compared with
autocast's; the plans the converted model made on the way are counted. Pass another list to :func:`run`
to measure other architectures (the full zoo).

"compile": ``torch.compile(backend="amppass")`` against ``torch.compile`` under autocast with inductor's
freezing, on BERT (base in full mode, small in quick mode) at batch 1: first-call time (dynamo, the
conversion and inductor) and latency. Quick mode compiles both with no inductor (the eager backend, and the
amppass backend's ``compiler="eager"``): the same path through dynamo and the conversion, without the
two inductor compiles, ~15 CPU s each here.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Iterable

import torch
from torch.utils import _pytree as pytree

import amppass

SHAPES_NOTES = (
    "Columns: `call` the input (the conversion example first); `runs` whether the call returned; `err` / "
    "`autocast_err` = ||out - fp32|| / ||fp32|| over every floating output (caches included), amppass bf16 "
    "against `torch.autocast('cpu', torch.bfloat16)`; `ratio` = err / autocast_err (target <= 1.1); `plans` "
    "the plans the converted model holds after the call (1: the example's graph served it), `recaptures` the "
    "captures made after conversion; `convert_s` the conversion (the example row) or the call's time "
    "including any re-capture. Models torch.export cannot capture whole run through "
    "`torch.compile(backend='amppass', options={'compiler': 'eager', 'plan_for': 'coverage'})` (`via` = compile; "
    "`plans` then counts dynamo's graphs). The detector's kept boxes come out of a greedy NMS: where two scores "
    "are nearly tied, any rounding (autocast's as amppass's) swaps them, so its box error measures that order, "
    "the same for both."
)
COMPILE_NOTES = (
    "Columns: `first_call_s` = the first call (dynamo, amppass's conversion, inductor's compile); `latency_ms` "
    "median of the following calls (`min_ms` the fastest); `err` = ||out - fp32|| / ||fp32|| on the last hidden "
    "state. `autocast+freezing` = `torch.compile(model)` called under `torch.autocast('cpu', torch.bfloat16)` "
    "with `torch._inductor.config.freezing = True`; `amppass` = `torch.compile(model, backend='amppass', "
    "options={'dtype': 'bf16', 'plan_for': 'coverage'})` (inductor, freezing in inference; coverage: converted on "
    "any CPU); `amppass default` = the same with the default `plan_for='speed'`, which on a CPU without bf16 "
    "instructions runs every graph as dynamo traced it, in fp32, as `torch.compile fp32` (plain "
    "`torch.compile(model)`) does; `ran_in` = what the report says the compiled graphs ran in. All under "
    "`torch.no_grad()`. "
    "`compiler`: inductor, or eager in `--quick` (both compiled by dynamo without inductor: the path, not the figures)."
)


# --quick: the zoo's small MLP at four batches, and an image resized in the graph (re-captured at a new size): the
# transformers' and the LSTM's captures take torch.export 3 to 7 CPU s each here
QUICK = ("zoo:mlp", "interpolate")


def architectures(quick: bool) -> list[tuple[str, Callable[[], Any]]]:
    """The zoo's small models plus the architectures of ``tests/helpers/shape_models.py`` (a few of them when quick)."""
    from models import ZOO, build
    from tests.helpers.shape_models import ARCHITECTURES, ShapeCase

    def zoo_case(name: str) -> Callable[[], ShapeCase]:
        def builder() -> ShapeCase:
            case = build(name, "small", batch=2, seq=16)
            other = build(name, "small", batch=1, seq=16).make_inputs(2)
            larger = build(name, "small", batch=6, seq=16).make_inputs(3)
            calls = {"batch 1": other, "batch 6": larger}
            if case.kind == "transformer" and name != "vit":
                calls["length 40"] = build(name, "small", batch=2, seq=40).make_inputs(4)
            else:
                calls["batch 3"] = build(name, "small", batch=3, seq=16).make_inputs(4)
            return ShapeCase(case.model, case.example_inputs, calls)

        return builder

    every = [(f"zoo:{name}", zoo_case(name)) for name in ZOO] + list(ARCHITECTURES)
    return [(name, builder) for name, builder in every if not quick or name in QUICK]


def run(quick: bool, cases: Iterable[tuple[str, Callable[[], Any]]] | None = None) -> list[dict[str, Any]]:
    """One row per (architecture, call)."""
    rows = []
    for name, builder in (cases if cases is not None else architectures(quick)):
        rows += measure(name, builder())
    return rows


def measure(name: str, case: Any, dtype: torch.dtype = torch.bfloat16) -> list[dict[str, Any]]:
    """Convert ``case.model`` at its example and call it at every shape; a row per call."""
    start = time.perf_counter()
    if case.compile_only:
        from amppass.pipelines.backend import amppass_backend  # the function itself: the name needs amppass installed

        torch._dynamo.reset()
        fast = torch.compile(case.model, backend=amppass_backend, options={"dtype": dtype, "compiler": "eager",
                                                                              "plan_for": "coverage"})
        via = "compile"
    else:
        fast = amppass.convert(case.model, case.example, dtype, plan_for="coverage")
        via = "convert"
    rows = []
    for label, args in [("example", case.example)] + list(case.calls.items()):
        row: dict[str, Any] = {"model": name, "via": via, "call": label, "shape": _shapes(args)}
        try:
            with torch.no_grad():
                ours = fast(*args)
        except Exception as err:  # noqa: BLE001 - a failed call is a row of the table, not the end of it
            row.update(runs=False, error=f"{type(err).__name__}: {str(err)[:160]}")
            rows.append(row)
            continue
        seconds = time.perf_counter() - start
        with torch.no_grad():
            reference = case.model(*args)
            with torch.autocast("cpu", dtype=dtype):
                theirs = case.model(*args)
        err, auto = _error(ours, reference), _error(theirs, reference)
        info = _plans(fast, via)
        row.update(runs=True, err=err, autocast_err=auto, ratio=err / auto if auto > 0 else None,
                   plans=info[0], recaptures=info[1], convert_s=round(seconds, 2))
        rows.append(row)
        start = time.perf_counter()
    return rows


def compile_rows(quick: bool) -> list[dict[str, Any]]:
    """BERT at batch 1 through both compile paths: first-call time, latency and error."""
    import copy

    import torch._inductor.config as inductor

    from amppass.pipelines.backend import amppass_backend
    from models import build

    seq = 32 if quick else 128
    compiler = "eager" if quick else "inductor"
    case = build("bert", "small" if quick else "base", batch=1, seq=seq)
    x, repeats = case.example_inputs[0], 5 if quick else 30
    with torch.no_grad():
        reference = case.model(x).last_hidden_state
        torch._dynamo.reset()
        with inductor.patch(freezing=True):
            baseline = torch.compile(copy.deepcopy(case.model), backend=compiler)

            def autocast() -> Any:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return baseline(x)

            rows = [{**_timed("autocast+freezing", autocast, reference, repeats), "ran_in": "bf16 (autocast)"}]
        torch._dynamo.reset()
        plain = torch.compile(copy.deepcopy(case.model), backend=compiler)
        rows.append({**_timed("torch.compile fp32", lambda: plain(x), reference, repeats), "ran_in": "fp32"})
        for name, plan in (("amppass", "coverage"), ("amppass default", "speed")):
            torch._dynamo.reset()
            ours = torch.compile(case.model, backend=amppass_backend, options={"dtype": "bf16", "compiler": compiler,
                                                                                  "plan_for": plan})
            rows.append(_timed(name, functools.partial(ours, x), reference, repeats))
            rows[-1]["ran_in"] = amppass.report(ours).info.get("dtype")
        torch._dynamo.reset()
    for row in rows:
        row["model"], row["compiler"] = f"bert-{'small' if quick else 'base'} 1x{seq}", compiler
    return rows


def _timed(name: str, call: Callable[[], Any], reference: torch.Tensor, repeats: int) -> dict[str, Any]:
    started = time.perf_counter()
    out = call()
    first = time.perf_counter() - started
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    times.sort()
    err = float((out.last_hidden_state.float() - reference).norm() / reference.norm())
    return {"variant": name, "first_call_s": round(first, 1), "latency_ms": round(times[len(times) // 2] * 1e3, 2),
            "min_ms": round(times[0] * 1e3, 2), "err": err}


def verdict(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per architecture: every call ran, the worst error ratio against autocast, re-captures."""
    summary: dict[str, dict[str, Any]] = {}
    for row in rows:
        line = summary.setdefault(row["model"], {"model": row["model"], "via": row["via"], "calls": 0, "ran": 0,
                                                 "worst_ratio": 0.0, "recaptures": 0, "plans": 1})
        line["calls"] += 1
        if row.get("runs"):
            line["ran"] += 1
            if row.get("ratio") is not None:
                line["worst_ratio"] = round(max(line["worst_ratio"], row["ratio"]), 3)
            line["recaptures"], line["plans"] = row["recaptures"], row["plans"]
    for line in summary.values():
        line["meets"] = line["ran"] == line["calls"] and line["worst_ratio"] <= 1.1
    return list(summary.values())


def _plans(fast: Any, via: str) -> tuple[int, int]:
    report_info = amppass.report(fast).info
    if via == "compile":
        return report_info.get("graphs", 0), 0
    return len(report_info.get("plans", [])) or 1, report_info.get("recaptures", 0)


def _leaves(value: Any) -> list[torch.Tensor]:
    if hasattr(value, "to_tuple"):  # transformers' ModelOutput: its fields, caches flattened below
        value = value.to_tuple()
    flat = []
    for leaf in pytree.tree_leaves(value):
        if hasattr(leaf, "layers"):  # a transformers cache: its keys and values
            flat += [t for layer in leaf.layers for t in (layer.keys, layer.values) if t is not None]
        elif isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            flat.append(leaf)
    return flat


def _error(out: Any, ref: Any) -> float:
    outs, refs = _leaves(out), _leaves(ref)
    if len(outs) != len(refs):
        return float("inf")
    num = sum(float((o.float() - r.float()).norm() ** 2) for o, r in zip(outs, refs, strict=False))
    den = sum(float(r.float().norm() ** 2) for r in refs)
    return (num / den) ** 0.5 if den > 0 else 0.0


def _shapes(args: tuple) -> str:
    return " ".join(str(list(a.shape)) for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor))
