"""What an fp8 conversion with a tolerance costs: the fp8 section's conversion of one model (tolerance 0.02) in
CPU seconds (``time.process_time``: the machine may be shared), with its tolerance search's trials and batch runs
and the products it put in fp8.

``python -m benchmarks.fp8_search_cost --front torch`` converts the real all-MiniLM-L6-v2 as the section does
(``amppass.convert``); ``--front onnx`` exports its fp8 ONNX file for the CPU target (``amppass.export_onnx``);
``--model bert`` takes BERT-base (random weights) instead. ``--every-batch`` judges every batch of every trial
(``amppass.analysis.tolerance.STOP_EARLY = False``): the decisions must be the same, in more batch runs. One torch
thread, so the seconds compare across loads.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

import amppass
from amppass.analysis import tolerance

from . import fp8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--front", choices=("torch", "onnx"), default="torch")
    parser.add_argument("--model", choices=sorted(fp8.MODELS), default="minilm")
    parser.add_argument("--every-batch", action="store_true", help="judge every batch of every trial")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tolerance.STOP_EARLY = not args.every_batch
    case = fp8.MODELS[args.model]()
    start = time.process_time()
    if args.front == "torch":
        converted = amppass.convert(case.model, example_kwargs=case.calibration[0], dtype="fp8", plan_for="coverage",
                                    calibration=case.calibration, tolerance=fp8.TOLERANCE)
    else:
        feeds = [{k: v.numpy() for k, v in batch.items()} for batch in case.calibration]
        with tempfile.TemporaryDirectory() as folder:
            converted = amppass.export_onnx(case.model, os.path.join(folder, "model.fp8.onnx"),
                                            example_kwargs=case.calibration[0], dtype="fp8", calibration=feeds,
                                            tolerance=fp8.TOLERANCE, target="cpu")
    seconds = time.process_time() - start
    report = amppass.report(converted)
    info = report.info["fp8"]
    chosen = sorted(row.name for row in report.fp8_rows() if row.evidence["fp8"].get("format"))
    print(json.dumps({"model": case.name, "front": args.front, "cpu_s": round(seconds, 1), "trials": info["trials"],
                      "batch_runs": info["batch_runs"], "judged_batches": info["judged_batches"],
                      "error_bound": info["error_bound"], "fp8_products": chosen}))


if __name__ == "__main__":
    main()
