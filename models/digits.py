"""The 8x8 digits data set bundled with scikit-learn (no download), a small CNN for it, and its training loop
in fp32 and through ``amppass.convert(..., mode="train")`` with ``amppass.LossScaler`` in fp16 / bf16.

Shared by the training benchmark (learning curves) and the train-mode tests (the low-precision curves follow
fp32's).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import amppass

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def digits_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): the 1797 8x8 digits scaled to [0, 1], 80/20 split by ``seed``."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    train, test = order[:cut], order[cut:]
    return x[train], y[train], x[test], y[test]


def digits_cnn() -> nn.Module:
    """A small CNN for 1x8x8 images, with batch norm and dropout so train/eval switching matters."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(0.2), nn.Linear(32 * 2 * 2, 10),
    )


def train_digits(precision: str, epochs: int = 12, seed: int = 0, batch: int = 64,
                 plan_for: str = "speed") -> list[dict[str, Any]]:
    """Train :func:`digits_cnn` from ``seed`` in ``precision``; one record per epoch.

    ``"fp32"`` trains the plain module; ``"fp16"``/``"bf16"`` train ``amppass.convert(..., mode="train",
    plan_for=plan_for)`` with ``amppass.LossScaler`` (a passthrough for bf16). Initial weights, batch order and
    dropout masks come from the same seed in every precision.
    """
    x_train, y_train, x_test, y_test = digits_data(seed)
    torch.manual_seed(seed)
    model = digits_cnn()
    if precision != "fp32":
        model = amppass.convert(model, (x_train[:batch],), dtype=_DTYPES[precision], mode="train",
                                plan_for=plan_for)
    scaler = amppass.LossScaler(dtype=_DTYPES.get(precision, torch.float16), enabled=precision != "fp32")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    steps_per_epoch = -(-len(y_train) // batch)
    # annealed to zero so the last epochs settle instead of jittering by a few test images
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * steps_per_epoch)
    generator = torch.Generator().manual_seed(seed + 1)
    torch.manual_seed(seed + 2)  # dropout masks
    records = []
    for epoch in range(1, epochs + 1):
        model.train()
        losses = []
        for idx in torch.randperm(len(y_train), generator=generator).split(batch):
            opt.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            schedule.step()
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        records.append({"kind": "curve", "precision": precision, "epoch": epoch,
                        "train_loss": statistics.fmean(losses), "test_accuracy": 100.0 * accuracy,
                        "scale": scaler.get_scale()})
    return records
