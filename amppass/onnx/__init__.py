"""The ONNX front end: policy table, neutral view, edge-cast rewrite, conversion and export.

Modules import the ``onnx`` package absolutely, so this subpackage never shadows it.
"""
