"""Lightning Trainer and Fabric with amppass's precision plugins, end to end with the real libraries (tiny MLP):
the standalone packages (pytorch_lightning, lightning_fabric); the unified ``lightning`` package's in
tests/integrations/test_lightning_unified.py."""

import pytest
import torch
from torch import nn

import amppass
from amppass.errors import InputError

pl = pytest.importorskip("pytorch_lightning")
from lightning_fabric import Fabric  # noqa: E402  (installed with pytorch-lightning)

from amppass.integrations import fabric as amp_fabric  # noqa: E402
from amppass.integrations.lightning import AmpPassPrecision  # noqa: E402
from amppass.integrations.routing import converted  # noqa: E402
from tests.helpers.lightning_runs import CLIP, RegressionSteps, data, fabric_run, trainer_fit  # noqa: E402
from tests.helpers.load import native_bf16_cpu  # noqa: E402

STEPS = 8


class Regression(RegressionSteps, pl.LightningModule):
    """Records each step's loss and the gradient norm before and after clipping (tests/helpers/lightning_runs.py)."""


def _fit(lit, plugin=None, steps=STEPS, **options):
    return trainer_fit(pl.Trainer, lit, plugin, steps, **options)


# the fp16 plugins below are planned for coverage: they test fp16 training itself, which a plan for speed keeps fp32 on
# a CPU without fp16 instructions


def _scaler():
    # 256 keeps the first steps clean (2**16 overflows this net's first gradients), so the curves line up
    return amppass.LossScaler(init_scale=256.0, growth_interval=3)


@pytest.fixture(scope="module")
def fp32_run():
    lit = Regression()
    _fit(lit)
    return lit


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_fp16_plugin_trains_like_fp32_and_clips_unscaled_gradients(fp32_run, manual):
    reference = fp32_run if not manual else Regression(manual=True)
    if manual:
        _fit(reference)
    lit = Regression(manual=manual)
    original_weight = lit.model[0].weight
    trainer = _fit(lit, AmpPassPrecision("fp16", scaler=_scaler(), plan_for="coverage"))
    assert trainer.precision == "16-mixed"
    torch.testing.assert_close(torch.tensor(lit.losses), torch.tensor(reference.losses), rtol=2e-2, atol=1e-3)
    if manual:  # the norm the user sees after manual_backward carries the scale; clip_gradients unscales it
        scale = trainer.precision_plugin.scaler
        assert all(before > 50 * ref for (before, _), (ref, _) in zip(lit.norms, reference.norms, strict=False))
        assert scale.skipped_steps == 0
    else:  # Lightning clips after the plugin unscaled: the same true norms as fp32's
        torch.testing.assert_close(torch.tensor([b for b, _ in lit.norms]),
                                   torch.tensor([b for b, _ in reference.norms]), rtol=3e-2, atol=1e-3)
    assert all(after <= CLIP * 1.001 for _, after in lit.norms)
    assert all(before > CLIP for before, _ in reference.norms)  # clipping really acted
    # the LightningModule's own model was trained, in fp32, through an fp16 conversion
    assert lit.model[0].weight is original_weight and original_weight.dtype == torch.float32
    rows = amppass.report(converted(lit.model).train_graph).rows
    assert any(row.precision == "fp16" for row in rows)


class Validated(Regression):
    """With a forward for the model summary's example_input_array and a validation loop, which call the model in
    eval mode (under torch.inference_mode) before the first training step: the conversion happens there."""

    def __init__(self):
        super().__init__()
        self.example_input_array = torch.randn(8, 16)

    def forward(self, x):
        return self.model(x)

    def validation_step(self, batch, index):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.model(x), y))


