"""Deprecated, removed in amppass 0.2.0: the torch.compile backend is :mod:`amppass.pipelines.backend`'s
``amppass_backend``, which the ``torch_dynamo_backends`` entry point names; only installs made before the move read it
here (and warn once, when torch.compile first looks the backend up)."""

from ..deprecation import moved

__getattr__ = moved(__name__, "0.2.0", amppass_backend="amppass.pipelines.backend")
