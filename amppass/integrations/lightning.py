"""amppass as a Lightning precision plugin: ``Trainer(plugins=[AmpPassPrecision("fp16")])``.

::

    trainer = pl.Trainer(plugins=[AmpPassPrecision("fp16")], gradient_clip_val=1.0)   # no precision= flag
    trainer.fit(lit_module)

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

from typing import Any, Callable, Literal

import torch
from torch import nn

from ..errors import InputError
from ..training import LossScaler
from .routing import route
from .scaling import ScaledPrecision

try:
    import pytorch_lightning as pl
    from pytorch_lightning.core.optimizer import LightningOptimizer
    from pytorch_lightning.plugins.precision import Precision
    from pytorch_lightning.utilities import GradClipAlgorithmType
except ImportError as error:  # pragma: no cover - the extra is missing
    raise ImportError("amppass.integrations.lightning needs pytorch-lightning: "
                      "pip install 'pytorch-lightning>=2.4'") from error

__all__ = ["AmpPassPrecision"]


class AmpPassPrecision(ScaledPrecision, Precision):
    """Lightning precision plugin training the LightningModule's model through amppass (module docstring).

    Args:
        dtype: "fp16" (loss-scaled) or "bf16".
        module: the name (or dotted path) of the LightningModule's submodule to convert; default: its only
            direct child with parameters.
        scaler: the LossScaler for fp16 (default ``amppass.LossScaler()``).
        convert_options: keyword arguments of :func:`amppass.convert` (``keep_fp32=...``).
    """

    def __init__(self, dtype: Literal["fp16", "bf16"] | torch.dtype = "fp16", *, module: str | None = None,
                 scaler: LossScaler | None = None, **convert_options: Any) -> None:
        self._set_precision(dtype, scaler, convert_options)
        self.module = module

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Rule 1: route the model child of the LightningModule (in place; the LightningModule is returned)."""
        route(_target(module, self.module), self.dtype, **self._options)
        return module

    def pre_backward(self, tensor: torch.Tensor, module: "pl.LightningModule") -> torch.Tensor:  # type: ignore[override]
        """Scale the loss (fp16)."""
        return super().pre_backward(self._scaling.scale(tensor), module)

    def optimizer_step(self, optimizer: Any, model: "pl.LightningModule", closure: Callable[[], Any],  # type: ignore[override]
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

    def clip_gradients(self, optimizer: Any, clip_val: int | float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        """Clip the true gradients: unscaled first (manual optimization clips before ``optimizer.step``)."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        if clip_val > 0:
            self._scaling.unscale(optimizer)
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)


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
