"""The fp8 parts of benchmark section "gpu" (:mod:`benchmarks.gpu`): fp8 matrix products on a CUDA device with fp8
kernels (compute capability 8.9 or later: an H100 or H200), against bf16.

1. **Products**: every distinct linear-layer shape (in, out) of the zoo's transformers (BERT-base, GPT-2 124M,
   ViT-B/16) at a large batch of rows (:data:`ROWS`: 32 x 128 tokens), three ways: the bf16 product
   (``F.linear`` with a bf16 weight), ``torch._scaled_mm`` alone on e4m3 operands with per-tensor scales and a
   bf16 output, and ``amppass::fp8_linear`` (what an fp8 plan runs: the input quantized to e4m3 on every call,
   then ``_scaled_mm``). ``vs_bf16`` = the bf16 product's time / this one's; the goal is 1.5x.
2. **Whole model**: BERT-base at 32x128 converted with ``dtype="fp8"`` (calibrated: static input scales) and with
   ``dtype="bf16"``, both ``plan_for="coverage"`` so that only the products' precision differs: median latency,
   the fp8 share of the products' MACs, and each model's error against fp32.
3. **Numerics**: the same fp8 product (``amppass::fp8_linear``, the same e4m3 operands and scales) on the CPU and
   on the GPU: their largest difference in bf16 steps of the output (the two sum the same products in different
   orders, then round once to bf16) and each one's error against the fp32 product.

Without such a device, ``--full`` leaves one row per part saying so; ``--quick`` runs every part on the CPU at the
small zoo's sizes (a dry run of the code: the CPU has no fp8 arithmetic, so its times are no figures).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import amppass
from amppass.analysis.calibration import relative_error
from amppass.analysis.record import fp8_shares
from amppass.dtypes import E4M3
from amppass.fx.rewrite.fp8 import fp8_linear, quantize
from amppass.targets.target import FP8_CAPABILITY
from benchmarks import gpu

ROWS = 32 * 128  # rows of each product: BERT's and GPT-2's 32 x 128 tokens
MODELS = ("bert", "gpt2", "vit")
GOAL = 1.5  # the speed-up over bf16 an fp8 product should reach at ROWS rows


def no_fp8_device() -> str | None:
    """Why this machine cannot give fp8 figures, or None where it can (a CUDA device with fp8 kernels)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    capability = torch.cuda.get_device_capability()
    if capability < FP8_CAPABILITY:
        return (f"{torch.cuda.get_device_name()} has compute capability {capability[0]}.{capability[1]}, below "
                f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} (no fp8 kernels)")
    return None


def _skipped(quick: bool) -> list[dict[str, Any]] | None:
    """The one row of a part that cannot run here (``--full`` without an fp8 device), or None."""
    why = no_fp8_device()
    if why is None or quick:
        return None
    return [{"failed": f"skipped: {why}; scripts/gpu_check on an H100 or H200 gives these figures"}]


def product_shapes(quick: bool) -> list[tuple[str, int, int]]:
    """``(models, in, out)`` of every distinct linear-layer shape of the zoo's transformers, their models named."""
    found: dict[tuple[int, int], list[str]] = {}
    for name in MODELS:
        model = gpu.build(name, "small" if quick else "base").model
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or isinstance(module, nn.Embedding):
                continue
            if isinstance(module, nn.Linear):
                shape = (module.in_features, module.out_features)
            elif type(module).__name__ == "Conv1D":  # GPT-2's linear layers store their weight as (in, out)
                shape = (weight.shape[0], weight.shape[1])
            else:
                continue
            if name not in found.setdefault(shape, []):
                found[shape].append(name)
    return [(", ".join(names), k, n) for (k, n), names in sorted(found.items())]


def products(quick: bool) -> list[dict[str, Any]]:
    """Part 1: each zoo product shape at :data:`ROWS` rows in bf16, bare ``_scaled_mm`` and ``fp8_linear``."""
    skipped = _skipped(quick)
    if skipped:
        return skipped
    return _per_shape(product_shapes(quick), 64 if quick else ROWS, "fp8_products",
                      lambda m, k, n, where: _product_times(m, k, n, where, quick))


