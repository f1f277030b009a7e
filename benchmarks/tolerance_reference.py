"""The tolerance search measured against an expensive reference.

For each model of a set, the ONNX model is converted to fp16 for onnxruntime's CPU provider (the default
target: every trial of the search runs in onnxruntime) with calibration feeds and a fixed tolerance, twice:

- *default*: amppass's tolerance search as it ships (:func:`amppass.analysis.tolerance.by_region_effect`);
- *local*: the same search ranked by local error alone, as it was before (``by_local_error``);
- *reference*: the same search with its ranking replaced by each candidate's output error when it alone is
  moved to fp32 (:func:`amppass.analysis.tolerance.by_error_alone`: one run per candidate), then the same
  prefix search and trim.

The models: the sensor net of :mod:`models.sensor` (fp16 error in its first two convs), the DB text
detector (its head sigmoid(50 (P - T)) amplifies rounding about 50x) and the constant-Q audio classifier,
exported by :mod:`models.arch`, and real-shaped conv nets and transformers of
:mod:`models`: ResNet-50, EfficientNet-B0, a 4-layer BERT and a 4-layer ViT-Base, exported by the dynamo
exporter (``amppass.pipelines.export_onnx.export_fp32``). Batch axes are fixed so that every heavy op's
multiply-accumulates are known. Images are smaller than the architectures' own (fewer MACs per run, the
same graphs).

Run: ``python -m benchmarks.tolerance_reference [--full]`` (quick: the sensor net alone).
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
import torch

import amppass
from amppass.analysis import tolerance
from amppass.onnx.macs import node_macs, operands
from amppass.onnx.policy import is_heavy
from amppass.onnx.view import name_nodes, value_types
from amppass.targets import onnxruntime_facts

from .lean_onnx import bert, images, vit

NOTES = ("heavy_low: share of the heavy ops' multiply-accumulates (MatMul, Gemm, Conv, ...) planned fp16, for "
         "each ranking: default (amppass's: estimated effects checked by region runs), local (local error "
         "alone, the former default), ref (the reference: each candidate alone moved to fp32, one "
         "run each); gap: ref - default in points; runs: full runs of the model over the calibration feeds; "
         "error: the largest ||out - out_fp32|| / ||out_fp32|| on the calibration feeds (as the search "
         "measured it) and held_out on feeds not calibrated on, onnxruntime CPU.")
CALIBRATION_SEEDS = (0, 1)
HELD_OUT_SEEDS = (10, 11)


@dataclass(frozen=True)
class Case:
    """A model of the benchmark: how to build its fp32 ONNX export and its feeds, and its tolerance."""

    name: str
    build: Callable[[], onnx.ModelProto]
    feed: Callable[[int], dict[str, np.ndarray]]  # seed -> one feed
    tolerance: float
    quick: bool = False


def _torch_case(name: str, make: Callable[[], tuple[torch.nn.Module, Callable[[int], tuple]]], tolerance: float
                ) -> Case:
    """A case exported from a torch model by the dynamo exporter, built once on first use."""
    built: dict[str, object] = {}

    def model_and_inputs() -> tuple[onnx.ModelProto, Callable[[int], tuple]]:
        if not built:
            from amppass.pipelines.export_onnx import export_fp32

            module, inputs = make()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                built["model"] = export_fp32(module, inputs(0))
            built["inputs"] = inputs
        return built["model"], built["inputs"]  # type: ignore[return-value]

    def feed(seed: int) -> dict[str, np.ndarray]:
        model, inputs = model_and_inputs()
        return {i.name: t.numpy() for i, t in zip(model.graph.input, inputs(seed), strict=False)}

    return Case(name, lambda: model_and_inputs()[0], feed, tolerance)


def _resnet50() -> tuple[torch.nn.Module, Callable[[int], tuple]]:
    from models import build

    return build("resnet", size="base").model, images(96)


def _efficientnet_b0() -> tuple[torch.nn.Module, Callable[[int], tuple]]:
    from models.arch import build_arch

    return build_arch("efficientnet_b0").model, images(96)


def _fixed_batch(model: onnx.ModelProto, batch: int = 1) -> onnx.ModelProto:
    """``model`` with its symbolic batch axes (axis 0 of inputs and outputs) set to ``batch``."""
    for value in list(model.graph.input) + list(model.graph.output):
        dims = value.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_param"):
            dims[0].dim_value = batch
    return model


def _sensor() -> Case:
    from models.sensor import sensor_feed, sensor_net

    return Case("sensor net", sensor_net, sensor_feed, 1e-2, quick=True)


def _db() -> Case:
    from models.arch import build_arch, db_onnx

    side = 256
    inputs = build_arch("db_text_detector", shape=side).make_inputs
    return Case("DB text detector 256x256", lambda: _fixed_batch(db_onnx(shape=side)),
                lambda seed: {"image": inputs(seed)[0].numpy()}, 1e-4)


def _audio() -> Case:
    from models.arch import audio_onnx, build_arch

    inputs = build_arch("audio_cqt").make_inputs
    return Case("audio CQT classifier", lambda: _fixed_batch(audio_onnx()),
                lambda seed: {"waveform": inputs(seed)[0].numpy()}, 1e-4)


def cases() -> list[Case]:
    """Every model of the benchmark, with its tolerance."""
    return [
        _sensor(), _db(), _audio(),
        _torch_case("ResNet-50 96x96", _resnet50, 2e-4),
        _torch_case("EfficientNet-B0 96x96", _efficientnet_b0, 1.5e-4),
        _torch_case("BERT 4 layers, 64 tokens", lambda: bert(4, 256), 1e-4),
        _torch_case("ViT-Base/16 4 layers", vit, 3e-4),
    ]


def compare(case: Case) -> dict:
    """One row: the default search and the reference on ``case``."""
    model = case.build()
    calibration = [case.feed(s) for s in CALIBRATION_SEEDS]
    held_out = [case.feed(s) for s in HELD_OUT_SEEDS]
    reference = _session(model)
    wanted = [reference.run(None, feed) for feed in held_out]  # fp32 outputs, run once for every ranking
    macs = heavy_macs(model, calibration[0])
    row: dict = {"model": case.name, "tolerance": case.tolerance}
    for label, strategy in STRATEGIES:
        start = time.perf_counter()
        with tolerance.ranking(strategy):
            converted = amppass.convert_onnx(model, "fp16", calibration=calibration, tolerance=case.tolerance)
        seconds = time.perf_counter() - start
        report = amppass.report(converted)
        info = report.info
        row.setdefault("initial_error", info["initial_error"])
        row[f"heavy_low_{label}"] = heavy_low_share(report.rows, macs)
        row[f"runs_{label}"] = info["tolerance_runs"]
        row[f"moved_{label}"] = info["moved_by_tolerance"]
        row[f"error_{label}"] = info["achieved_error"]
        row[f"held_out_{label}"] = _error(wanted, _session(converted), held_out)
        row[f"convert_s_{label}"] = round(seconds, 1)
    row["gap_points"] = round(100 * (row["heavy_low_ref"] - row["heavy_low_default"]), 1)
    return row


# (column label, ranking): amppass's default, the ranking by local error alone it replaced, the reference
STRATEGIES = (("default", tolerance.by_region_effect), ("local", tolerance.by_local_error),
              ("ref", tolerance.by_error_alone))


def heavy_low_share(rows: list, macs: dict[str, int]) -> float:
    """Share of the heavy ops' multiply-accumulates (``macs``, by node name) in the rows planned low."""
    total = sum(macs.values())
    low = sum(macs.get(r.name, 0) for r in rows if r.precision in ("fp16", "bf16"))
    return round(low / total, 3) if total else float("nan")


