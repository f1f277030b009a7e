"""Lightning Fabric: train in fp16 through amppass with one plugin, and checkpoint the loss scaler.

Run: ``python examples/fabric_fp16.py``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from lightning_fabric import Fabric
from torch import nn

from amppass.integrations.fabric import AmpPassPrecision


def main() -> None:
    torch.manual_seed(0)
    plugin = AmpPassPrecision("fp16")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    x = torch.randn(256, 16)
    y = x[:, :1] * 3 + 1
    for step in range(16):
        batch = slice((step % 8) * 32, (step % 8 + 1) * 32)
        loss = nn.functional.mse_loss(model(x[batch]), y[batch])
        fabric.backward(loss)                                  # scaled
        # unscaled first; an overflowing step (inf gradients) is the scaler's to skip, not an error
        fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
        optimizer.step()                                       # skipped on inf/NaN gradients
        optimizer.zero_grad()
    print(f"final loss {loss.item():.4f}; loss scale {plugin.scaler.get_scale():g}, "
          f"skipped steps {plugin.scaler.skipped_steps}")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "state.ckpt"
        fabric.save(path, {"model": model, "optimizer": optimizer, "scaler": plugin.scaler})
        print(f"saved model, optimizer and scaler to a checkpoint of {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
