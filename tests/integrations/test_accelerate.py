"""accelerate with amppass.integrations.accelerate.prepare, end to end (tiny MLP)."""

import pytest
import torch
from torch import nn

import amppass
from amppass.errors import InputError

pytest.importorskip("accelerate")
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from amppass.integrations.accelerate import install_scaler, prepare
from amppass.integrations.routing import TrainConversion, converted, route
from tests.helpers.paths import ROOT

CLIP = 0.5


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=g)
    return x, x[:, :1] * 3 + 1


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))


def _train(accelerator, model, optimizer, steps=8):
    x, y = _data()
    losses, norms = [], []
    for i in range(steps):
        loss = nn.functional.mse_loss(model(x[i * 8:(i + 1) * 8]), y[i * 8:(i + 1) * 8])
        accelerator.backward(loss)
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms


def _fp32():
    accelerator = Accelerator(cpu=True)
    model = _net()
    return _train(accelerator, *accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05)))


def test_fp16_backward_clip_and_step_match_fp32(tmp_path):
    """fp16 training itself: planned for coverage, so it trains in fp16 on any CPU (a plan for speed keeps a CPU
    without fp16 instructions in fp32)."""
    ref_losses, ref_norms = _fp32()
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True)
    model = _net()
    weight = model[0].weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = prepare(accelerator, model, optimizer, dtype="fp16", plan_for="coverage",
                               scaler=amppass.LossScaler(init_scale=256.0, growth_interval=3))
    losses, norms = _train(accelerator, model, optimizer)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=1e-3)
    # clip_grad_norm_ returns the norm it clipped: the unscaled one (a scaled one would be 256x and up)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=3e-2, atol=1e-3)
    assert all(n > CLIP for n in ref_norms)
    assert isinstance(accelerator.scaler, amppass.LossScaler) and accelerator.scaler.get_scale() == 1024.0
    assert model[0].weight is weight  # the model's own parameters trained, through the fp16 conversion
    assert any(r.precision == "fp16" for r in amppass.report(converted(model).train_graph).rows)
    # accelerate's save_state / load_state carry the amppass scaler
    accelerator.save_state(tmp_path / "state")
    AcceleratorState._reset_state(reset_partial_state=True)
    again = Accelerator(cpu=True)
    fresh = _net()
    fresh_model, _ = prepare(again, fresh, torch.optim.SGD(fresh.parameters(), lr=0.05), dtype="fp16",
                             plan_for="coverage")
    again.load_state(tmp_path / "state")
    assert again.scaler.state_dict() == accelerator.scaler.state_dict()
    torch.testing.assert_close(fresh_model[0].weight, model[0].weight)


def test_default_scaler_skips_overflowing_steps_and_clips_finite_gradients():
    accelerator = Accelerator(cpu=True)
    model = _net()
    model, optimizer = prepare(accelerator, model, torch.optim.SGD(model.parameters(), lr=0.05), dtype="fp16",
                               plan_for="coverage")  # fp16 on any CPU: a plan for speed keeps one without it fp32
    _, norms = _train(accelerator, model, optimizer, steps=4)
    assert accelerator.scaler.skipped_steps >= 1  # 2**16 overflows this net's first fp16 gradients
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_bf16_has_no_scaler_and_autocast_on_top_is_warned_about():
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = _net()
    with pytest.warns(UserWarning, match="mixed_precision='no'"):
        prepare(accelerator, model, torch.optim.SGD(model.parameters(), lr=0.05), dtype="bf16")
    assert accelerator.scaler is None


def test_refusals():
    accelerator = Accelerator(cpu=True)
    model = _net()
    accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(InputError, match="before accelerator.prepare"):
        install_scaler(accelerator, "fp16")
    wrapped = _net()
    wrapped.forward = lambda x: x  # a tool's wrapper installed first (accelerate's autocast does this)
    with pytest.raises(InputError, match="already replaced"):
        route(wrapped, TrainConversion.of("fp16"))
    routed = _net()
    route(routed, TrainConversion.of("fp16"))
    with pytest.raises(InputError, match="cannot also train in torch.bfloat16"):
        route(routed, TrainConversion.of("bf16"))
    with pytest.raises(InputError, match="set by the integration"):
        TrainConversion.of("fp16", {"mode": "inference"})


def test_import_amppass_imports_no_training_tool():
    import os
    import subprocess
    import sys

    code = ("import sys, amppass, amppass.integrations, amppass.integrations.routing; "
            "print(sorted(m for m in ('accelerate', 'pytorch_lightning', 'lightning_fabric') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.strip() == "[]"


def test_a_deep_copy_of_a_routed_model_trains_its_own_tensors():
    import copy

    model = _net()
    route(model, TrainConversion.of("bf16"))
    twin = copy.deepcopy(model)  # what EMA and SWA callbacks do
    x = torch.randn(4, 16)
    twin(x).sum().backward()
    assert twin[0].weight.grad is not None and model[0].weight.grad is None
    assert converted(model) is None and converted(twin) is not None
    assert all(a is b for a, b in zip(converted(twin).parameters(), twin.parameters(), strict=False))
