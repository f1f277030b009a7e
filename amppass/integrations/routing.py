"""Route a module's calls to its amppass train-mode conversion, made at the module's first call.

The tools convert nothing themselves and hand the model around as an object: the transformers ``Trainer`` reads
its forward signature to drop dataset columns and calls ``save_pretrained`` on it, Lightning and Fabric checkpoint
its ``state_dict``, accelerate wraps it. So the model stays the object the user built, and only its ``forward``
changes, as accelerate's own autocast wrapper changes it (an instance attribute; the class is untouched):

1. The first call converts the module (``amppass.convert(..., mode="train")``) with that call's inputs as the
   example, so no example is asked of the user; inputs made under ``torch.inference_mode`` (a validation loop
   that runs first) are copied out of it, since the capture needs autograd.
2. The conversion is pointed at the module's own parameters and buffers (``load_state_dict(assign=True)``): the
   optimizer the tool built over ``module.parameters()`` steps what the converted graphs read, and
   ``module.state_dict()`` is the trained state under the original keys. Training through the route trains the
   module in place, as training it with the tool's own precision flag does.
3. Every call runs the conversion in the module's mode (``module.train()``/``.eval()``), by the forward signature
   of the original (``inspect.signature(module.forward)`` is the original's).
4. While amppass captures the module (the first call, or a shape the plan does not take), the instance's
   ``forward`` is lifted off: the capture sees the class's own forward, the original computation.
5. Where the conversion keeps the original in fp32 (a train-mode plan for speed on a device without native
   arithmetic for the dtype, decided before anything is captured: :mod:`amppass.analysis.profitability`, rule 5),
   every call runs the module's own forward: it trains in fp32 at the speed it has without amppass, and the
   conversion's warning says why, once.
6. The conversion's options are checked once, where the integration is made (:meth:`TrainConversion.of`: the
   conversion's :class:`~amppass.pipelines.settings.Settings`), not at the first call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..analysis.options import PlanOptions
from ..dtypes import low_type
from ..errors import InputError
from ..pipelines.convert import convert_planned
from ..pipelines.settings import Settings
from ..serving.fp32_original import Fp32Original

log = logging.getLogger(__name__)

__all__ = ["Route", "TrainConversion", "converted", "route", "unroute"]


_PLAN_OPTIONS = frozenset(field.name for field in dataclasses.fields(PlanOptions))
_CAPTURE_OPTIONS = frozenset({"target", "dynamic_shapes"})  # convert's options of the capture, not of the plan


@dataclass(frozen=True)
class TrainConversion:
    """How an integration converts the module it trains, built and checked once (:meth:`of`) where the plugin,
    trainer or ``prepare`` call is made: a bad option fails there, with the message :func:`amppass.convert` gives.

    ``settings``: the train-mode conversion's (:class:`~amppass.pipelines.settings.Settings`: its low dtype a
    ``torch.dtype``, its plan options, target and dynamic shapes).
    """

    settings: Settings

    @property
    def dtype(self) -> torch.dtype:
        """The low dtype the module trains in."""
        return self.settings.dtype

    @classmethod
    def of(cls, dtype: Any, options: Mapping[str, Any] | None = None) -> "TrainConversion":
        """A train-mode conversion to ``dtype`` with ``options``, keyword arguments of :func:`amppass.convert`
        (``keep_fp32=...``) except those the integration sets itself (``mode``, ``dtype``, the example).

        Raises :class:`~amppass.errors.InputError` for an option the integration sets, one ``convert`` does not
        take, or a value ``convert`` refuses."""
        options = dict(options or {})
        taken = {"mode", "dtype", "example_inputs", "example_kwargs"} & set(options)
        if taken:
            raise InputError(
                f"convert options {sorted(taken)} are set by the integration itself (a train-mode "
                "conversion in the integration's dtype, with the first call as the example); leave them out"
            )
        unknown = set(options) - _PLAN_OPTIONS - _CAPTURE_OPTIONS
        if unknown:
            raise InputError(f"convert options {sorted(unknown)} are not options of amppass.convert; an integration "
                             f"takes {sorted(_PLAN_OPTIONS | _CAPTURE_OPTIONS)}")
        return cls(Settings.of("train", dtype=low_type(dtype).torch, **options))


class Route:
    """The ``forward`` installed on a module by :func:`route`; callable as the module's forward.

    Args:
        module: the module whose calls it runs.
        conversion: how it is converted at its first call.
    """

    def __init__(self, module: nn.Module, conversion: TrainConversion) -> None:
        self.conversion = conversion
        self._module = weakref.ref(module)
        self._converted: nn.Module | None = None
        self._name = type(module).__name__
        self.__signature__ = inspect.signature(module.forward)  # rule 3: what Trainer and others inspect

    @property
    def dtype(self) -> torch.dtype:
        """The low dtype the module trains in."""
        return self.conversion.dtype

    def __deepcopy__(self, memo: dict[int, Any]) -> "Route":
        """``copy.deepcopy`` of a routed module (an EMA or SWA copy) routes the copy: a route of its own, converted
        at the copy's first call over the copy's tensors."""
        module = self._module()
        copied = memo.get(id(module), module)
        return Route(copied, self.conversion)

    @property
    def converted(self) -> nn.Module | None:
        """The train-mode conversion (for :func:`amppass.report`), or None before the first call."""
        return self._converted

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward: converted at the first call, then the conversion runs in the module's mode."""
        module = self._module()
        if module is None:
            raise InputError(f"the {self._name} this route was installed on no longer exists")
        if self._converted is None:
            self._convert(module, args, kwargs)
        converted = self._converted
        assert converted is not None  # _convert sets it
        if isinstance(converted, Fp32Original):  # rule 5: the module's own forward, nothing in between
            return type(module).forward(module, *args, **kwargs)
        if converted.training != module.training:
            converted.train(module.training)
        with _own_forward(module):  # a shape the plan does not take is captured again from the original
            return converted(*args, **kwargs)

    def _convert(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Rules 1 and 2."""
        with torch.inference_mode(False), torch.enable_grad(), _own_forward(module):
            args, kwargs = pytree.tree_map_only(torch.Tensor, _outside_inference, (args, kwargs))
            fast = convert_planned(module, args, self.conversion.settings, example_kwargs=kwargs or None)
        fast.load_state_dict(module.state_dict(keep_vars=True), assign=True)
        self._converted = fast
        if isinstance(fast, Fp32Original):
            log.info("%s trains in fp32 through its own forward: amppass kept it (amppass.report(converted(model)) "
                     "says why)", self._name)
            return
        log.info("%s converted to %s for training at its first call; it trains the module's own parameters",
                 self._name, self.dtype)


@contextlib.contextmanager
def _own_forward(module: nn.Module) -> Iterator[None]:
    """Rule 4: the class's forward for the duration, whatever the instance's ``forward`` is (this route, or a
    tool's wrapper around it)."""
    lifted = module.__dict__.pop("forward", None)
    try:
        yield
    finally:
        if lifted is not None:
            module.forward = lifted


def _outside_inference(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone() if tensor.is_inference() else tensor


def route(module: nn.Module, conversion: TrainConversion) -> Route:
    """Install a :class:`Route` converting as ``conversion`` says as ``module.forward`` and return it; a module
    already routed keeps its route.

    Raises :class:`~amppass.errors.InputError` if the module is routed to another dtype.
    """
    current = module.__dict__.get("forward")
    if isinstance(current, Route):
        if current.dtype != conversion.dtype:
            raise InputError(f"{type(module).__name__} already trains through amppass in {current.dtype}; it cannot "
                             f"also train in {conversion.dtype}: use one integration and one dtype")
        return current
    if current is not None:
        raise InputError(f"{type(module).__name__}.forward was already replaced on the instance ({current!r}), "
                         "e.g. by accelerate's autocast wrapper: hand amppass the model before the tool prepares it")
    made = Route(module, conversion)
    module.forward = made  # type: ignore[method-assign]
    return made


def unroute(module: nn.Module) -> None:
    """Remove the route :func:`route` installed: the module runs its own forward again (its trained weights stay)."""
    if isinstance(module.__dict__.get("forward"), Route):
        del module.forward


def converted(module: nn.Module) -> nn.Module | None:
    """The conversion a routed module trains through (pass it to :func:`amppass.report`); None before its first
    call or if it is not routed."""
    found = module.__dict__.get("forward")
    return found.converted if isinstance(found, Route) else None
