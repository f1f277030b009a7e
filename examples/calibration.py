"""Calibration and a tolerance: a conv net whose fp16 error sits in its first two layers.

Its inputs are raw-sensor-like readings, a large offset (3e4) with a unit signal on top (``models/sensor.py``):
in fp16 the offset leaves the signal 16 steps of resolution, and fp16 everywhere misses a 1e-2 output
tolerance. With calibration batches and ``tolerance=1e-2`` the search moves back to fp32 only what it must:
the two early convolutions that remove the offset. The plan is then checked on batches it never saw.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

import amppass
from models.sensor import EARLY, sensor_feed, sensor_net


def _error(model, converted, feeds) -> float:
    """The largest relative output error of ``converted`` against ``model`` over ``feeds``, in onnxruntime."""
    runs = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]) for m in (model, converted)]
    errors = []
    for feed in feeds:
        want, got = (run.run(None, feed)[0] for run in runs)
        errors.append(float(np.linalg.norm(got - want) / np.linalg.norm(want)))
    return max(errors)


def main() -> None:
    model = sensor_net()
    batches = [sensor_feed(seed) for seed in range(3)]        # calibration: one dict of arrays per batch
    unseen = [sensor_feed(seed) for seed in (100, 101)]

    converted = amppass.convert_onnx(model, dtype="fp16", calibration=batches, tolerance=1e-2)
    report = amppass.report(converted)
    print(report.summary())
    moved = sorted(row.name for row in report.rows if row.source == "tolerance")
    print(f"moved to fp32 by the search: {moved}; error on the calibration batches "
          f"{report.info['achieved_error']:.1e} (fp16 everywhere: {report.info['initial_error']:.1e})")
    unseen_error = _error(model, converted, unseen)
    print(f"error on batches the search never saw: {unseen_error:.1e}")
    assert report.info["tolerance_met"] and set(moved) <= set(EARLY)
    assert unseen_error <= 1e-2


if __name__ == "__main__":
    main()