def test_bf16_plugin_has_no_scaler_and_trains_like_fp32(fp32_run, monkeypatch):
    native_bf16_cpu(monkeypatch)  # bf16 training itself: a CPU without bf16 instructions trains in fp32
    lit = Validated()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data()), batch_size=8)
    trainer = _fit(lit, AmpPassPrecision("bf16"), steps=4, val_dataloaders=loader, enable_model_summary=True)
    assert trainer.precision_plugin.scaler is None and trainer.precision == "bf16-mixed"
    torch.testing.assert_close(torch.tensor(lit.losses), torch.tensor(fp32_run.losses[:4]), rtol=3e-2, atol=1e-2)
    assert torch.isfinite(trainer.callback_metrics["val_loss"])


def test_checkpoint_holds_the_scaler_and_resumes_where_it_left(tmp_path):
    whole = Regression()
    # whole epochs: Lightning resumes a run stopped by max_steps from the start of its epoch
    whole_trainer = _fit(whole, AmpPassPrecision("fp16", scaler=_scaler(), plan_for="coverage"), steps=-1,
                         max_epochs=2)
    first = Regression()
    trainer = _fit(first, AmpPassPrecision("fp16", scaler=_scaler(), plan_for="coverage"), steps=-1,
                   max_epochs=1)  # 4 steps
    path = tmp_path / "half.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    assert saved["AmpPassPrecision"]["scale"] == 512.0  # grew once after 3 clean steps
    assert saved["AmpPassPrecision"]["_growth_tracker"] == 1
    second = Regression()
    resumed = _fit(second, AmpPassPrecision("fp16", scaler=_scaler(), plan_for="coverage"), steps=-1, max_epochs=2,
                   ckpt_path=path)
    assert second.losses == whole.losses[4:]
    assert resumed.precision_plugin.scaler.state_dict() == whole_trainer.precision_plugin.scaler.state_dict()
    for a, b in zip(second.model.parameters(), whole.model.parameters(), strict=False):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # the checkpoint's weights use the plain model's keys: a LightningModule without the plugin loads them
    plain = Regression()
    plain.load_state_dict(saved["state_dict"])
    torch.testing.assert_close(plain.model[0].weight, first.model[0].weight)


def test_refusals():
    with pytest.raises(ValueError, match="Choose one"):  # Lightning refuses autocast next to the plugin
        pl.Trainer(precision="bf16-mixed", plugins=[AmpPassPrecision("fp16")], accelerator="cpu")
    with pytest.raises(InputError, match="without a loss scaler"):
        AmpPassPrecision("bf16", scaler=amppass.LossScaler())

    class TwoModels(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.encoder, self.decoder = nn.Linear(4, 4), nn.Linear(4, 4)

    with pytest.raises(InputError, match=r"module='model'"):
        AmpPassPrecision("fp16").convert_module(TwoModels())
    with pytest.raises(InputError, match="has no submodule 'net'"):
        AmpPassPrecision("fp16", module="net").convert_module(TwoModels())
    routed = TwoModels()
    AmpPassPrecision("fp16", module="decoder").convert_module(routed)
    assert "forward" in vars(routed.decoder) and "forward" not in vars(routed.encoder)


def test_fabric_fp16_clips_unscaled_and_checkpoints_the_scaler(tmp_path):
    *_, ref_losses, ref_norms = fabric_run(Fabric)
    plugin = amp_fabric.AmpPassPrecision("fp16", scaler=_scaler(), plan_for="coverage")
    fabric, model, optimizer, losses, norms = fabric_run(Fabric, plugin)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=3e-2, atol=1e-3)
    fabric.save(tmp_path / "f.ckpt", {"model": model, "optimizer": optimizer, "scaler": plugin.scaler})
    fresh = amp_fabric.AmpPassPrecision("fp16", plan_for="coverage")
    Fabric(accelerator="cpu", devices=1, plugins=[fresh]).load(tmp_path / "f.ckpt", {"scaler": fresh.scaler})
    assert fresh.scaler.state_dict() == plugin.scaler.state_dict()
    assert fresh.scaler.get_scale() == 512.0
