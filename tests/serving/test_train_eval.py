"""``amppass.convert(..., mode="train")``: fp32 master parameters, train/eval graphs, scaling through the graph."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amppass
from amppass.serving.train_eval import TrainEvalGraphs
from models.digits import train_digits
from tests.helpers.load import read_as_native_cpu


def _net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
        nn.Dropout(0.5), nn.Linear(8 * 8 * 8, 10),
    )


@pytest.fixture(scope="module")
def original() -> nn.Module:
    torch.manual_seed(0)
    return _net().train()


@pytest.fixture(scope="module")
def snapshot(original) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in original.state_dict().items()}


@pytest.fixture
def converted(original, snapshot) -> TrainEvalGraphs:
    # coverage: every op numerics allow trains in fp16, the convolution included (a plan for speed keeps a CPU's
    # convolutions fp32 in training: tests/fx/view/test_build.py)
    model = amppass.convert(original, (torch.randn(4, 1, 8, 8),), dtype=torch.float16, mode="train",
                            plan_for="coverage")
    yield model
    # whatever the test did to the converted module, the caller's model is as it was
    for key, value in original.state_dict().items():
        assert torch.equal(value, snapshot[key]), key
    assert all(p.grad is None for p in original.parameters())


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(16, 1, 8, 8, generator=gen), torch.randint(0, 10, (16,), generator=gen)


# ---------------------------------------------------------------- (c) master parameters and gradients


def test_parameters_are_fp32_clones_named_like_the_original(original, converted):
    assert isinstance(converted, TrainEvalGraphs)
    assert list(converted.state_dict()) == list(original.state_dict())
    for (name, param), (orig_name, orig_param) in zip(
        converted.named_parameters(), original.named_parameters(), strict=False
    ):
        assert name == orig_name and param.dtype == torch.float32 and param.requires_grad
        assert param is not orig_param and param.data_ptr() != orig_param.data_ptr()
        assert torch.equal(param, orig_param)
    for (name, buf), orig_buf in zip(converted.named_buffers(), original.buffers(), strict=False):
        assert buf.data_ptr() != orig_buf.data_ptr(), name


def test_gradients_are_fp32_and_low_precision_runs_inside(converted):
    x, y = _batch()
    F.cross_entropy(converted(x), y).backward()
    for name, param in converted.named_parameters():
        assert param.dtype == torch.float32 and param.grad is not None, name
        assert param.grad.dtype == torch.float32 and torch.isfinite(param.grad).all(), name
    ops = {n.target for n in converted.train_graph.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.conv2d.default in ops and torch.ops.aten._to_copy.default in ops
    conv = next(n for n in converted.train_graph.graph.nodes if n.target is torch.ops.aten.conv2d.default)
    assert conv.meta["val"].dtype == torch.float32  # export's record; the rewritten inputs are fp16
    assert all(a.name.endswith("_to_fp16") for a in conv.args[:3])


def test_training_the_converted_module_leaves_the_callers_model_alone(converted):
    opt = torch.optim.AdamW(converted.parameters(), lr=1e-2)
    for seed in range(3):
        x, y = _batch(seed)
        opt.zero_grad()
        F.cross_entropy(converted(x), y).backward()
        opt.step()
    # the fixture's teardown checks the caller's model; here: the converted one did train
    assert converted.state_dict()["1.num_batches_tracked"].item() == 3


def test_state_dict_round_trip_reaches_both_graphs(converted):
    torch.manual_seed(1)
    other = _net().eval()
    converted.load_state_dict(other.state_dict(), assign=True)
    converted.eval()
    x, _ = _batch()
    torch.testing.assert_close(converted(x), other(x), rtol=1e-2, atol=1e-2)
    converted.train()
    flat, tree = converted.train_graph.get_submodule("5").weight, converted.get_submodule("5").weight
    assert flat.is_meta and flat.shape == tree.shape  # the tree alone holds the state between calls


# ---------------------------------------------------------------- (d) dropout, batch norm, train/eval


def test_dropout_and_batch_norm_follow_the_mode(original, converted):
    x, _ = _batch()
    reference = copy.deepcopy(original)
    torch.manual_seed(5)
    expected = reference(x)
    torch.manual_seed(5)
    got = converted(x)
    # the same dropout mask: zeros where the original's dropout zeroed, fp16 error elsewhere
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    running = dict(converted.named_buffers())
    for stat in ("running_mean", "running_var"):  # updated in place by the train graph, as the original's
        torch.testing.assert_close(running[f"1.{stat}"], getattr(reference[1], stat), rtol=1e-2, atol=1e-3)
    assert not torch.equal(converted(x), converted(x))  # dropout active in train mode
    assert running["1.num_batches_tracked"].item() == 3

    converted.eval()
    stats = {k: v.clone() for k, v in running.items()}
    first, second = converted(x), converted(x)
    assert torch.equal(first, second)  # no dropout in eval mode
    for key, value in converted.named_buffers():
        assert torch.equal(value, stats[key]), key  # running statistics frozen in eval mode
    reference.load_state_dict(converted.state_dict())
    torch.testing.assert_close(first, reference.eval()(x), rtol=2e-2, atol=2e-2)

    converted.train()
    converted(x)
    assert dict(converted.named_buffers())["1.num_batches_tracked"].item() == 4


# ---------------------------------------------------------------- (b) overflow and underflow through the graph


def test_injected_inf_loss_skips_exactly_that_step(converted):
    scaler = amppass.LossScaler(init_scale=2.0**10)
    opt = torch.optim.Adam(converted.parameters(), lr=1e-2)
    history = []
    for step in range(4):
        x, y = _batch(step)
        before = {k: v.clone() for k, v in converted.named_parameters()}
        opt.zero_grad()
        loss = F.cross_entropy(converted(x), y)
        if step == 2:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        moved = any(not torch.equal(v, before[k]) for k, v in converted.named_parameters())
        history.append((moved, scaler.get_scale(), opt.state[next(converted.parameters())]["step"].item()))
        assert all(torch.isfinite(p).all() for p in converted.parameters())
    assert history == [(True, 2.0**10, 1), (True, 2.0**10, 2), (False, 2.0**9, 2), (True, 2.0**9, 3)]


def test_fp16_gradients_underflow_without_the_scaler_and_not_with_it():
    torch.manual_seed(0)
    model = amppass.convert(nn.Linear(8, 4), (torch.randn(4, 8),), dtype="fp16", mode="train", plan_for="coverage")
    x, y = torch.randn(32, 8), torch.randn(32, 4)

    def weight_grad(scaler: amppass.LossScaler) -> torch.Tensor:
        model.zero_grad()
        scaler.scale(F.mse_loss(model(x), y) * 1e-7).backward()  # gradients ~1e-9: below fp16's 6e-8
        scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.1))
        return model.weight.grad

    assert torch.count_nonzero(weight_grad(amppass.LossScaler(enabled=False))) == 0
    scaled = weight_grad(amppass.LossScaler())
    assert torch.count_nonzero(scaled) == scaled.numel()


# ---------------------------------------------------------------- report


def test_report_states_backward_precision(converted):
    report = amppass.report(converted)
    assert report.info["mode"] == "train"
    backward = report.info["backward"]
    # batch norm follows its low input: its kernel accumulates the batch's statistics in fp32 (fx.policy)
    assert backward["ops_with_low_backward"] == ["aten.batch_norm", "aten.conv2d", "aten.dropout", "aten.flatten",
                                                 "aten.linear", "aten.relu"]
    assert "fp32 gradients" in backward["statement"]
    assert backward["saved_bytes_by_dtype"]["fp16"] > 100 * backward["saved_bytes_by_dtype"].get("fp32", 0)
    rows = {r.op: r for r in report.rows}
    assert rows["aten.conv2d"].evidence["backward"] == "fp16"
    assert rows["aten.batch_norm"].evidence["backward"] == "fp16"
    assert "accumulates the batch's mean and variance in fp32" in rows["aten.batch_norm"].reason
    assert amppass.convert(converted, dtype="fp16", mode="train") is converted


# ---------------------------------------------------------------- (a) digits: fp32 vs amppass


@pytest.fixture(scope="module")
def digits() -> dict[str, list[dict]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a shared CPU, intra-op threads fighting for cores cost 10x here
    try:
        with read_as_native_cpu():  # low-precision training itself: a CPU without the instructions trains in fp32
            return {p: train_digits(p, epochs=8) for p in ("fp32", "fp16", "bf16")}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_digits_accuracy_matches_fp32(digits, precision):
    reference, low = digits["fp32"][-1]["test_accuracy"], digits[precision][-1]["test_accuracy"]
    assert reference > 97.0
    assert abs(low - reference) <= 1.5, (precision, low, reference)


def test_digits_fp16_run_used_the_scaler(digits):
    assert digits["fp16"][-1]["scale"] >= 2.0**15  # dynamic scaling was on (and did not collapse)
    assert digits["bf16"][-1]["scale"] == 1.0  # bf16: passthrough


def _frozen_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                         nn.Dropout(0.5), nn.Linear(512, 10)).train()


def test_submodules_set_to_eval_before_converting_stay_so_in_the_train_graph():
    """Fine-tuning freezes batch norm's statistics (``model.train(); model.bn.eval()``): the train graph was
    captured with every submodule in train mode, so running statistics kept moving and dropout kept dropping."""
    original = _frozen_net()
    original[1].eval(), original[4].eval()
    x = torch.randn(4, 3, 8, 8)
    model = amppass.convert(copy.deepcopy(original), (x,), dtype=torch.float16, mode="train", plan_for="coverage")
    assert model.training and not model[1].training and not model[4].training
    before = model[1].running_mean.clone()
    first, second = model(x), model(x)
    assert torch.equal(model[1].running_mean, before) and torch.equal(first, second)
    torch.testing.assert_close(first, original(x), rtol=2e-2, atol=2e-2)
    model.eval(), model.train()  # train() restores the flags the train graph was captured with
    assert not model[1].training and model[0].training
    model(x).sum().backward()


def test_a_submodule_switched_after_converting_is_refused_with_the_way_to_convert_it():
    x = torch.randn(4, 3, 8, 8)
    model = amppass.convert(_frozen_net(), (x,), dtype=torch.float16, mode="train", plan_for="coverage")
    model[1].eval()
    with pytest.raises(amppass.InputError, match=r"1 \(BatchNorm2d\) is in eval mode.*get_submodule\('1'\)\.eval\(\)"):
        model(x)
    model.train()
    model(x)
