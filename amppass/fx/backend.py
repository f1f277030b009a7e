"""Kept so the ``torch_dynamo_backends`` entry point of installs made before the move still imports: the
torch.compile backend lives in :mod:`amppass.pipelines.backend`."""

from ..pipelines.backend import amppass_backend  # noqa: F401
