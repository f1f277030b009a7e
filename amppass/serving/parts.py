"""A model converted by parts: the original's module tree, its largest capturable submodules converted.

:mod:`amppass.pipelines.parts` builds it where torch.export cannot take the whole model. What it returns is a
private copy of the model (an instance of the model's own class, every method and attribute the model has)
whose converted submodules stand in their originals' places; the code between them is the model's own
Python. This module holds what that copy carries: :class:`PartsRecord` (which submodule became what, and why
the others run as the model's code), read by :func:`amppass.report` and checked by everything that takes a
converted model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

PARTS_KEY = "_amppass_parts"  # instance attribute of the returned model holding its PartsRecord


@dataclass
class PartsRecord:
    """What a conversion by parts did, by module path ("" is the model itself).

    ``converted``: the paths whose module was converted; ``eager``: the paths that run as the model's own code,
    each with why (the capture's one-line reason, or why it was not tried); ``macs``: the multiply-adds one
    eager call of the model on the example made, counted by torch's FLOP counter (None if it counted none);
    ``dtype`` and ``mode`` of the conversion; ``why_whole``: why the model itself did not capture whole.
    """

    converted: list[str]
    eager: dict[str, str]
    macs: int | None
    dtype: str
    mode: str
    why_whole: str
    info: dict[str, Any] = field(default_factory=dict)

    def modules(self, model: nn.Module) -> dict[str, nn.Module]:
        """The converted submodules of ``model`` (the module this record belongs to), by path."""
        return {path: model.get_submodule(path) for path in self.converted}


def parts_of(module: Any) -> PartsRecord | None:
    """The record of a model converted by parts, or None for any other object."""
    record = getattr(module, "__dict__", {}).get(PARTS_KEY)
    return record if isinstance(record, PartsRecord) else None
