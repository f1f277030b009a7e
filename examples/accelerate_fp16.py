"""accelerate: ``amppass.integrations.accelerate.prepare(accelerator, model, optimizer, ..., dtype="fp16")`` in
place of ``accelerator.prepare(model, optimizer, ...)``; the training loop is accelerate's own.

Run: ``python examples/accelerate_fp16.py``.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch import nn

from amppass.integrations.accelerate import prepare


def main() -> None:
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)  # mixed_precision left at "no": amppass casts
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(256, 16)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1] * 3 + 1), batch_size=32)
    model, optimizer, loader = prepare(accelerator, model, optimizer, loader, dtype="fp16")
    for epoch in range(3):
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)                                   # scaled by amppass.LossScaler
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)  # unscaled first
            optimizer.step()                                             # skipped on inf/NaN gradients
            optimizer.zero_grad()
        print(f"epoch {epoch}: loss {loss.item():.4f}, gradient norm before clipping {float(norm):.3f}")
    print(f"loss scale {accelerator.scaler.get_scale():g}, skipped steps {accelerator.scaler.skipped_steps}")


if __name__ == "__main__":
    main()
