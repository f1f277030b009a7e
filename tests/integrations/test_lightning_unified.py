"""The unified ``lightning`` package (``import lightning as L``): ``L.Trainer`` and ``L.Fabric`` with amppass's
plugins for it (amppass.integrations.lightning.pytorch and .fabric), end to end (tiny MLP), and each plugin
importing only its own package. Before them, ``L.Trainer`` refused the plugin built on pytorch_lightning
("Found invalid type for plugin"), ``L.Fabric`` raised a TypeError, and with only ``lightning`` installed the
import asked for pytorch-lightning. The standalone packages' tests: tests/integrations/test_lightning.py."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import amppass
from tests.helpers.paths import ROOT

L = pytest.importorskip("lightning")

# imported after the importorskip above: these modules import lightning
from amppass.integrations.lightning.fabric import AmpPassPrecision as FabricPlugin  # noqa: E402
from amppass.integrations.lightning.pytorch import AmpPassPrecision  # noqa: E402
from amppass.integrations.routing import converted  # noqa: E402
from tests.helpers.lightning_runs import CLIP, RegressionSteps, fabric_run, net, trainer_fit  # noqa: E402

STEPS = 4


class Regression(RegressionSteps, L.LightningModule):
    """Records each step's loss and the gradient norm before and after clipping (tests/helpers/lightning_runs.py)."""


def _scaler():
    # 256 keeps the first steps clean (2**16 overflows this net's first gradients), so the curves line up
    return amppass.LossScaler(init_scale=256.0, growth_interval=3)


def _trained_through_fp16(model, initial):
    """The model's own fp32 parameters moved, and its forward ran through an amppass conversion with fp16 nodes."""
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), initial.parameters(), strict=False))
    return any(row.precision == "fp16" for row in amppass.report(converted(model).train_graph).rows)


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_trainer_fp16_trains_like_fp32(manual, tmp_path):
    reference = Regression(manual=manual)
    trainer_fit(L.Trainer, reference, steps=STEPS)
    lit = Regression(manual=manual)
    plugin = AmpPassPrecision("fp16", scaler=_scaler(), plan_for="coverage")  # fp16 on any CPU
    trainer = trainer_fit(L.Trainer, lit, plugin, steps=STEPS)
    assert trainer.precision_plugin is plugin and trainer.precision == "16-mixed"
    assert len(lit.losses) == STEPS and all(torch.isfinite(torch.tensor(lit.losses)))
    torch.testing.assert_close(torch.tensor(lit.losses), torch.tensor(reference.losses), rtol=2e-2, atol=1e-3)
    # clipping saw the true (unscaled) gradients: manual optimization's LightningOptimizer is lightning.pytorch's
    assert all(after <= CLIP * 1.001 for _, after in lit.norms) and len(lit.norms) == STEPS
    if not manual:
        torch.testing.assert_close(torch.tensor([b for b, _ in lit.norms]),
                                   torch.tensor([b for b, _ in reference.norms]), rtol=3e-2, atol=1e-3)
    assert plugin.scaler.skipped_steps == 0
    assert _trained_through_fp16(lit.model, net())
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    assert torch.load(tmp_path / "c.ckpt", weights_only=False)["AmpPassPrecision"] == plugin.scaler.state_dict()


def test_fabric_fp16_trains_like_fp32(tmp_path):
    *_, ref_losses, ref_norms = fabric_run(L.Fabric, steps=STEPS)
    plugin = FabricPlugin("fp16", scaler=_scaler(), plan_for="coverage")  # fp16 on any CPU
    fabric, model, optimizer, losses, norms = fabric_run(L.Fabric, plugin, steps=STEPS)
    assert all(torch.isfinite(torch.tensor(losses)))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=3e-2, atol=1e-3)
    assert _trained_through_fp16(model.module, net())
    fabric.save(tmp_path / "f.ckpt", {"model": model, "optimizer": optimizer, "scaler": plugin.scaler})
    fresh = FabricPlugin("fp16", plan_for="coverage")
    L.Fabric(accelerator="cpu", devices=1, plugins=[fresh]).load(tmp_path / "f.ckpt", {"scaler": fresh.scaler})
    assert fresh.scaler.state_dict() == plugin.scaler.state_dict()


def test_lightnings_refusal_names_the_package_the_plugin_is_for():
    pytest.importorskip("pytorch_lightning")
    from amppass.integrations.lightning import AmpPassPrecision as Standalone

    with pytest.raises(Exception, match=r"invalid type for plugin AmpPassPrecision\('fp16'\) for pytorch_lightning"):
        L.Trainer(plugins=[Standalone("fp16")], accelerator="cpu", logger=False)


# Each run hides the other package (a None in sys.modules makes its import fail as if it were not installed).
ONLY_UNIFIED = """
    sys.modules.update(dict.fromkeys(["pytorch_lightning", "lightning_fabric"]))
    import lightning
    from amppass.integrations import fabric, lightning as trainer_plugins
    from amppass.integrations.lightning.fabric import AmpPassPrecision as FabricPlugin
    from amppass.integrations.lightning.pytorch import AmpPassPrecision as TrainerPlugin
    # the names the README shows give the unified package's plugins where only it is installed
    assert trainer_plugins.AmpPassPrecision is TrainerPlugin and fabric.AmpPassPrecision is FabricPlugin
    lightning.Trainer(plugins=[trainer_plugins.AmpPassPrecision("fp16")], accelerator="cpu", logger=False)
    lightning.Fabric(plugins=[fabric.AmpPassPrecision("bf16")], accelerator="cpu")
"""
ONLY_STANDALONE = """
    sys.modules["lightning"] = None
    import lightning_fabric, pytorch_lightning
    from amppass.integrations import fabric, lightning as trainer_plugins
    pytorch_lightning.Trainer(plugins=[trainer_plugins.AmpPassPrecision("fp16")], accelerator="cpu", logger=False)
    lightning_fabric.Fabric(plugins=[fabric.AmpPassPrecision("bf16")], accelerator="cpu")
    for path in ("amppass.integrations.lightning.pytorch", "amppass.integrations.lightning.fabric"):
        try:
            __import__(path)
            raise AssertionError(path + " imported without lightning")
        except ImportError as error:
            assert str(error).endswith("which is not installed: pip install lightning"), error
"""


@pytest.mark.parametrize("script", [ONLY_UNIFIED, ONLY_STANDALONE], ids=["only-lightning", "only-pytorch-lightning"])
def test_each_plugin_needs_only_its_own_package(script):
    if script is ONLY_STANDALONE:
        pytest.importorskip("pytorch_lightning")
    code = "import sys\n" + textwrap.dedent(script) + "print('done')\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and done.stdout.strip().endswith("done"), done.stderr[-3000:]
