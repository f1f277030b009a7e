"""A model converted by parts: the original's module tree, its largest capturable submodules converted.

:mod:`amppass.pipelines.parts` builds it where torch.export cannot take the whole model. What it returns is a
private copy of the model (an instance of the model's own class, every method and attribute the model has)
whose converted submodules stand in their originals' places; the code between them is the model's own
Python. This module holds what that copy is: an instance of :class:`ByParts`'s subclass of the model's class
(:func:`by_parts`), as a kept original is of :class:`~amppass.serving.fp32_original.Fp32Original`'s, carrying its
:class:`PartsRecord` (which submodule became what, and why the others run as the model's code), which
:class:`~amppass.serving.artifact.PartsArtifact` answers with; the class's own ``save_pretrained`` and ``save`` are
the shared savers of :mod:`amppass.serving.dropin`, writing the original.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from .dropin import held_in, mixed_class, said_at_save, savers

PARTS_KEY = "_amppass_parts"  # instance attribute of the returned model holding its PartsRecord


@dataclass
class PartsRecord:
    """What a conversion by parts did, by module path ("" is the model itself).

    ``converted``: the paths whose module was converted; ``eager``: the paths that run as the model's own code,
    each with why (the capture's one-line reason, or why it was not tried); ``macs``: the multiply-adds one
    eager call of the model on the example made, counted by torch's FLOP counter (None if it counted none);
    ``dtype`` and ``mode`` of the conversion; ``why_whole``: why the model itself did not capture whole;
    ``kept_fp32``: the paths (of ``eager``) that converted but run as the original, as their conversion says
    they are better left (slower converted, or nothing in them runs low); ``notes``: by path, what amppass
    warned while that part converted (logged at info level: this record says what each part became).
    """

    converted: list[str]
    eager: dict[str, str]
    macs: int | None
    dtype: str
    mode: str
    why_whole: str
    info: dict[str, Any] = field(default_factory=dict)
    kept_fp32: list[str] = field(default_factory=list)
    notes: dict[str, list[str]] = field(default_factory=dict)  # amppass's warnings while each part converted
    originals: dict[str, nn.Module] = field(default_factory=dict, repr=False)  # inference: each part's module

    def modules(self, model: nn.Module) -> dict[str, nn.Module]:
        """The converted submodules of ``model`` (the module this record belongs to), by path."""
        return {path: model.get_submodule(path) for path in self.converted}


class ByParts(nn.Module):
    """What amppass adds to the class of a model converted by parts: its record (:func:`parts_of`) and the class's
    own save methods writing the original. Made by :func:`by_parts`; defines no ``forward``: the model class's runs
    (its own Python between the converted parts)."""

    @property
    def original_class(self) -> type:
        """The class of the model that was converted."""
        return type(self).__mro__[2]

    def _amppass_saveable(self, how: str) -> tuple[nn.Module, Callable[[str], None]]:
        """What the class's ``how`` method writes (:mod:`amppass.pipelines.parts`, rule 8): this model in its own
        class with each converted part its original again, whose tensors are the caller's fp32 ones (in train mode
        its parts hold the original's keys already, and their fp32 tensors trained); then the log line saying so."""
        record = parts_of(self)
        name, weights = self.original_class.__name__, "trained fp32" if record.mode == "train" else "fp32"

        def beside(folder: str) -> None:
            said_at_save("parts", f"{name}.{how}({folder!r}) wrote the original's keys and {weights} weights; a model "
                         "converted by parts is not saved with its conversion (its own Python runs between the "
                         "converted parts): convert the loaded model again")

        return _originals(self, "", record.originals), beside

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Copied and pickled as what it is: an instance of the by-parts class of its original's class, with its
        state (the original's class must be importable to load it)."""
        return _remade, (self.original_class,), self.__dict__


def by_parts(model: nn.Module, record: PartsRecord) -> nn.Module | None:
    """``model`` (the private copy the parts were converted in) made an instance of the subclass of its class and
    :class:`ByParts`, carrying ``record``; None for a class that cannot take another base (a C layout)."""
    return model if held_in(model, _parts_class(type(model)), PARTS_KEY, record, "the model") else None


def _parts_class(cls: type) -> type:
    return mixed_class(ByParts, cls, f"{cls.__name__} converted by parts by amppass.convert (amppass.pipelines.parts).",
                       lambda model_class: savers(model_class, ByParts._amppass_saveable))


def _remade(cls: type) -> ByParts:
    """An empty instance of the by-parts class of ``cls``, for copy and pickle to fill with its state."""
    return object.__new__(_parts_class(cls))


def _originals(module: nn.Module, prefix: str, originals: dict[str, nn.Module]) -> nn.Module:
    """``module`` (at ``prefix``) with every converted part below it its original again; a copy only where a part
    is below it (the model itself always, in its own class), sharing everything else."""
    if prefix in originals:
        return originals[prefix]
    if prefix and not any(path.startswith(prefix + ".") for path in originals):
        return module
    if prefix:
        copied = copy.copy(module)
    else:  # the model itself, in its own class: its save methods are the class's own
        cls = module.original_class
        copied = cls.__new__(cls)
        copied.__dict__.update({key: value for key, value in vars(module).items() if key != PARTS_KEY})
    copied.__dict__["_modules"] = {name: _originals(child, f"{prefix}.{name}" if prefix else name, originals)
                                   if child is not None else None for name, child in module._modules.items()}
    return copied


def parts_of(module: Any) -> PartsRecord | None:
    """The record of a model converted by parts, or None for any other object."""
    return module.__dict__[PARTS_KEY] if isinstance(module, ByParts) else None
