"""Lightning: train a LightningModule's model in fp16 through amppass with one plugin.

``Trainer(plugins=[AmpPassPrecision("fp16")])`` in place of ``Trainer(precision="16-mixed")``: the module's
``model`` is converted at its first call and trains its own fp32 parameters; an amppass LossScaler scales the
loss and unscales before ``gradient_clip_val`` clips. Run: ``python examples/lightning_fp16.py``.
"""

from __future__ import annotations

import logging
import warnings

import pytorch_lightning as pl
import torch
from torch import nn

import amppass
from amppass.integrations import routing
from amppass.integrations.lightning import AmpPassPrecision


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module="pytorch_lightning")
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1] * 3 + 1), batch_size=32)
    lit = Regression()
    trainer = pl.Trainer(plugins=[AmpPassPrecision("fp16")], gradient_clip_val=1.0, max_epochs=2, accelerator="cpu",
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(lit, loader)
    print(f"trainer.precision = {trainer.precision}; final loss {trainer.callback_metrics['loss']:.4f}")
    print(f"loss scale {trainer.precision_plugin.scaler.get_scale():g}, "
          f"skipped steps {trainer.precision_plugin.scaler.skipped_steps}")
    print(amppass.report(routing.converted(lit.model)).summary())  # its train graph, or why it trains in fp32


if __name__ == "__main__":
    main()
