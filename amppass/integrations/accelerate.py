"""amppass under Hugging Face accelerate: ``prepare`` in place of ``accelerator.prepare``.

::

    accelerator = Accelerator()                      # mixed_precision left at "no": amppass does the casting
    model, optimizer, loader = amppass.integrations.accelerate.prepare(accelerator, model, optimizer, loader,
                                                                       dtype="fp16")
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)                   # scaled by amppass.LossScaler
        accelerator.clip_grad_norm_(model.parameters(), 1.0)   # unscaled first
        optimizer.step()                             # skipped on inf/NaN gradients; the scale updated
        optimizer.zero_grad()

accelerate has no precision plugin. Its ``Accelerator`` keeps a GradScaler in ``accelerator.scaler`` only for its
own fp16 autocast on a GPU, and ``unscale_gradients`` unscales only then (``native_amp`` and
``mixed_precision == "fp16"``): a scaler set by hand is never unscaled before ``clip_grad_norm_``, which then clips
gradients 65536 times too large. :func:`install_scaler` therefore puts an :class:`amppass.LossScaler` in
``accelerator.scaler`` (which ``backward``, the prepared optimizer's ``step``, ``save_state`` and ``load_state``
use) and replaces this accelerator's ``unscale_gradients`` with one that unscales through it.
"""

from __future__ import annotations

import logging
import types
import warnings
from typing import Any

import torch
from torch import nn

from ..dtypes import low_type
from ..errors import InputError
from ..training import LossScaler
from .routing import TrainConversion, route

try:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
except ImportError as error:  # pragma: no cover - the extra is missing
    raise ImportError("amppass.integrations.accelerate needs accelerate: pip install 'accelerate>=1.0'") from error

log = logging.getLogger(__name__)

__all__ = ["install_scaler", "prepare"]


def prepare(accelerator: Accelerator, model: nn.Module, *objects: Any, dtype: Any = "fp16",
            scaler: LossScaler | None = None, **convert_options: Any) -> Any:
    """``accelerator.prepare(model, *objects)`` with ``model`` trained through amppass in ``dtype``.

    The model is converted at its first call (:mod:`amppass.integrations.routing`) and trains its own parameters,
    so an optimizer built over ``model.parameters()`` before this call is the right one. For fp16 the accelerator
    gets a :class:`~amppass.LossScaler` (``scaler``, or a default one) before the optimizers are prepared.

    Args:
        accelerator: the ``Accelerator``; keep ``mixed_precision="no"``: its autocast on top of the converted
            graph casts again what amppass planned (warned about).
        model: the module to train.
        objects: optimizers, data loaders, schedulers: prepared by ``accelerator.prepare`` as usual.
        dtype: "fp16" or "bf16".
        scaler: the LossScaler for fp16 (e.g. one with ``init_scale=`` of your choice).
        convert_options: keyword arguments of :func:`amppass.convert` (``keep_fp32=...``).

    Returns what ``accelerator.prepare(model, *objects)`` returns; a bad convert option raises
    :class:`~amppass.errors.InputError` before the accelerator is changed.
    """
    conversion = TrainConversion.of(dtype, convert_options)
    if accelerator.mixed_precision != "no":
        warnings.warn(
            f"Accelerator(mixed_precision={accelerator.mixed_precision!r}) runs torch.autocast around the model "
            f"amppass converts to {low_type(dtype).name}: autocast casts again what amppass planned (ops amppass keeps "
            "fp32 run low); create the Accelerator with mixed_precision='no'",
            stacklevel=2,
        )
    install_scaler(accelerator, dtype, scaler)
    route(model, conversion)
    return accelerator.prepare(model, *objects)


def install_scaler(accelerator: Accelerator, dtype: Any, scaler: LossScaler | None = None) -> None:
    """Give ``accelerator`` an amppass :class:`~amppass.LossScaler` for fp16 (none for bf16) that it unscales
    with before clipping; before ``accelerator.prepare`` sees the optimizers.

    Raises :class:`~amppass.errors.InputError` if an optimizer was already prepared (it would keep the old
    scaler) or the accelerator runs its own fp16 GradScaler.
    """
    low = low_type(dtype).torch
    if accelerator._optimizers:
        raise InputError("install the amppass scaler before accelerator.prepare(optimizer): a prepared optimizer keeps "
                         "the scaler the accelerator had then")
    if accelerator.scaler is not None and not isinstance(accelerator.scaler, LossScaler):
        raise InputError(f"the accelerator already scales the loss with its own {type(accelerator.scaler).__name__} "
                         "(mixed_precision='fp16'): create it with mixed_precision='no' and let amppass scale")
    if scaler is not None and not scaler.is_enabled() and low == torch.float16:
        raise InputError("the LossScaler given for fp16 training is a passthrough (enabled=False or dtype bf16); "
                         "pass amppass.LossScaler() or leave scaler out")
    if low != torch.float16:
        accelerator.scaler = None  # bf16 has fp32's range: nothing to scale
        return
    accelerator.scaler = scaler if scaler is not None else LossScaler(dtype=low)
    accelerator.unscale_gradients = types.MethodType(_unscale_gradients, accelerator)


def _unscale_gradients(accelerator: Accelerator, optimizer: Any = None) -> None:
    """``Accelerator.unscale_gradients`` for the amppass scaler: every prepared optimizer, or the given ones."""
    optimizers = accelerator._optimizers if optimizer is None else optimizer
    if not isinstance(optimizers, (list, tuple)):
        optimizers = [optimizers]
    for opt in optimizers:
        while isinstance(opt, AcceleratedOptimizer):
            opt = opt.optimizer
        accelerator.scaler.unscale_(opt)