def _per_shape(shapes: list[tuple[str, int, int]], m: int, budget_key: str,
               measure: Callable[[int, int, int, torch.device], dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per product shape ``(models, k, n)`` at ``m`` rows: what ``measure`` gives, within the budget
    ``gpu.BUDGET_S[budget_key]`` (started after the zoo was built), a row naming what raised otherwise."""
    where, rows, budget = gpu.device(), [], gpu.Budget(gpu.BUDGET_S[budget_key])
    for models, k, n in shapes:
        base = {"shape": f"{m}x{k} @ {k}x{n}", "models": models}
        if budget.spent():
            rows.append({**base, "failed": gpu.SKIPPED})
            continue
        try:
            rows.append({**base, **measure(m, k, n, where)})
        except Exception as err:  # noqa: BLE001
            rows.append(gpu._failed(base, err))
    return rows


def _operands(m: int, k: int, n: int, where: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """A bf16 input, a fp32 weight, their e4m3 forms and per-tensor scales (as amppass computes them)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
    w = torch.randn(n, k, generator=generator) / math.sqrt(k)
    x_scale = torch.tensor(E4M3.scale_for(float(x.float().abs().amax())), dtype=torch.float32)
    w_scale = torch.tensor(E4M3.scale_for(float(w.abs().amax())), dtype=torch.float32)
    found = {"x": x, "w": w, "w_bf16": w.to(torch.bfloat16), "x_scale": x_scale, "w_scale": w_scale,
             "q_x": quantize(x, x_scale), "q_w": quantize(w, w_scale)}
    return {key: value.to(where) for key, value in found.items()}


def _product_times(m: int, k: int, n: int, where: torch.device, quick: bool) -> dict[str, Any]:
    t = _operands(m, k, n, where)
    calls = {
        "bf16": lambda: F.linear(t["x"], t["w_bf16"]),
        "scaled_mm": lambda: torch._scaled_mm(t["q_x"], t["q_w"].t(), scale_a=t["x_scale"], scale_b=t["w_scale"],
                                              out_dtype=torch.bfloat16),
        "fp8_linear": lambda: fp8_linear(t["x"], t["q_w"], t["w_scale"], t["x_scale"], None),
    }
    row: dict[str, Any] = {}
    with torch.no_grad():
        for variant, call in calls.items():
            row[f"ms_{variant}"] = gpu.timed(call, where, warmup=1 if quick else 10, repeats=2 if quick else 50)[0]
    for variant in ("scaled_mm", "fp8_linear"):
        row[f"{variant}_vs_bf16"] = row["ms_bf16"] / row[f"ms_{variant}"]
    row["tflops_scaled_mm"] = 2 * m * k * n / row["ms_scaled_mm"] / 1e9
    row["goal_1.5x"] = "met" if row["scaled_mm_vs_bf16"] >= GOAL else "missed"
    if where.type != "cuda":
        row["goal_1.5x"] = "- (CPU dry run)"
    return row


def whole_model(quick: bool) -> list[dict[str, Any]]:
    """Part 2: one transformer converted to fp8 and to bf16, the same plan otherwise: latency and error."""
    skipped = _skipped(quick)
    if skipped:
        return skipped
    where, rows, budget = gpu.device(), [], gpu.Budget(gpu.BUDGET_S["fp8_model"])
    point = gpu.Point("bert", 2 if quick else 32, 16 if quick else 128)
    try:
        case = gpu.build("bert", "small" if quick else "base", batch=point.batch, seq=point.seq)
        fp32 = copy.deepcopy(case.model).to(where).eval()
        inputs = tuple(x.to(where) for x in case.make_inputs(1))
        calibration = [tuple(x.to(where) for x in case.make_inputs(seed)) for seed in range(2, 6)]
        with torch.no_grad():
            reference = gpu._first_float(fp32(*inputs)).float()
    except Exception as err:  # noqa: BLE001
        return [gpu._failed({"model": point.label}, err)]
    for dtype in ("bf16", "fp8"):
        base = {"model": point.label, "dtype": dtype}
        if budget.spent():
            rows.append({**base, "failed": gpu.SKIPPED})
            continue
        try:
            with gpu.no_tf32():
                converted = amppass.convert(fp32, inputs, dtype, target=where.type, plan_for="coverage",
                                            calibration=calibration if dtype == "fp8" else None)
                with torch.no_grad():
                    ms, peak = gpu.timed(lambda c=converted: c(*inputs), where, warmup=1 if quick else 10,
                                         repeats=2 if quick else 30)
                    error = relative_error(gpu._first_float(converted(*inputs)).float(), reference)
            record = amppass.report(converted).info.get("fp8")
            shares = fp8_shares(record) if isinstance(record, dict) else None
            rows.append({**base, "ms": ms, "peak_MB": peak, "err_fp32": error,
                         "fp8_products": f"{record['products']['fp8']}/{sum(record['products'].values())}"
                         if isinstance(record, dict) else "-",
                         "fp8_macs": f"{shares['fp8']:.1%}" if shares else "-"})
        except Exception as err:  # noqa: BLE001
            rows.append(gpu._failed(base, err))
    if len(rows) == 2 and "ms" in rows[0] and "ms" in rows[1]:
        rows[1]["vs_bf16"] = rows[0]["ms"] / rows[1]["ms"]
    return rows


def numerics(quick: bool) -> list[dict[str, Any]]:
    """Part 3: the fp8 product on the CPU against the same product on the device (the CPU against itself when
    there is none: a dry run), for the first few zoo shapes."""
    skipped = _skipped(quick)
    if skipped:
        return skipped
    return _per_shape(product_shapes(quick)[:4], 16 if quick else 256, "fp8_numerics", product_numerics)


def product_numerics(m: int, k: int, n: int, where: torch.device) -> dict[str, Any]:
    """The fp8 product of the same operands on the CPU and on ``where``: their largest difference in bf16 steps,
    and each one's error against the fp32 product of the unquantized operands."""
    cpu = _operands(m, k, n, torch.device("cpu"))
    with torch.no_grad():
        on_cpu = fp8_linear(cpu["x"], cpu["q_w"], cpu["w_scale"], cpu["x_scale"], None).float()
        device = _operands(m, k, n, where)
        on_device = fp8_linear(device["x"], device["q_w"], device["w_scale"], device["x_scale"], None).float().cpu()
        exact = F.linear(cpu["x"].float(), cpu["w"])
    return {"device": "cpu (dry run)" if where.type == "cpu" else torch.cuda.get_device_name(where),
            "max_diff_bf16_steps": bf16_steps(on_cpu, on_device),
            "err_fp32_cpu": relative_error(on_cpu, exact), "err_fp32_device": relative_error(on_device, exact)}


def bf16_steps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest ``|a - b|`` in units of bf16's step (2^-7 of the power of two at or below the larger
    magnitude) at each element; 0 where both are 0."""
    larger = torch.maximum(a.abs(), b.abs())
    step = torch.where(larger > 0, torch.exp2(torch.floor(torch.log2(larger)) - 7), torch.ones_like(larger))
    return float(((a - b).abs() / step).amax()) if a.numel() else 0.0
