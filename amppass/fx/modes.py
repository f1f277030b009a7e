"""Train and eval mode for capture and export, with every submodule's own flag restored afterwards."""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn


@contextlib.contextmanager
def module_mode(model: nn.Module, train: bool) -> Iterator[None]:
    """Put ``model`` in train or eval mode (for capture or export), then restore every submodule's own flag."""
    flags = [(m, m.training) for m in model.modules()]
    model.train(train)
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag
