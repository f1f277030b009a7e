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
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..dtypes import low_type
from ..errors import InputError
from ..pipelines.convert import convert

log = logging.getLogger(__name__)

__all__ = ["Route", "converted", "route", "unroute"]


class Route:
    """The ``forward`` installed on a module by :func:`route`; callable as the module's forward.

    Args:
        module: the module whose calls it runs.
        dtype: the low dtype of the conversion ("fp16" / "bf16" or the torch dtype).
        options: further keyword arguments of :func:`amppass.convert` (``keep_fp32=...``), except those the route
            sets itself (``mode``, ``dtype``, the example).
    """

    def __init__(self, module: nn.Module, dtype: Any, options: dict[str, Any]) -> None:
        taken = {"mode", "dtype", "example_inputs", "example_kwargs"} & set(options)
        if taken:
            raise InputError(f"convert options {sorted(taken)} are set by the integration itself (a train-mode "
                             "conversion in the integration's dtype, with the first call as the example); leave them out")
        self.dtype = low_type(dtype).torch
        self._module = weakref.ref(module)
        self._options = dict(options)
        self._converted: nn.Module | None = None
        self._name = type(module).__name__
        self.__signature__ = inspect.signature(module.forward)  # rule 3: what Trainer and others inspect

    def __deepcopy__(self, memo: dict[int, Any]) -> "Route":
        """``copy.deepcopy`` of a routed module (an EMA or SWA copy) routes the copy: a route of its own, converted
        at the copy's first call over the copy's tensors."""
        module = self._module()
        copied = memo.get(id(module), module)
        return Route(copied, self.dtype, self._options)

    @property
    def converted(self) -> nn.Module | None:
        """The train-mode conversion (for :func:`amppass.report`), or None before the first call."""
        return self._converted

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        if module is None:
            raise InputError(f"the {self._name} this route was installed on no longer exists")
        if self._converted is None:
            self._convert(module, args, kwargs)
        converted = self._converted
        assert converted is not None  # _convert sets it
        if converted.training != module.training:
            converted.train(module.training)
        with _own_forward(module):  # a shape the plan does not take is captured again from the original
            return converted(*args, **kwargs)

    def _convert(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Rules 1 and 2."""
        with torch.inference_mode(False), torch.enable_grad(), _own_forward(module):
            args, kwargs = pytree.tree_map_only(torch.Tensor, _outside_inference, (args, kwargs))
            fast = convert(module, args, self.dtype, example_kwargs=kwargs or None, mode="train", **self._options)
        fast.load_state_dict(module.state_dict(keep_vars=True), assign=True)
        self._converted = fast
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


def route(module: nn.Module, dtype: Any, **options: Any) -> Route:
    """Install a :class:`Route` as ``module.forward`` and return it; a module already routed keeps its route.

    Raises :class:`~amppass.errors.InputError` if the module is routed to another dtype.
    """
    current = module.__dict__.get("forward")
    if isinstance(current, Route):
        if current.dtype != low_type(dtype).torch:
            raise InputError(f"{type(module).__name__} already trains through amppass in {current.dtype}; it cannot "
                             f"also train in {low_type(dtype).torch}: use one integration and one dtype")
        return current
    if current is not None:
        raise InputError(f"{type(module).__name__}.forward was already replaced on the instance ({current!r}), "
                         "e.g. by accelerate's autocast wrapper: hand amppass the model before the tool prepares it")
    made = Route(module, dtype, options)
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
