"""amppass.convert_onnx vs onnxconverter-common's convert_float_to_float16 on exports of the model zoo.

For each zoo model (dynamo exporter, TorchScript exporter as fallback) and each converter: conversion
time, whether onnxruntime (CPU) loads and runs the result, and two relative errors against fp32
(||out - out_fp32|| / ||out_fp32|| over the floating outputs, on an input other than the example one):

- ``rel_error``: the converted model as onnxruntime's CPU provider runs it. That provider has no fp16 kernel
  for most ops: it casts around them and removes the fp32->fp16->fp32 cast chains this makes, so it
  computes most "fp16" values in fp32 and understates what fp16 hardware gives.
- ``sim_error``: the model's fp16-storage simulation (:func:`amppass.onnx.simulate.simulated`), which reads
  which values are low from the converted model's own types (so it judges every converter alike), stores
  each of them in its low dtype and computes every op in fp32, as a GPU kernel with fp32 accumulation.

A row is ``accurate`` only when BOTH errors are finite and at most 1e-2. Each conversion is timed
``REPEATS`` times: ``convert_s`` is the median, ``convert_min_s`` the fastest, and ``speedup_vs_occ`` is
onnxconverter-common's median over this row's.
amppass runs twice: as it is, and calibrated on one batch (another input again), to time the calibration.
``quick`` converts the small BERT once per converter (its export shared with the other ONNX sections); otherwise
every small zoo model, three times each, and BERT-base (batch 1, seq 16) as the timing case.

Run: ``python benchmarks/onnx_compare.py [--full]``.
"""

from __future__ import annotations

import copy
import logging
import statistics
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort

import amppass
from amppass.onnx.simulate import simulated
from amppass.targets import onnxruntime_facts
from models import ZOO

from .results import not_run
from .shared import exported, feed

ACCURATE = 1e-2
REPEATS = 3  # conversions timed per (model, converter): convert_s is their median, convert_min_s the fastest
QUICK = ("bert", "small", 1, 16)  # --quick: one model, one conversion per converter
NOTES = ("rel_error: the fp16 model as onnxruntime's CPU provider runs it (it computes most fp16 ops in fp32, "
         "so this understates fp16 hardware's error); sim_error: its fp16-storage simulation "
         "(amppass.onnx.simulate.simulated: every value the converted model types fp16 is stored in fp16, ops "
         "compute in fp32), the same rule for every converter. accurate: both errors finite and <= 1e-2.")


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    """A quiet onnxruntime CPU session of ``model``."""
    options = ort.SessionOptions()
    options.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def max_error(want: list, got: list) -> float:
    """Largest ``||got - want|| / ||want||`` over the floating outputs."""
    errors = []
    for w, g in zip(want, got, strict=False):
        if np.issubdtype(w.dtype, np.floating):
            w64, g64 = w.astype(np.float64), g.astype(np.float64)
            errors.append(np.linalg.norm(g64 - w64) / max(np.linalg.norm(w64), 1e-12))
    return float(max(errors)) if errors else 0.0


def _converters(feeds: dict):
    """Converter name -> conversion; ``feeds`` is the one calibration batch of the calibrated row."""
    return {
        "amppass": lambda m: amppass.convert_onnx(m, "fp16"),
        "amppass+calib1": lambda m: amppass.convert_onnx(m, "fp16", calibration=[feeds]),
        "onnxconverter-common": onnxconverter_common_fp16,
    }


def onnxconverter_common_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxconverter-common's ``convert_float_to_float16(keep_io_types=True)`` of a copy of ``model``; imported at
    the call, so that where it is not installed its rows say so and the section goes on."""
    from onnxconverter_common import float16

    return float16.convert_float_to_float16(copy.deepcopy(model), keep_io_types=True)


def _one(model_name: str, size: str, fp32: onnx.ModelProto, feeds: dict, converter: str, convert,
         repeats: int = REPEATS) -> dict:
    row = {"model": model_name, "size": size, "nodes": len(fp32.graph.node), "converter": converter,
           "convert_s": None, "convert_min_s": None, "speedup_vs_occ": None, "loads": False, "runs": False,
           "rel_error": None, "sim_error": None,
           "accurate": False, "error": ""}
    reference = copy.deepcopy(fp32)
    reference.ir_version = min(reference.ir_version, onnxruntime_facts.max_ir_version())
    want = session(reference).run(None, feeds)
    try:
        times = []
        for _ in range(repeats):  # interleaving is not needed: each converter's calls are independent
            start = time.perf_counter()
            converted = convert(fp32)
            times.append(time.perf_counter() - start)
        row["convert_s"], row["convert_min_s"] = round(statistics.median(times), 3), round(min(times), 3)
        loaded = session(converted)
        row["loads"] = True
        got = loaded.run(None, feeds)
        row["runs"] = True
        row["rel_error"] = max_error(want, got)
        row["sim_error"] = max_error(want, session(simulated(converted)).run(None, feeds))
        row["accurate"] = all(bool(np.isfinite(e) and e <= ACCURATE) for e in (row["rel_error"], row["sim_error"]))
    except ModuleNotFoundError as err:  # a converter not installed here: its rows say so
        row["error"] = not_run(err)
    except Exception as err:  # noqa: BLE001 - a converter's failure is a result here, not a crash
        row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
    return row


def run(quick: bool) -> list[dict]:
    """One row per (model, converter): conversion time, loads, runs, CPU and simulated relative errors,
    accurate (both within 1e-2)."""
    cases = [QUICK] if quick else [(name, "small", 2, 16) for name in ZOO] + [("bert", "base", 1, 16)]
    rows = []
    for name, size, batch, seq in cases:
        fp32, case = exported(name, size, batch, seq)
        feeds, calibration = feed(fp32, case.make_inputs(1)), feed(fp32, case.make_inputs(2))
        found = [_one(name, size, fp32, feeds, converter, convert, 1 if quick else REPEATS)
                 for converter, convert in _converters(calibration).items()]
        baseline = next(r["convert_s"] for r in found if r["converter"] == "onnxconverter-common")
        for row in found:
            row["speedup_vs_occ"] = round(baseline / row["convert_s"], 1) if baseline and row["convert_s"] else None
        rows += found
    return rows


def _print(rows: list[dict]) -> None:
    header = (f"{'model':<7} {'size':<5} {'nodes':>5} {'converter':<21} {'convert_s':>9} loads runs {'rel_err':>9} "
              f"{'sim_err':>9} ok")
    print(header)
    for r in rows:
        err, sim = ("-" if r[k] is None else f"{r[k]:.2e}" for k in ("rel_error", "sim_error"))
        print(f"{r['model']:<7} {r['size']:<5} {r['nodes']:>5} {r['converter']:<21} {str(r['convert_s']):>9} "
              f"{str(r['loads']):<5} {str(r['runs']):<4} {err:>9} {sim:>9} {r['accurate']}  {r['error']}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)
    _print(run(quick="--full" not in sys.argv))
