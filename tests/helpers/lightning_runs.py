"""The tiny regression the Lightning and Fabric plugin tests train, for either Lightning package: the test module
passes its package's ``LightningModule`` / ``Fabric``, so this module imports neither."""

from __future__ import annotations

import warnings

import torch
from torch import nn

CLIP = 0.5


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 16, generator=g)  # 4 batches of 8: an epoch ends at step 4
    return x, x[:, :1] * 3 + 1


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))


def grad_norm(params):
    return float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))


class RegressionSteps:
    """The steps of a LightningModule (put it before the package's ``LightningModule``): records each step's loss
    and the gradient norm before and after clipping."""

    def __init__(self, manual=False):
        super().__init__()
        self.model = net()
        self.automatic_optimization = not manual
        self.losses, self.norms = [], []

    def training_step(self, batch, index):
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x), y)
        self.losses.append(loss.item())
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        before = grad_norm(self.parameters())  # still scaled under fp16: clip_gradients must unscale first
        self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
        self.norms.append((before, grad_norm(self.parameters())))
        opt.step()

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        before = grad_norm(self.parameters())
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.norms.append((before, grad_norm(self.parameters())))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer_fit(trainer_class, lit, plugin=None, steps=8, ckpt_path=None, val_dataloaders=None, **trainer_kwargs):
    """Fit ``lit`` on :func:`data` in batches of 8 with ``trainer_class(plugins=[plugin])``, clipping at
    :data:`CLIP` in automatic optimization: the trainer."""
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data()), batch_size=8)
    clip = {"gradient_clip_val": CLIP} if lit.automatic_optimization else {}
    settings = dict(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, accelerator="cpu", plugins=[plugin] if plugin else None, **clip)
    trainer = trainer_class(**{**settings, **trainer_kwargs})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notes about workers and log intervals
        trainer.fit(lit, loader, val_dataloaders, ckpt_path=ckpt_path)
    return trainer


def fabric_run(fabric_class, plugin=None, steps=4):
    """Train :func:`net` ``steps`` steps with ``fabric_class(plugins=[plugin])``, clipping at :data:`CLIP`:
    (fabric, model, optimizer, losses, the norms before clipping)."""
    x, y = data()
    fabric = fabric_class(accelerator="cpu", devices=1, plugins=[plugin] if plugin else None)
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    losses, norms = [], []
    for i in range(steps):
        loss = nn.functional.mse_loss(model(x[i * 8:(i + 1) * 8]), y[i * 8:(i + 1) * 8])
        fabric.backward(loss)
        norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return fabric, model, optimizer, losses, norms
