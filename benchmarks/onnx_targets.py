"""ONNX plans per target: how much heavy work runs low for CPU, CUDA and TensorRT, and how error is judged.

Three tables:

1. **Heavy ops per target.** BERT-base (dynamo export), ResNet-50 and the DB text detector converted for
   each target and dtype: heavy nodes (MatMul, Gemm, Conv, ...) planned low out of all heavy nodes, the
   share of their MACs, Casts added, and whether ``onnx.checker.check_model(full_check=True)`` passes.
   The goal: at least 90% of heavy nodes low for ``cuda`` fp16 and bf16 and ``tensorrt`` fp16.
2. **Simulation against the runtime.** For each model, the plain fp16 plan's relative output error as
   onnxruntime's CPU provider computes it (``runtime``) and as the fp16-storage simulation computes it
   (``simulated``, what the tolerance search uses for targets this machine cannot run), on a held-out feed.
3. **Tolerance on the CPU target**, judged by running the candidates in onnxruntime: calibration on 3
   feeds, the error on a held-out feed against the tolerance, nodes moved to fp32, search runs.

Errors are ``||out - out_fp32|| / ||out_fp32||`` (largest over floating outputs). ``--quick`` runs the three tables
on the small BERT alone (1x16, the export the other ONNX sections share); the models above are ``--full``'s.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import onnx
import onnxruntime as ort

import amppass
from amppass.onnx.simulate import simulated
from models.arch import build_arch

from .shared import exported, feed

NOTES = __doc__.split("\n\n", 1)[1]
HEAVY = ("MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "Attention", "LSTM", "GRU", "RNN", "FusedMatMul")
PLANS = (("cpu", "fp16"), ("cpu", "bf16"), ("cuda", "fp16"), ("cuda", "bf16"), ("tensorrt", "fp16"))

Feed = Callable[[int], dict[str, np.ndarray]]


def _zoo(name: str, size: str, batch: int = 1, seq: int = 32) -> tuple[onnx.ModelProto, Feed]:
    model, case = exported(name, size, batch, seq)
    return model, lambda seed: feed(model, case.make_inputs(seed))


def _arch(name: str, export: Callable[[], onnx.ModelProto], **shape: Any) -> tuple[onnx.ModelProto, Feed]:
    case = build_arch(name, batch=1, **shape)
    model = export()
    return model, lambda seed: feed(model, case.make_inputs(seed))


def _sensor() -> tuple[onnx.ModelProto, Feed]:
    from models.sensor import sensor_feed, sensor_net

    return sensor_net(), sensor_feed


def models(quick: bool) -> dict[str, Callable[[], tuple[onnx.ModelProto, Feed]]]:
    from models.arch import audio_onnx, db_onnx

    if quick:
        return {"bert-small": lambda: _zoo("bert", "small", seq=16)}
    return {
        "bert-base": lambda: _zoo("bert", "base"),
        "resnet-base": lambda: _zoo("resnet", "base"),
        "db_text_detector 320": lambda: _arch("db_text_detector", lambda: db_onnx(shape=320), shape=320),
        "audio_cqt": lambda: _arch("audio_cqt", audio_onnx),
        "sensor": _sensor,
        "vit-base": lambda: _zoo("vit", "base"),
        "gpt2-base": lambda: _zoo("gpt2", "base"),
    }


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"],
                                disabled_optimizers=["MatmulTransposeFusion"])


def error(model: onnx.ModelProto, reference: list[np.ndarray], feed: dict[str, np.ndarray]) -> float:
    got = _session(model).run(None, feed)
    return max(float(np.linalg.norm(g.astype(np.float64) - r) / np.linalg.norm(r))
               for g, r in zip(got, reference, strict=False) if np.issubdtype(r.dtype, np.floating))


def heavy_rows(label: str, model: onnx.ModelProto) -> tuple[list[dict[str, Any]], dict[tuple[str, str], Any]]:
    """One row per (target, dtype) of :data:`PLANS`, and the converted models by (target, dtype)."""
    rows, plans = [], {}
    for target, dtype in PLANS:
        try:
            converted = plans[target, dtype] = amppass.convert_onnx(model, dtype, target=target)
        except amppass.InputError as refused:  # bf16 for the CPU provider, which has no bf16 MatMul, Gemm or Conv
            rows.append({"model": label, "target": target, "dtype": dtype, "heavy_low": "refused",
                         "heavy_low_share": None, "heavy_macs_low": None, "casts": None,
                         "checker": f"refused: {str(refused).split(':')[1].split(',')[0].strip()}"})
            continue
        try:
            onnx.checker.check_model(converted, full_check=True)
            valid = "yes"
        except Exception as err:  # noqa: BLE001 - reported, not raised
            valid = f"no: {str(err)[:60]}"
        report = amppass.report(converted)
        heavy = [r for r in report.rows if r.op.split(".")[-1] in HEAVY]
        low = [r for r in heavy if r.precision == dtype]
        share = report.stats()["macs"]["low_share"]
        rows.append({"model": label, "target": target, "dtype": dtype, "heavy_low": f"{len(low)}/{len(heavy)}",
                     "heavy_low_share": len(low) / len(heavy) if heavy else None,
                     "heavy_macs_low": share, "casts": report.info["casts"], "checker": valid})
    return rows, plans


def run(quick: bool) -> tuple[list[dict], list[dict], list[dict]]:
    heavy, gap, tolerance = [], [], []
    for label, make in models(quick).items():
        model, feed = make()
        held_out = feed(10)
        reference = [r.astype(np.float64) for r in _session(model).run(None, held_out)]
        rows, plans = heavy_rows(label, model)
        heavy += rows
        plain = plans["cpu", "fp16"]  # the default target
        runtime, simulated_error = error(plain, reference, held_out), error(simulated(plain), reference, held_out)
        gap.append({"model": label, "runtime_error": runtime, "simulated_error": simulated_error,
                    "simulated_over_runtime": simulated_error / runtime if runtime else None})
        limit = 1e-2
        start = time.perf_counter()
        tuned = amppass.convert_onnx(model, "fp16", calibration=[feed(s) for s in (1, 2, 3)], tolerance=limit)
        seconds = time.perf_counter() - start
        info = amppass.report(tuned).info
        held = error(tuned, reference, held_out)
        tolerance.append({"model": label, "tolerance": limit, "plain_error": runtime,
                          "achieved_on_calibration": info["achieved_error"], "held_out_error": held,
                          "within": "yes" if held <= limit else "no", "moved": info["moved_by_tolerance"],
                          "runs": info["tolerance_runs"], "judged_by": info["error_judged_by"],
                          "convert_s": seconds})
    return heavy, gap, tolerance
