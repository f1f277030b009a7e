"""The loss scaler of the Lightning and Fabric precision plugins: one :class:`amppass.LossScaler`, each optimizer's
gradients unscaled at most once a step, whichever comes first of clipping and the step."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from ..dtypes import low_type
from ..errors import InputError
from ..training import LossScaler
from .routing import TrainConversion


class PluginScaler:
    """The scaler a plugin scales, unscales and steps with; a plugin for bf16 has none (fp32's range).

    Args:
        dtype: the plugin's low dtype.
        scaler: a LossScaler for fp16 (default ``LossScaler()``); refused for bf16.
    """

    def __init__(self, dtype: Any, scaler: LossScaler | None) -> None:
        low = low_type(dtype)
        if scaler is not None and not isinstance(scaler, LossScaler):
            raise InputError(f"scaler={type(scaler).__name__}: pass an amppass.LossScaler (it has GradScaler's API, a "
                             "floor on the scale and the overflow agreement amppass's training graphs need)")
        if low.name == "bf16":
            if scaler is not None:
                raise InputError("bf16 has fp32's range and trains without a loss scaler; leave scaler out")
            self.scaler = None
        else:
            self.scaler = scaler if scaler is not None else LossScaler(dtype=low.torch)
        self._unscaled: set[int] = set()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the scale (the loss itself without a scaler)."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale, unless done already this step."""
        if self.scaler is None or id(optimizer) in self._unscaled:
            return
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            raise InputError(f"{type(optimizer).__name__} unscales inside its fused step, so its gradients cannot be "
                             "clipped before it: build it without fused=True to clip gradients under fp16")
        self.scaler.unscale_(optimizer)
        self._unscaled.add(id(optimizer))

    def step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        """``optimizer.step`` through the scaler (skipped on inf/NaN gradients), then the scale's update."""
        if self.scaler is None:
            return optimizer.step(**kwargs)
        result = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        self._unscaled.clear()
        return result

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state for the tool's checkpoint ({} without a scaler)."""
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


class ScaledPrecision:
    """What the Lightning and Fabric precision plugins share, placed before the tool's ``Precision`` base: the
    low dtype and the precision name the tool reports, a :class:`PluginScaler`, no autocast, and the scaler's
    state as the plugin's state (in the tool's checkpoints), and the conversion it routes the model through, checked
    where the plugin is made."""

    package = ""  # the Lightning package the plugin is built for (amppass.integrations.lightning.packages)

    def _set_precision(self, dtype: Any, scaler: LossScaler | None, options: dict[str, Any]) -> None:
        low = low_type(dtype)
        self._name = low.name
        self.dtype = low.torch
        self.precision = "16-mixed" if low.name == "fp16" else "bf16-mixed"  # what the tool's precision reports
        self._scaling = PluginScaler(low, scaler)
        self._conversion = TrainConversion.of(low.torch, options)

    def __repr__(self) -> str:
        # Lightning puts it in "Found invalid type for plugin ...": say which package's plugin was given
        return f"{type(self).__name__}({self._name!r}) for {self.package}"

    @property
    def scaler(self) -> LossScaler | None:
        """The LossScaler (None for bf16)."""
        return self._scaling.scaler

    def forward_context(self) -> AbstractContextManager:
        """No autocast: the converted graph casts where amppass planned."""
        return nullcontext()

    def state_dict(self) -> dict[str, Any]:
        """The LossScaler's state."""
        return self._scaling.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the LossScaler."""
        self._scaling.load_state_dict(state_dict)
