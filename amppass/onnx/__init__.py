"""The ONNX front end: policy table, neutral view, edge-cast rewrite, calibration runs, files in and out.

Modules import the ``onnx`` package absolutely, so this subpackage never shadows it.
"""
