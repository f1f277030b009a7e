"""The original module, kept in fp32, where every converted plan measured slower on the target.

A captured graph runs the ops the model's Python code called, one by one. Some modules run faster eagerly
than any graph of their ops can: ``nn.TransformerEncoder`` in inference takes PyTorch's fused "fast path"
kernel, which torch.export decomposes. When profitability (:mod:`amppass.analysis.profitability`) finds the converted
graph slower than the original module in fp32 on the target, :func:`amppass.convert` returns
:func:`keep_original`'s module instead, which :func:`amppass.report` shows as its one row.

A train-mode plan for speed on a device without native arithmetic for the low dtype is kept fp32 the same way,
decided from the device's facts before anything is captured (:func:`amppass.analysis.profitability.fp32_by_device`);
that copy owns its weights, which training writes.

That module must cost what calling the original costs, since it exists because the original is the fastest
thing to run. So it is the original, not a wrapper around it: a private copy of the original module (own module
objects, the original's tensors, never written) whose class is a subclass of the original's and of
:class:`Fp32Original`. Its ``forward`` is the original class's own, called with no layer in between; ``isinstance``
holds for both classes, and the methods of the original's class (``generate()``, ``encode()``) are there.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Mapping

from torch import nn

from ..analysis.record import META_KEY
from ..fx.capture.copies import shared_copy
from ..reporting.report import Report, Row
from .dropin import held_in, mixed_class, said_at_save, saved_folder

_INFO = "_amppass_kept"  # instance attribute holding the measurement (``meta[META_KEY]``)


class Fp32Original(nn.Module):
    """What amppass adds to a kept original's class: its measurement (``meta``), :meth:`report` and
    :meth:`drop_original`. Made by :func:`keep_original`; defines no ``forward``: the original class's runs."""

    @property
    def meta(self) -> dict[str, Any]:
        """``{"amppass": info}``, as every converted module carries it."""
        return {META_KEY: self.__dict__[_INFO]}

    @property
    def original_class(self) -> type:
        """The class of the module that was kept."""
        return type(self).__mro__[2]

    def drop_original(self) -> None:
        """Nothing to release: this module holds its own copy of the caller's module objects, never the caller's
        module itself, and runs the caller's fp32 tensors (its own copies, kept for training), which it needs (as
        every converted module has it)."""

    def report(self) -> Report:
        """The one decision: the whole module runs fp32, with the times that decided it."""
        info = self.__dict__[_INFO]
        whole = info["whole_model"]
        reason = (f"profitability: {kept_because(info)}; the original runs, in fp32. plan_for='coverage' or 'memory' "
                  "converts it anyway")
        row = Row(self.original_class.__name__, "module", "fp32", reason, "profitability", [], dict(whole),
                  "whole-model")
        return Report([row], info)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Copied and pickled as what it is: an instance of the kept class of its original's class, with its
        state (``copy.deepcopy``, ``torch.save``; the original's class must be importable to load it)."""
        return _remade, (self.original_class,), self.__dict__


def kept_because(info: Mapping[str, Any]) -> str:
    """Why the original was kept, in words, from a kept module's record: the two times where both were measured,
    else the reason nothing was timed (never a placeholder for a time that does not exist)."""
    whole = info.get("whole_model") if isinstance(info.get("whole_model"), dict) else {}
    converted, original = whole.get("converted_ms"), whole.get("original_ms")
    if isinstance(whole.get("skipped"), str) or not all(isinstance(t, (int, float)) for t in (converted, original)):
        return str(whole.get("skipped") or "the converted graph was not timed against it")
    target = info.get("target") if isinstance(info.get("target"), dict) else {}
    where = f"on this {target['name'].upper()}" if isinstance(target.get("name"), str) else "here"
    return (f"the converted graph took {converted:.3g} ms per call {where} against "
            f"{original:.3g} ms for the original module in fp32 (its eager kernels are faster than any captured graph "
            "of them here)")


def keep_original(model: nn.Module, info: dict[str, Any], train: bool = False) -> Fp32Original | None:
    """A private copy of ``model`` in eval mode, in the subclass of its class and :class:`Fp32Original`, carrying
    ``info`` (module docstring); ``None`` for a class that cannot take another base (a C layout).

    With ``train`` (a train-mode plan the device keeps fp32: :func:`amppass.analysis.profitability.fp32_by_device`)
    the copy owns copies of the parameters and buffers, tied ones still tied, since training writes them and
    must never write the caller's, and every module keeps the mode it has, as a train-mode conversion does."""
    # own module objects: .train() never reaches the caller's
    kept = copy.deepcopy(model) if train else shared_copy(model)
    if not held_in(kept, _kept_class(type(model)), _INFO, info, "the original module"):
        return None
    if not train:
        kept.eval()
    return kept


def _remade(cls: type) -> Fp32Original:
    """An empty instance of the kept class of ``cls``, for copy and pickle to fill with its state."""
    return object.__new__(_kept_class(cls))


def _kept_class(cls: type) -> type:
    return mixed_class(Fp32Original, cls, f"{cls.__name__} kept in fp32 by amppass.convert "
                       "(amppass.serving.fp32_original).", _saying_savers)


def _saying_savers(cls: type) -> dict[str, Any]:
    """The class's own save methods (``save_pretrained``, ``save``), each logging after it what it wrote: the
    original in fp32, which is what runs, and no plan (:mod:`amppass.serving.dropin`, rule 9)."""
    made = {}
    for name in ("save_pretrained", "save"):
        method = getattr(cls, name, None)
        if not callable(method):
            continue

        def save(self: Any, *args: Any, _method: Any = method, _name: str = name, **kwargs: Any) -> Any:
            done = _method(self, *args, **kwargs)
            folder = saved_folder(_method, self, args, kwargs)
            if folder is not None:
                said_at_save("kept", f"{cls.__name__}.{_name}({folder!r}) wrote the original model in fp32, which is "
                             "what runs: amppass.convert kept it in fp32 (amppass.report(model) says why), so there "
                             "is no plan to save; convert the loaded model on the machine it runs on, or with "
                             "plan_for='coverage', to get a converted one")
            return done

        made[name] = functools.wraps(method)(save)
    return made
