"""The ONNX front end's files in and out: an untrusted .onnx file read without its weights (``lazy_read``), a path
or proto read for conversion and refused where it is not an ONNX model (``read_model``), its structure checked
(``validate``), external data read only from inside the model's folder (``external_data``), the
payloads held outside the proto while a conversion works on its skeleton (``weight_store``), and the model written
back, streamed (``stream_write``) and atomically (``save``).

The rest of the ONNX front end reads these modules; they read nothing of it but the graph walkers of
:mod:`amppass.onnx.view`.
"""
