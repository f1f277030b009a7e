"""The integrations check their conversion options once, where the plugin, trainer or prepare call is made
(amppass.integrations.routing.TrainConversion: a PlanOptions and the capture's options): a bad option fails there,
with the message amppass.convert gives, instead of at the model's first call; good options reach the conversion."""

import importlib

import pytest
import torch
from torch import nn

import amppass
from amppass.errors import InputError
from amppass.integrations.routing import TrainConversion, converted

# real bad options, each refused by amppass.convert
BAD = [{"plan_for": "fast"}, {"keep_fp32": [3]}, {"tolerance": 1e-3}, {"costs": [1.0]},
       {"force_low": ["linear[("]}]
IDS = ["plan_for", "keep_fp32", "tolerance", "costs", "force_low"]


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


def _convert_refusal(options):
    with pytest.raises(InputError) as refused:
        amppass.convert(_net(), (torch.randn(4, 16),), "fp16", mode="train", **options)
    return str(refused.value)


def _plugin(module, package):
    pytest.importorskip(package)
    return importlib.import_module(module).AmpPassPrecision


PLUGINS = [
    ("amppass.integrations.lightning", "pytorch_lightning"),
    ("amppass.integrations.fabric", "lightning_fabric"),
    ("amppass.integrations.lightning.pytorch", "lightning"),
    ("amppass.integrations.lightning.fabric", "lightning"),
]


@pytest.mark.parametrize("options", BAD, ids=IDS)
@pytest.mark.parametrize("module, package", PLUGINS, ids=[m.rsplit(".", 1)[1] + "-" + p for m, p in PLUGINS])
def test_a_precision_plugin_refuses_a_bad_option_when_made(module, package, options):
    plugin = _plugin(module, package)
    with pytest.raises(InputError) as refused:
        plugin("fp16", **options)
    assert str(refused.value) == _convert_refusal(options)


@pytest.mark.parametrize("options", BAD, ids=IDS)
def test_the_trainer_refuses_a_bad_option_when_made(options, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import TrainingArguments

    from amppass.integrations.transformers import AmpPassTrainer

    model = _net()
    with pytest.raises(InputError) as refused:
        AmpPassTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), report_to=[]),
                       amppass_dtype="bf16", amppass_options=options)
    assert str(refused.value) == _convert_refusal(options)
    assert "forward" not in model.__dict__  # not routed


@pytest.mark.parametrize("options", BAD, ids=IDS)
def test_accelerate_prepare_refuses_a_bad_option_before_changing_the_accelerator(options):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from amppass.integrations.accelerate import prepare

    try:
        accelerator = Accelerator(cpu=True)
        model = _net()
        with pytest.raises(InputError) as refused:
            prepare(accelerator, model, torch.optim.SGD(model.parameters(), lr=0.1), dtype="fp16", **options)
        assert str(refused.value) == _convert_refusal(options)
        assert accelerator.scaler is None and "forward" not in model.__dict__
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_options_the_integration_sets_or_convert_lacks_are_refused():
    plugin = _plugin("amppass.integrations.fabric", "lightning_fabric")
    with pytest.raises(InputError, match=r"convert options \['mode'\] are set by the integration itself"):
        plugin("bf16", mode="inference")
    with pytest.raises(InputError, match=r"convert options \['keep_fp16'\] are not options of amppass.convert.*"
                                         r"'keep_fp32'"):
        plugin("bf16", keep_fp16=["linear"])


def test_checked_options_reach_the_conversion():
    conversion = TrainConversion.of("bf16", {"keep_fp32": "linear", "calibration": iter([(torch.randn(4, 16),)]),
                                             "target": "cpu"})
    settings = conversion.settings
    assert conversion.dtype is torch.bfloat16 and settings.target == "cpu" and settings.mode == "train"
    assert settings.options.keep_fp32 == ("linear",) and isinstance(settings.options.calibration, list)
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from amppass.integrations.accelerate import prepare

    try:
        model = _net()
        prepare(Accelerator(cpu=True), model, dtype="bf16", keep_fp32=["linear"], plan_for="coverage")
        model(torch.randn(4, 16)).sum().backward()
        rows = [row for row in amppass.report(converted(model)).rows if row.op == "aten.linear"]
        assert len(rows) == 2 and all(row.precision == "fp32" and "keep_fp32" in row.reason for row in rows)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
