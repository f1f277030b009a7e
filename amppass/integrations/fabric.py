"""amppass as a Lightning Fabric precision plugin: ``Fabric(plugins=[AmpPassPrecision("fp16")])``.

::

    plugin = AmpPassPrecision("fp16")
    fabric = Fabric(accelerator="cpu", plugins=[plugin])     # no precision= flag
    model, optimizer = fabric.setup(model, optimizer)
    fabric.backward(loss)                                   # scaled
    fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)   # unscaled first
    optimizer.step()                                        # skipped on inf/NaN gradients; the scale updated
    fabric.save(path, {"model": model, "optimizer": optimizer, "scaler": plugin.scaler})

The module given to ``fabric.setup`` is converted at its first call and trains its own parameters
(:mod:`amppass.integrations.routing`): the optimizer built over it before ``setup`` is the right one, and
``fabric.save`` (which reads the module you passed) saves the trained state. No autocast runs around it. Fabric
does not checkpoint its precision plugin: save ``plugin.scaler`` (a LossScaler has ``state_dict`` and
``load_state_dict``, so ``fabric.save``/``fabric.load`` take it as they take an optimizer). Under fp16 pass
``error_if_nonfinite=False`` to ``fabric.clip_gradients``: a step whose gradients overflow is the scaler's to skip
(as with Fabric's own ``precision="16-mixed"``).

One plugin for each Lightning package, built from the one implementation below
(:mod:`amppass.integrations.lightning.packages`), since each ``Fabric`` accepts only its own package's
``Precision``; each imports its package only at first use:

- ``lightning_fabric.Fabric`` (installed with pytorch-lightning): ``amppass.integrations.fabric.AmpPassPrecision``
  (where only the unified ``lightning`` package is installed, this name gives the next one);
- ``lightning.Fabric`` (``import lightning as L``, ``lightning.fabric.Fabric``):
  ``amppass.integrations.lightning.fabric.AmpPassPrecision``.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch
from torch import nn

from ..training import LossScaler
from .lightning import packages
from .routing import route
from .scaling import ScaledPrecision

__all__ = ["AmpPassPrecision", "plugin_class"]  # noqa: F822 - the module's __getattr__ gives it, importing lightning_fabric only then


class FabricPrecision(ScaledPrecision):
    """Fabric precision plugin training the module given to ``fabric.setup`` through amppass (module docstring).

    The methods of every package's ``AmpPassPrecision`` (:func:`plugin_class` puts them on the package's
    ``Precision``).

    Args:
        dtype: "fp16" (loss-scaled) or "bf16".
        scaler: the LossScaler for fp16 (default ``amppass.LossScaler()``).
        convert_options: keyword arguments of :func:`amppass.convert` (``keep_fp32=...``).
    """

    def __init__(self, dtype: Literal["fp16", "bf16"] | torch.dtype = "fp16", *, scaler: LossScaler | None = None,
                 **convert_options: Any) -> None:
        self._set_precision(dtype, scaler, convert_options)

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Route the module through amppass (in place; returned)."""
        route(module, self._conversion)
        return module

    def backward(self, tensor: torch.Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Backward of the scaled loss (fp16)."""
        super().backward(self._scaling.scale(tensor), model, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step through the scaler: unscaled unless clipping did it, skipped on inf/NaN gradients."""
        return self._scaling.step(optimizer, **kwargs)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale before ``fabric.clip_gradients`` clips."""
        self._scaling.unscale(optimizer)


@functools.cache
def plugin_class(package: str) -> type:
    """``AmpPassPrecision`` for the Fabric of ``package``, "lightning_fabric" or "lightning.fabric" (imported here)."""
    (precision,) = packages.load(package, "plugins.precision")
    return packages.build(FabricPrecision, precision.Precision, package)


def __getattr__(name: str) -> Any:
    """``AmpPassPrecision``: the plugin for lightning_fabric, or for lightning.fabric where only that one is
    installed; its package is imported here, at first use."""
    if name == "AmpPassPrecision":
        return plugin_class(packages.installed("lightning_fabric", "lightning.fabric"))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
