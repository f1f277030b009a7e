"""amppass under the transformers ``Trainer``: :class:`AmpPassTrainer`, the ``Trainer`` with one more argument.

::

    trainer = AmpPassTrainer(model=model, args=TrainingArguments(...), train_dataset=ds, amppass_dtype="fp16")
    trainer.train()                  # trains `model` itself; trainer.save_model() / model.save_pretrained() as usual

What it changes, and why each is needed:

1. The model is converted at its first call (:mod:`amppass.integrations.routing`) and trains its own parameters,
   so ``Trainer``'s optimizer, ``save_model``/``save_pretrained``, checkpoints and ``resume_from_checkpoint`` see
   the model they always see, and its forward signature is the original's: ``remove_unused_columns`` (on by
   default) keeps the columns the model takes. A model made by ``model_init`` is converted the same way.
2. For fp16 the accelerator the ``Trainer`` creates gets an :class:`amppass.LossScaler`
   (:func:`amppass.integrations.accelerate.install_scaler`): ``accelerator.backward`` scales each micro-batch's
   loss, the gradients are unscaled before ``max_grad_norm`` clips them (accelerate alone unscales only under its
   own fp16 autocast, and ``Trainer`` would clip the scaled gradients), a step with inf/NaN gradients is skipped,
   and the ``Trainer`` saves the scaler's state in each checkpoint (``scaler.pt``) and loads it on resume.
3. ``TrainingArguments(fp16=True)`` / ``bf16=True`` (or ``ACCELERATE_MIXED_PRECISION``) is refused with an
   :class:`~amppass.errors.InputError`: the accelerator's autocast on top of the converted graph would cast again
   what amppass planned. (On a CPU, ``fp16=True`` alone does not even turn fp16 on.)
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..dtypes import low_type
from ..errors import InputError
from ..training import LossScaler
from .accelerate import install_scaler
from .routing import TrainConversion, route

try:
    from transformers import Trainer
except ImportError as error:  # pragma: no cover - the extra is missing
    raise ImportError(
        "amppass.integrations.transformers needs transformers: pip install 'transformers>=4.56'"
    ) from error

__all__ = ["AmpPassTrainer"]


class AmpPassTrainer(Trainer):
    """``transformers.Trainer`` training the model through amppass (module docstring).

    Args:
        model, args, ...: as ``Trainer``'s, passed on unchanged; ``args.fp16``/``args.bf16`` must stay False.
        amppass_dtype: "fp16" (with a LossScaler) or "bf16".
        amppass_scaler: the LossScaler for fp16 (default: ``amppass.LossScaler()``).
        amppass_options: keyword arguments of :func:`amppass.convert` (``{"keep_fp32": ["softmax"]}``).
    """

    def __init__(self, model: nn.Module | None = None, args: Any = None, *rest: Any, amppass_dtype: Any = "fp16",
                 amppass_scaler: LossScaler | None = None, amppass_options: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        self.amppass_dtype = low_type(amppass_dtype).torch
        self._amppass_scaler = amppass_scaler
        self._amppass_conversion = TrainConversion.of(self.amppass_dtype, amppass_options)  # checked here, once
        super().__init__(model, args, *rest, **kwargs)
        if self.model is not None:
            route(self.model, self._amppass_conversion)

    def create_accelerator_and_postprocess(self) -> None:
        """Refuse the accelerator's own autocast (rule 3), then give the accelerator amppass's scaler (rule 2)."""
        flags = [name for name in ("fp16", "bf16") if getattr(self.args, name, False)]
        mixed = getattr(self.args, "mixed_precision", "no")
        if flags or mixed not in (None, "no"):
            given = f"TrainingArguments({flags[0]}=True)" if flags else f"ACCELERATE_MIXED_PRECISION={mixed!r}"
            raise InputError(
                f"AmpPassTrainer(amppass_dtype={low_type(self.amppass_dtype).name!r}) with {given}: the accelerator "
                "would run torch.autocast on top of the model amppass converts, casting again what amppass planned; "
                "leave fp16/bf16 False (and ACCELERATE_MIXED_PRECISION unset): amppass_dtype chooses the precision")
        super().create_accelerator_and_postprocess()
        install_scaler(self.accelerator, self.amppass_dtype, self._amppass_scaler)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """A model from ``model_init`` trains through amppass too (rule 1)."""
        model = super().call_model_init(trial)
        route(model, self._amppass_conversion)
        return model
