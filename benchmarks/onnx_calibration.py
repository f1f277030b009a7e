"""ONNX calibration and the tolerance search, measured.

1. Time: ``convert_onnx`` on a BERT export (batch 1, sequence 128; BERT-base in full mode, the
   "under 5 s with one calibration batch" case) without calibration and with one calibration batch, and
   onnxconverter-common on the same export, median of five conversions each.
2. Search: the sensor conv net of :mod:`models.sensor`, whose fp16 error sits in its first two convs,
   converted to fp16 plainly and with ``tolerance=1e-2`` on three calibration feeds; errors on those
   feeds and on two held-out feeds, as onnxruntime's CPU provider runs the model (``cpu_error``) and in
   the fp16-storage simulation (``sim_error``, :func:`amppass.onnx.simulate.simulated`), which is what fp16
   hardware gives: the CPU provider computes most fp16 ops in fp32.
3. Search on the small zoo: FX bf16 at 1e-3 and ONNX fp16 at 1e-4 (held-out error: a seed not calibrated on;
   ONNX through the simulation), with the nodes moved and the runs spent.

``--quick`` times one conversion of each on the small BERT at 1x16 (the export the other ONNX sections share) and
searches the FX small CNN (the FX search over the small BERT takes ~9 CPU s here) and that ONNX BERT alone in the
third table.

Run: ``python -m benchmarks.onnx_calibration [--full]``.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time

import onnx

import amppass
from amppass.onnx.simulate import simulated
from amppass.targets import onnxruntime_facts
from models import build
from models.sensor import sensor_feed, sensor_net

from .onnx_compare import max_error, onnxconverter_common_fp16, session
from .results import not_run
from .shared import exported, feed

TOLERANCE = 1e-2
REPEATS = 5  # conversions timed per converter: the median and the fastest are reported
NOTES = ("cpu_error: the converted model as onnxruntime's CPU provider runs it; sim_error: its fp16-storage "
         "simulation (what fp16 hardware computes). Both are the largest ||out - out_fp32|| / ||out_fp32||.",)


def timing(quick: bool) -> list[dict]:
    """Conversion time of a BERT export: amppass without and with one calibration batch, and
    onnxconverter-common's ``convert_float_to_float16(keep_io_types=True)`` side by side."""
    size, seq = ("small", 16) if quick else ("base", 128)
    fp32, case = exported("bert", size, 1, seq)
    feeds = feed(fp32, case.make_inputs(1))
    converters = {
        "amppass": lambda: amppass.convert_onnx(fp32, "fp16"),
        "amppass, 1 calibration batch": lambda: amppass.convert_onnx(fp32, "fp16", calibration=[feeds]),
        "onnxconverter-common": lambda: onnxconverter_common_fp16(fp32),
    }
    rows = []
    for label, convert in converters.items():
        row = {"model": f"bert-{size}", "shape": f"1x{seq}", "nodes": len(fp32.graph.node), "converter": label,
               "convert_s": None, "convert_min_s": None}
        times = []
        try:
            for _ in range(1 if quick else REPEATS):
                start = time.perf_counter()
                convert()
                times.append(time.perf_counter() - start)
            row.update(convert_s=round(statistics.median(times), 3), convert_min_s=round(min(times), 3))
        except ModuleNotFoundError as err:  # the baseline is not installed here: its row says so
            row["note"] = not_run(err)
        rows.append(row)
    baseline = rows[-1]["convert_s"]
    for row in rows:
        row["speedup_vs_occ"] = round(baseline / row["convert_s"], 1) if baseline and row["convert_s"] else None
    return rows


