"""ONNX: convert an fp32 .onnx file to fp16, save it, run it in onnxruntime beside the fp32 file, and report.

The file is the zoo's small CNN as the TorchScript exporter writes it (``models/onnx_export.py``); any fp32
model file works the same way (``python -m examples.onnx`` writes ``cnn.onnx`` and ``cnn.fp16.onnx`` in the
current folder).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

import amppass
from models import build
from models.onnx_export import export


def main() -> None:
    case = build("cnn", "small")
    export(case.model, case.example_inputs, ["image"], ["logits"], "cnn.onnx")

    converted = amppass.convert_onnx("cnn.onnx", dtype="fp16")     # an onnx.ModelProto, decisions in its metadata
    amppass.save(converted, "cnn.fp16.onnx")                      # written whole, then renamed into place
    print(amppass.report("cnn.fp16.onnx").summary())              # read back from the file alone

    feed = {"image": case.make_inputs(1)[0].numpy()}              # inputs the example did not use
    fp32 = ort.InferenceSession("cnn.onnx", providers=["CPUExecutionProvider"]).run(None, feed)[0]
    fp16 = ort.InferenceSession("cnn.fp16.onnx", providers=["CPUExecutionProvider"]).run(None, feed)[0]
    error = float(np.linalg.norm(fp16 - fp32) / np.linalg.norm(fp32))
    print(f"output dtype {fp16.dtype} (inputs and outputs keep fp32), relative error against fp32: {error:.1e}")
    assert fp16.dtype == np.float32 and error < 1e-2


if __name__ == "__main__":
    main()
