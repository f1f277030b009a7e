"""After the README's install alone: export a small model with amppass.export_onnx, then load and run the file in
onnxruntime at another batch size. scripts/readme_install runs it in a fresh virtual environment;
tests/test_readme_install.py runs it with what the README's install does not bring hidden."""

import os
import tempfile

import numpy
import onnxruntime
import torch

import amppass

net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
path = os.path.join(tempfile.mkdtemp(), "net.onnx")
amppass.export_onnx(net, (torch.randn(2, 8),), path)
session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
out = session.run(None, {session.get_inputs()[0].name: numpy.ones((3, 8), numpy.float32)})[0]
assert out.shape == (3, 4), out.shape
print("export_onnx: ok")