def search() -> list[dict]:
    """The sensor net plain and with the tolerance search: errors, convs kept fp16, nodes moved."""
    model = sensor_net()
    calibration = [sensor_feed(seed) for seed in range(3)]
    held_out = [sensor_feed(seed) for seed in (100, 101)]
    reference = session(model)
    rows = []
    for label, options in (("fp16", {"calibration": calibration}),
                           (f"fp16, tolerance={TOLERANCE:g}", {"calibration": calibration, "tolerance": TOLERANCE})):
        start = time.perf_counter()
        converted = amppass.convert_onnx(model, "fp16", **options)
        seconds = time.perf_counter() - start
        cpu, simulation = session(converted), session(simulated(converted))
        info = amppass.report(converted).info
        convs = [r for r in amppass.report(converted).rows if r.op == "Conv"]

        def error(run, feeds):
            return max(max_error(reference.run(None, f), run.run(None, f)) for f in feeds)

        rows.append({
            "variant": label, "convert_s": round(seconds, 2),
            "sim_error_calibration": error(simulation, calibration), "sim_error_held_out": error(simulation, held_out),
            "cpu_error_held_out": error(cpu, held_out),
            "convs_fp16": f"{sum(r.precision == 'fp16' for r in convs)}/{len(convs)}",
            "moved": info.get("moved_by_tolerance"), "search_runs": info.get("tolerance_runs"),
            "moved_nodes": ", ".join(r.name for r in amppass.report(converted).rows if r.source == "tolerance"),
        })
    return rows


def zoo_search(quick: bool = False) -> list[dict]:
    """The tolerance search on small zoo models, both front ends: how many nodes it moves and what holds
    (``quick``: the FX CNN and the ONNX BERT at 1x16)."""
    import torch

    rows = []
    for name, tolerance in (("cnn", 1e-3),) if quick else (("bert", 1e-3), ("cnn", 1e-3), ("gpt2", 1e-3)):
        case = build(name)
        batches = [case.make_inputs(seed) for seed in (1, 2, 3, 4)]
        start = time.perf_counter()
        fast = amppass.convert(case.model, case.example_inputs, torch.bfloat16, calibration=batches,
                               tolerance=tolerance, plan_for="coverage")  # the search's numerics, unmeasured
        seconds = time.perf_counter() - start
        held_out = case.make_inputs(10)
        with torch.no_grad():
            want, got = case.model(*held_out), fast(*held_out)
        want, got = (v if isinstance(v, torch.Tensor) else v[0] for v in (want, got))
        rows.append(_search_row(f"FX {name}-small bf16", tolerance, fast.meta["amppass"], seconds,
                                float((got.float() - want).norm() / want.norm())))
    for name in ("bert",) if quick else ("bert", "gpt2", "vit"):
        fp32, case = exported(name, "small", 1, 16 if quick else 128)
        feeds = [feed(fp32, case.make_inputs(seed)) for seed in (0, 1)]
        held_out = feed(fp32, case.make_inputs(10))
        start = time.perf_counter()
        converted = amppass.convert_onnx(fp32, "fp16", calibration=feeds, tolerance=1e-4)
        seconds = time.perf_counter() - start
        reference = session(onnx_runtime_model(fp32))
        error = max_error(reference.run(None, held_out), session(simulated(converted)).run(None, held_out))
        rows.append(_search_row(f"ONNX {name}-small fp16", 1e-4, amppass.report(converted).info, seconds, error))
    return rows


def _search_row(model: str, tolerance: float, info: dict, seconds: float, held_out: float) -> dict:
    return {"model": model, "tolerance": tolerance, "initial_error": info.get("initial_error"),
            "achieved_error": info.get("achieved_error"), "held_out_error": held_out,
            "moved": info.get("moved_by_tolerance"), "search_runs": info.get("tolerance_runs"),
            "convert_s": round(seconds, 2)}


def onnx_runtime_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` at an IR version the installed onnxruntime loads (torch's exporter may write a newer one)."""
    loadable = onnx.ModelProto()
    loadable.CopyFrom(model)
    loadable.ir_version = min(loadable.ir_version, onnxruntime_facts.max_ir_version())
    return loadable


def run(quick: bool) -> tuple[list[dict], list[dict], list[dict]]:
    """The three tables: (timing rows, sensor search rows, zoo search rows)."""
    return timing(quick), search(), zoo_search(quick)


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)
    onnxruntime_facts.max_ir_version()  # probe once before timing
    for table in run(quick="--full" not in sys.argv):
        for row in table:
            print(row)
