"""A model converted by parts: the original's module tree, its largest capturable submodules converted.

:mod:`amppass.pipelines.parts` builds it where torch.export cannot take the whole model. What it returns is a
private copy of the model (an instance of the model's own class, every method and attribute the model has)
whose converted submodules stand in their originals' places; the code between them is the model's own
Python. This module holds what that copy carries: :class:`PartsRecord` (which submodule became what, and why
the others run as the model's code), read by :func:`amppass.report` and checked by everything that takes a
converted model.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .dropin import said_at_save, saved_folder

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
    originals: dict[str, nn.Module] = field(default_factory=dict, repr=False)  # inference: each part's module

    def modules(self, model: nn.Module) -> dict[str, nn.Module]:
        """The converted submodules of ``model`` (the module this record belongs to), by path."""
        return {path: model.get_submodule(path) for path in self.converted}


# the model class's own ways to write it to disk (transformers, sentence-transformers)
SAVERS = ("save_pretrained", "save")


def with_original_savers(model: nn.Module) -> None:
    """Give a model converted by parts for inference the save methods its class has, writing what the original's
    would (its keys and fp32 weights, which its plain class loads): each runs on a module tree of the model's
    class whose converted parts are their originals again, which share the caller's fp32 tensors."""
    for name in SAVERS:
        if callable(getattr(type(model), name, None)):
            model.__dict__[name] = functools.partial(_save_as_original, model, name)


def _save_as_original(model: nn.Module, name: str, *args: Any, **kwargs: Any) -> Any:
    record = parts_of(model)
    done = getattr(_originals(model, "", record.originals), name)(*args, **kwargs)
    folder = saved_folder(getattr(type(model), name), model, args, kwargs)
    if folder is not None:
        said_at_save("parts", f"{type(model).__name__}.{name}({folder!r}) wrote the original's keys and fp32 "
                     "weights; a model converted by parts is not saved with its conversion (its own Python runs "
                     "between the converted parts): convert the loaded model again")
    return done


def _originals(module: nn.Module, prefix: str, originals: dict[str, nn.Module]) -> nn.Module:
    """``module`` (at ``prefix``) with every converted part below it its original again; a copy only where a part
    is below it, sharing everything else."""
    if prefix in originals:
        return originals[prefix]
    if not any(path.startswith(prefix + ".") or not prefix for path in originals):
        return module
    copied = copy.copy(module)
    for name in SAVERS:
        copied.__dict__.pop(name, None)
    copied.__dict__.pop(PARTS_KEY, None)
    copied.__dict__["_modules"] = {name: _originals(child, f"{prefix}.{name}" if prefix else name, originals)
                                   if child is not None else None for name, child in module._modules.items()}
    return copied


def parts_of(module: Any) -> PartsRecord | None:
    """The record of a model converted by parts, or None for any other object."""
    record = getattr(module, "__dict__", {}).get(PARTS_KEY)
    return record if isinstance(record, PartsRecord) else None
