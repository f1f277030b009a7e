"""The public entry points, each a pipeline over the stages below it: ``convert`` (torch), ``convert_onnx``,
``export_onnx``, the torch.compile backend, ``save``/``load`` (.pt2) and ``report``."""
