"""amppass as a Lightning precision plugin: ``Trainer(plugins=[AmpPassPrecision("fp16")])``.

::

    trainer = pl.Trainer(plugins=[AmpPassPrecision("fp16")], gradient_clip_val=1.0)   # no precision= flag
    trainer.fit(lit_module)

One plugin for each Lightning package, built from the one implementation below (:mod:`.packages`), since each
``Trainer`` accepts only its own package's ``Precision``; each imports its package only at first use:

- ``pytorch_lightning.Trainer``: ``amppass.integrations.lightning.AmpPassPrecision`` (where only the unified
  ``lightning`` package is installed, this name gives the next one);
- ``lightning.Trainer`` (``import lightning as L``, ``lightning.pytorch.Trainer``):
  ``amppass.integrations.lightning.pytorch.AmpPassPrecision``.

Fabric's: :mod:`amppass.integrations.fabric`.

1. ``convert_module`` (run in ``Strategy.setup``, before ``configure_optimizers``) routes the LightningModule's
   model, the child named ``module`` (default: its only child with parameters), through amppass: converted at its
   first call, with that call's inputs as the example (``example_input_array`` if the model summary runs it, else
   the first batch), training its own parameters (:mod:`amppass.integrations.routing`). So the optimizers
   ``configure_optimizers`` builds, the checkpoints (the LightningModule's own keys) and
   ``load_from_checkpoint`` into a plain LightningModule work unchanged.
2. ``forward_context`` adds no autocast: the converted graph casts where amppass planned.
3. fp16 scales the loss with an :class:`amppass.LossScaler`; the gradients are unscaled before
   ``gradient_clip_val`` clips them, in automatic optimization and in manual optimization's
   ``self.clip_gradients`` alike (Lightning's own ``MixedPrecision`` unscales only inside ``optimizer.step``), a
   step with inf/NaN gradients is skipped, and the scaler's state goes into checkpoints and comes back on
   resume (``trainer.fit(..., ckpt_path=...)``). bf16 has no scaler.
4. Lightning itself refuses a ``precision=`` flag next to a precision plugin, so autocast cannot stack.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Literal

import torch
from torch import nn

from ...errors import InputError
from ...training import LossScaler
from ..routing import route
from ..scaling import ScaledPrecision
from . import packages

__all__ = ["AmpPassPrecision", "plugin_class"]


class TrainerPrecision(ScaledPrecision):
    """Lightning precision plugin training the LightningModule's model through amppass (module docstring).

    The methods of every package's ``AmpPassPrecision`` (:func:`plugin_class` puts them on the package's
    ``Precision``).

    Args:
        dtype: "fp16" (loss-scaled) or "bf16".
        module: the name (or dotted path) of the LightningModule's submodule to convert; default: its only
            direct child with parameters.
        scaler: the LossScaler for fp16 (default ``amppass.LossScaler()``).
        convert_options: keyword arguments of :func:`amppass.convert` (``keep_fp32=...``).
    """

    package: str  # the package's name and its own classes, set by plugin_class
    _optimizer_wrapper: type
    _clip_norm: Any

    def __init__(self, dtype: Literal["fp16", "bf16"] | torch.dtype = "fp16", *, module: str | None = None,
                 scaler: LossScaler | None = None, **convert_options: Any) -> None:
        self._set_precision(dtype, scaler, convert_options)
        self.module = module

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Rule 1: route the model child of the LightningModule (in place; the LightningModule is returned)."""
        route(_target(module, self.module), self._conversion)
        return module

    def pre_backward(self, tensor: torch.Tensor, module: nn.Module) -> torch.Tensor:  # type: ignore[override]
        """Scale the loss (fp16)."""
        return super().pre_backward(self._scaling.scale(tensor), module)

    def optimizer_step(self, optimizer: Any, model: nn.Module, closure: Callable[[], Any],  # type: ignore[override]
                       **kwargs: Any) -> Any:
        """Run the closure (forward and backward), unscale, clip (Lightning's hooks), step through the scaler."""
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        result = closure()
        # automatic optimization whose training_step returned None: no backward ran, nothing to step
        skipped = result is None and model.automatic_optimization
        if not skipped and not getattr(optimizer, "_step_supports_amp_scaling", False):
            self._scaling.unscale(optimizer)
        self._after_closure(model, optimizer)
        if skipped:
            return result
        return self._scaling.step(optimizer, **kwargs)

    def clip_gradients(self, optimizer: Any, clip_val: int | float = 0.0, gradient_clip_algorithm: Any = None) -> None:
        """Clip the true gradients: unscaled first (manual optimization clips before ``optimizer.step``).
        ``gradient_clip_algorithm`` defaults to the norm."""
        if isinstance(optimizer, self._optimizer_wrapper):
            optimizer = optimizer.optimizer
        if clip_val > 0:
            self._scaling.unscale(optimizer)
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm or self._clip_norm)


@functools.cache
def plugin_class(package: str) -> type:
    """``AmpPassPrecision`` for the Trainer of ``package``, "pytorch_lightning" or "lightning.pytorch" (imported
    here)."""
    precision, optimizer, utilities = packages.load(package, "plugins.precision", "core.optimizer", "utilities")
    return packages.build(TrainerPrecision, precision.Precision, package,
                          _optimizer_wrapper=optimizer.LightningOptimizer,
                          _clip_norm=utilities.GradClipAlgorithmType.NORM)


def __getattr__(name: str) -> Any:
    """``AmpPassPrecision``: the plugin for pytorch_lightning, or for lightning.pytorch where only that one is
    installed; its package is imported here, at first use."""
    if name == "AmpPassPrecision":
        return plugin_class(packages.installed("pytorch_lightning", "lightning.pytorch"))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _target(root: nn.Module, name: str | None) -> nn.Module:
    """The submodule to convert: ``name``, or the only direct child with parameters."""
    if name is not None:
        try:
            return root.get_submodule(name)
        except AttributeError:
            children = [n for n, _ in root.named_children()]
            raise InputError(f"AmpPassPrecision(module={name!r}): {type(root).__name__} has no submodule {name!r}; "
                             f"its children are {children}") from None
    holders = [(n, child) for n, child in root.named_children() if any(True for _ in child.parameters())]
    if len(holders) != 1:
        found = [n for n, _ in holders] or "none"
        raise InputError(f"AmpPassPrecision cannot tell which submodule of {type(root).__name__} is the model to "
                         f"convert (children with parameters: {found}); name it: AmpPassPrecision(..., module='model')")
    return holders[0][1]