def heavy_macs(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> dict[str, int]:
    """Node name (as the conversion names nodes) -> multiply-accumulates of each heavy node of the main
    graph, from the shapes one fp32 run on ``feed`` gives (the report's own count needs shapes that shape
    inference alone cannot always find: a Pad or Reshape fed by computed values)."""
    named = onnx.ModelProto()
    named.CopyFrom(model)
    name_nodes(named)
    heavy = [n for n in named.graph.node if is_heavy(n)]
    types = value_types(onnx.shape_inference.infer_shapes(named))
    shapes = {t.name: list(t.dims) for t in named.graph.initializer}
    wanted = [v for v in dict.fromkeys(v for n in heavy for v in operands(n)) if v and v not in shapes]
    declared = {o.name for o in named.graph.output}
    named.graph.output.extend(onnx.helper.make_tensor_value_info(v, types[v], None) for v in wanted
                              if v not in declared and v in types)
    values = _session(named).run(wanted, feed)
    shapes.update({v: list(a.shape) for v, a in zip(wanted, values, strict=False)})
    counted = {n.name: node_macs(n, shapes) for n in heavy}
    return {name: count for name, count in counted.items() if count}


def run(quick: bool) -> list[dict]:
    """The table: one row per model (the quick set or all of them)."""
    return [compare(case) for case in cases() if case.quick or not quick]


def _session(model: onnx.ModelProto):
    import onnxruntime as ort

    loadable = onnx.ModelProto()
    loadable.CopyFrom(model)
    loadable.ir_version = min(loadable.ir_version, onnxruntime_facts.max_ir_version())
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(loadable.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _error(wanted: list[list[np.ndarray]], converted, feeds: list[dict]) -> float:
    """The largest relative error of ``converted``'s floating outputs against ``wanted`` (per feed)."""
    worst = 0.0
    for want_all, feed in zip(wanted, feeds, strict=False):
        for want, got in zip(want_all, converted.run(None, feed), strict=False):
            if np.issubdtype(want.dtype, np.floating):
                want64, got64 = want.astype(np.float64), got.astype(np.float64)
                worst = max(worst, float(np.linalg.norm(got64 - want64) / max(np.linalg.norm(want64), 1e-30)))
    return worst


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)
    for found in run(quick="--full" not in sys.argv):
        print(found, flush=True)
