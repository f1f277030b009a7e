"""Training support: dynamic loss scaling for fp16 (bf16 needs none)."""

from .loss_scaler import LossScaler

__all__ = ["LossScaler"]
