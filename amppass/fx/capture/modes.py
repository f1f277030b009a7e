"""Train and eval mode for capture and export, with every submodule's own flag restored afterwards."""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn


@contextlib.contextmanager
def module_mode(model: nn.Module, train: bool) -> Iterator[None]:
    """Put ``model`` in train or eval mode (for capture or export), then restore every submodule's own flag.

    A model already in that mode keeps its submodules' own flags: a batch norm frozen with ``bn.eval()`` in a
    training model, a dropout left on for sampling in an evaluating one, are captured as the user set them
    (:func:`captured_flags` says which)."""
    flags = [(m, m.training) for m in model.modules()]
    if model.training != train:
        model.train(train)
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag


def captured_flags(model: nn.Module, train: bool) -> dict[str, bool]:
    """The submodules :func:`module_mode` leaves in the other mode than ``train``, by name: those of a model
    already in that mode whose own flag differs (none for a model it switches)."""
    if model.training != train:
        return {}
    return {name: m.training for name, m in model.named_modules() if name and m.training != train}
