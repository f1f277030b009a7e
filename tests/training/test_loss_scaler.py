"""LossScaler: GradScaler's schedule, skipped steps, fp16 underflow, call-order errors, bf16, the fused path."""

from __future__ import annotations

import copy
import logging
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amppass.errors import AmpPassError, ScaleCollapseError, ScalerValueError
from amppass.training import loss_scaler
from amppass.training.loss_scaler import LossScaler

INF = float("inf")


def _one_param_setup(lr: float = 0.1, **scaler_kwargs):
    param = nn.Parameter(torch.ones(3))
    return param, torch.optim.SGD([param], lr=lr), LossScaler(**scaler_kwargs)


def _iteration(scaler: LossScaler, optimizer, param: torch.Tensor, overflow: bool = False) -> None:
    """One training iteration on loss = sum(param * c); c = inf makes every gradient inf."""
    optimizer.zero_grad()
    scaler.scale((param * (INF if overflow else 1.0)).sum()).backward()
    scaler.step(optimizer)
    scaler.update()


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer):
    params = [p.detach().clone() for p in model.parameters()]
    return params, copy.deepcopy(optimizer.state_dict())


def _assert_same_tree(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same_tree(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=False):
            _assert_same_tree(x, y)
    else:
        assert a == b


# ---------------------------------------------------------------- schedule


def test_defaults_are_grad_scalers():
    scaler = LossScaler()
    assert scaler.is_enabled()
    assert scaler.get_scale() == 2.0**16
    state = scaler.state_dict()
    assert state["growth_factor"] == 2.0
    assert state["backoff_factor"] == 0.5
    assert state["growth_interval"] == 2000
    assert state["_growth_tracker"] == 0
    assert state["hysteresis"] == 1


def test_growth_and_backoff_schedule():
    param, opt, scaler = _one_param_setup(init_scale=4.0, growth_interval=3)
    scales = []
    for overflow in [False, False, False, True, False, False, True, False, False, False]:
        _iteration(scaler, opt, param, overflow)
        scales.append(scaler.get_scale())
    # grows after 3 clean steps; an overflow halves and restarts the clean count
    assert scales == [4, 4, 8, 4, 4, 4, 2, 2, 2, 4]


def test_growth_stops_at_max_scale():
    param, opt, scaler = _one_param_setup(init_scale=2.0**22, growth_interval=1)
    scales = []
    for _ in range(4):
        _iteration(scaler, opt, param)
        scales.append(scaler.get_scale())
    assert scales == [2.0**23, 2.0**24, 2.0**24, 2.0**24]  # Apex amp's max_loss_scale, the default


def test_growth_never_reaches_inf():
    top = torch.finfo(torch.float32).max
    param, opt, scaler = _one_param_setup(init_scale=2.0**127, growth_interval=1, max_scale=top)
    _iteration(scaler, opt, param)
    assert scaler.get_scale() == top


def test_schedule_matches_torch_grad_scaler():
    rng = random.Random(0)
    ours_param, ours_opt, ours = _one_param_setup(init_scale=8.0, growth_interval=3)
    ref_param = nn.Parameter(torch.ones(3))
    ref_opt = torch.optim.SGD([ref_param], lr=0.1)
    ref = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=3)
    for _ in range(60):
        overflow = rng.random() < 0.3
        _iteration(ours, ours_opt, ours_param, overflow)
        _iteration(ref, ref_opt, ref_param, overflow)
        assert ours.get_scale() == ref.get_scale()
        assert ours.state_dict()["_growth_tracker"] == ref.state_dict()["_growth_tracker"]
        assert torch.equal(ours_param, ref_param)


def test_hysteresis_follows_megatron_overflows_every_other_step_back_off():
    """hysteresis=2 with an overflow every other step: Megatron-LM's rule backs off from the 2nd overflow on.

    Before, a clean step refilled the tracker, so this sequence skipped half the steps and never backed off.
    """
    param, opt, scaler = _one_param_setup(init_scale=1024.0, hysteresis=2, growth_interval=100)
    scales = []
    for overflow in [True, False] * 4:
        before = param.detach().clone()
        _iteration(scaler, opt, param, overflow)
        assert torch.equal(param, before) == overflow  # every overflowing step is skipped
        scales.append(scaler.get_scale())
    assert scales == [1024, 1024, 512, 512, 256, 256, 128, 128]


def test_hysteresis_is_refilled_only_by_growth():
    param, opt, scaler = _one_param_setup(init_scale=1024.0, hysteresis=2, growth_interval=3)
    scales, trackers = [], []
    for overflow in [True, False, False, False, True, True, True, False]:
        _iteration(scaler, opt, param, overflow)
        scales.append(scaler.get_scale())
        trackers.append(scaler.state_dict()["_hysteresis_tracker"])
    # 1st overflow tolerated; 3 clean steps grow and refill; then 1 tolerated, each further one backs off
    assert scales == [1024, 1024, 1024, 2048, 2048, 1024, 512, 512]
    assert trackers == [1, 1, 1, 2, 1, 0, 0, 0]


def _megatron_update(state: dict, found_inf: bool, min_scale: float, growth_interval: int, hysteresis: int) -> None:
    """Megatron-LM's DynamicGradScaler.update (megatron/core/optimizer/grad_scaler.py), transcribed: factors
    2 and 0.5, with the growth capped at LossScaler's default max_scale."""
    if found_inf:
        state["growth"] = 0
        state["hysteresis"] -= 1
        if state["hysteresis"] <= 0:
            state["scale"] = max(state["scale"] * 0.5, min_scale)
    else:
        state["growth"] += 1
        if state["growth"] == growth_interval:
            state["growth"] = 0
            state["hysteresis"] = hysteresis
            state["scale"] = min(state["scale"] * 2.0, 2.0**24)


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_schedule_matches_megatron_dynamic_grad_scaler(hysteresis):
    """Megatron's scales and trackers step for step, and ScaleCollapseError exactly where Megatron's back-off
    would go below min_scale (DeepSpeed's raise); after the error the scaler goes on from the floor."""
    rng = random.Random(hysteresis)
    param, opt, scaler = _one_param_setup(init_scale=2.0**4, growth_interval=4, hysteresis=hysteresis)
    megatron = {"scale": 2.0**4, "growth": 0, "hysteresis": hysteresis}
    collapses, grown = 0, False
    for step in range(300):
        overflow = rng.random() < (0.1, 0.6, 0.3)[step // 100]  # grow, collapse, mixed
        backs_off_at_floor = overflow and megatron["scale"] == 1.0 and megatron["hysteresis"] <= 1
        _megatron_update(megatron, overflow, 1.0, 4, hysteresis)
        try:
            _iteration(scaler, opt, param, overflow)
            raised = False
        except ScaleCollapseError:
            raised = True
        assert raised == backs_off_at_floor
        collapses += raised
        state = scaler.state_dict()
        assert state["scale"] == megatron["scale"]
        assert state["_growth_tracker"] == megatron["growth"]
        assert state["_hysteresis_tracker"] == max(megatron["hysteresis"], 0)
        grown |= state["scale"] > 2.0**4
    assert collapses > 0 and grown  # the sequence reached both ends


def test_update_new_scale_sets_the_scale():
    param, opt, scaler = _one_param_setup()
    _iteration(scaler, opt, param)
    scaler.scale(param.sum()).backward()
    scaler.step(opt)
    scaler.update(new_scale=128.0)
    assert scaler.get_scale() == 128.0


def test_state_dict_round_trip_continues_identically():
    param, opt, scaler = _one_param_setup(init_scale=64.0, growth_interval=3, hysteresis=3)
    for overflow in [False, False, True, True]:  # mid-growth and mid-hysteresis
        _iteration(scaler, opt, param, overflow)
    state = scaler.state_dict()
    assert state["_hysteresis_tracker"] == 1
    restored = LossScaler()
    restored.load_state_dict(state)
    assert restored.state_dict() == state

    param2 = nn.Parameter(param.detach().clone())
    opt2 = torch.optim.SGD([param2], lr=0.1)
    for overflow in [True, False, False, False, True]:
        _iteration(scaler, opt, param, overflow)
        _iteration(restored, opt2, param2, overflow)
        assert restored.state_dict() == scaler.state_dict()


def test_loads_a_torch_grad_scaler_checkpoint():
    ref = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    scaler = LossScaler()
    scaler.load_state_dict(ref.state_dict())
    assert scaler.get_scale() == 512.0
    assert scaler.state_dict()["growth_interval"] == 7


@pytest.mark.parametrize("saved, loaded", [(2.0**30, 2.0**24), (0.25, 1.0)])
def test_grad_scaler_scale_outside_the_bounds_loads_clamped(saved, loaded, caplog):
    ref = torch.amp.GradScaler("cpu", init_scale=saved)  # GradScaler's scale is unbounded
    scaler = LossScaler()
    with caplog.at_level(logging.WARNING, logger=loss_scaler.__name__):
        scaler.load_state_dict(ref.state_dict())
    assert scaler.get_scale() == loaded
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert f"scale {saved:.10g} lies outside [min_scale, max_scale] = [1, 16777216]" in record.getMessage()
    assert f"loaded as {loaded:.10g}" in record.getMessage()
    wide = LossScaler(max_scale=2.0**31)  # the fix the message names keeps the scale
    wide.load_state_dict(ref.state_dict())
    assert wide.get_scale() == max(saved, 1.0)


@pytest.mark.parametrize("bad", [INF, float("nan"), 0.0, -4.0, "65536"])
def test_load_state_dict_refuses_a_scale_that_is_not_positive_and_finite(bad):
    state = dict(torch.amp.GradScaler("cpu").state_dict(), scale=bad)
    with pytest.raises(ScalerValueError, match="the state dict's scale=.* must be a positive finite number"):
        LossScaler().load_state_dict(state)


def test_load_state_dict_rejects_empty_and_partial_dicts():
    with pytest.raises(AmpPassError, match="empty"):
        LossScaler().load_state_dict(LossScaler(dtype="bf16").state_dict())
    with pytest.raises(AmpPassError, match="growth_interval"):
        LossScaler().load_state_dict({"scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5})


# ---------------------------------------------------------------- the scale's bounds


def test_grad_scaler_collapses_into_inf_and_loss_scaler_raises_instead():
    """144 overflows in a row take GradScaler's scale from 2**16 to 2**-128, whose inverse is inf, and the next
    clean step writes inf into the parameters. LossScaler stops at min_scale=1 and raises on the next back-off."""
    ref_param = nn.Parameter(torch.ones(3))
    ref_opt = torch.optim.SGD([ref_param], lr=0.1)
    ref = torch.amp.GradScaler("cpu")
    for _ in range(144):
        _iteration(ref, ref_opt, ref_param, overflow=True)
    assert ref.get_scale() == 2.0**-128
    _iteration(ref, ref_opt, ref_param)
    assert not torch.isfinite(ref_param).any()  # the anchor's failure

    param, opt, scaler = _one_param_setup()
    for _ in range(16):
        _iteration(scaler, opt, param, overflow=True)
    assert scaler.get_scale() == 1.0
    with pytest.raises(ScaleCollapseError, match="min_scale=1") as caught:
        _iteration(scaler, opt, param, overflow=True)
    assert isinstance(caught.value, RuntimeError)  # what a GradScaler loop may already catch
    assert "17 steps skipped" in str(caught.value)
    assert scaler.get_scale() == 1.0
    _iteration(scaler, opt, param)  # the floor's scale still trains
    assert torch.isfinite(param).all() and not torch.equal(param, torch.ones(3))


def test_lowest_min_scale_keeps_the_inverse_finite():
    param, opt, scaler = _one_param_setup(init_scale=2.0**-120, min_scale=2.0**-126)
    for _ in range(6):
        _iteration(scaler, opt, param, overflow=True)
    assert scaler.get_scale() == 2.0**-126
    _iteration(scaler, opt, param)
    assert torch.allclose(param, torch.full((3,), 0.9))  # the true gradient, 1.0, unscaled from 2**-126
    with pytest.raises(ScaleCollapseError):
        _iteration(scaler, opt, param, overflow=True)


def test_backoff_stops_at_min_scale_with_hysteresis():
    param, opt, scaler = _one_param_setup(init_scale=8.0, min_scale=3.0, hysteresis=2)
    scales = []
    for _ in range(3):
        _iteration(scaler, opt, param, overflow=True)
        scales.append(scaler.get_scale())
    assert scales == [8.0, 4.0, 3.0]  # clamped to the floor, as Megatron-LM's max(scale * backoff, min_scale)
    with pytest.raises(ScaleCollapseError):
        _iteration(scaler, opt, param, overflow=True)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"min_scale": 0.0}, "min_scale=0.0 must be a number >= 2**-126"),
        ({"min_scale": 2.0**-127}, "min_scale="),
        ({"max_scale": 0.5}, "max_scale=0.5 must be a number between min_scale=1.0"),
        ({"max_scale": float("inf")}, "max_scale=inf"),
        ({"init_scale": 0.5}, "init_scale=0.5 lies outside [min_scale, max_scale] = [1, 16777216]"),
        ({"init_scale": 2.0**25}, "lies outside"),
    ],
)
def test_bad_bounds_name_the_argument(kwargs, words):
    with pytest.raises(ScalerValueError) as caught:
        LossScaler(**kwargs)
    assert words in str(caught.value)


def test_update_new_scale_must_lie_within_the_bounds():
    param, opt, scaler = _one_param_setup()
    scaler.scale(param.sum()).backward()
    scaler.step(opt)
    with pytest.raises(ScalerValueError, match=r"update\(new_scale\)=0.25 lies outside"):
        scaler.update(new_scale=0.25)


# ---------------------------------------------------------------- skipped steps


def _small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "adam_fused": lambda params: torch.optim.Adam(params, lr=1e-2, fused=True),
}


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("poison", ["inf_loss", "nan_grad"])
def test_overflow_skips_exactly_that_step(optimizer_name, poison):
    model = _small_model()
    opt = OPTIMIZERS[optimizer_name](model.parameters())
    scaler = LossScaler(init_scale=2.0**10)
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def iteration(poisoned: bool) -> None:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        if poisoned and poison == "inf_loss":
            loss = loss * INF
        scaler.scale(loss).backward()
        if poisoned and poison == "nan_grad":
            model[0].weight.grad[0, 0] = float("nan")
        scaler.step(opt)
        scaler.update()

    for _ in range(3):
        iteration(poisoned=False)
    params, opt_state = _snapshot(model, opt)

    iteration(poisoned=True)
    params_after, opt_state_after = _snapshot(model, opt)
    _assert_same_tree(params_after, params)
    _assert_same_tree(opt_state_after, opt_state)
    for state in opt.state.values():
        for value in state.values():
            assert torch.isfinite(value).all()
    assert scaler.get_scale() == 2.0**9

    iteration(poisoned=False)  # the next clean step trains again
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), params, strict=False))


def test_skipped_steps_are_counted_and_checkpointed():
    param, opt, scaler = _one_param_setup(init_scale=2.0**10)
    for overflow in [True, False, True, True, False]:
        _iteration(scaler, opt, param, overflow)
    assert scaler.skipped_steps == 3
    state = scaler.state_dict()
    assert state["skipped_steps"] == 3
    restored = LossScaler()
    restored.load_state_dict(state)
    assert restored.skipped_steps == 3

    old = {k: v for k, v in state.items() if k not in ("skipped_steps", "min_scale", "max_scale")}
    from_old = LossScaler(init_scale=2.0**11, min_scale=2.0, max_scale=2.0**12)
    from_old.load_state_dict(old)  # a dict saved before these keys existed
    assert from_old.skipped_steps == 0
    assert (from_old.state_dict()["min_scale"], from_old.state_dict()["max_scale"]) == (2.0, 2.0**12)
    assert LossScaler(dtype="bf16").skipped_steps == 0


class FakeClock:
    """Stands in for loss_scaler._clock: time moves only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(loss_scaler, "_clock", fake)
    return fake


def _skip_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == loss_scaler.__name__ and "skipped" in r.getMessage()]


def test_skipped_steps_are_logged_at_a_rate_limit(clock, caplog, capsys):
    param, opt, scaler = _one_param_setup(init_scale=2.0**10)
    with caplog.at_level(logging.INFO, logger=loss_scaler.__name__):
        _iteration(scaler, opt, param, overflow=True)  # the first one is told at once
        assert _skip_lines(caplog) == [
            "LossScaler skipped 1 optimizer step(s) because gradients held inf/NaN (1 in all); loss scale after "
            "the last: 512"
        ]
        for _ in range(3):
            clock.now += 10
            _iteration(scaler, opt, param, overflow=True)
            _iteration(scaler, opt, param)
        assert len(_skip_lines(caplog)) == 1  # within the minute: counted, not told
        clock.now += 40
        _iteration(scaler, opt, param)  # a clean step past the minute tells what is pending
        assert _skip_lines(caplog)[1:] == [
            "LossScaler skipped 3 optimizer step(s) in the last 70 s because gradients held inf/NaN (4 in all); "
            "loss scale after the last: 64"
        ]
        clock.now += 120
        _iteration(scaler, opt, param)
        assert len(_skip_lines(caplog)) == 2  # nothing new to tell
    assert all(r.levelno == logging.INFO for r in caplog.records)
    assert capsys.readouterr() == ("", "")


def test_a_skip_line_names_its_rank_in_a_group_of_several(clock, caplog, monkeypatch):
    """Every rank logs its own skips; in a group of several the lines say which rank wrote them."""
    param, opt, scaler = _one_param_setup(init_scale=2.0**10)
    monkeypatch.setattr(loss_scaler, "_distributed_initialized", lambda: True)
    monkeypatch.setattr(loss_scaler.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda group=None: 1)
    with caplog.at_level(logging.INFO, logger=loss_scaler.__name__):
        _iteration(scaler, opt, param, overflow=True)
    assert _skip_lines(caplog) == [
        "LossScaler on rank 1 of 2 skipped 1 optimizer step(s) because gradients held inf/NaN (1 in all); loss "
        "scale after the last: 512"
    ]


def test_reaching_min_scale_warns(clock, caplog):
    param, opt, scaler = _one_param_setup(init_scale=2.0)
    with caplog.at_level(logging.INFO, logger=loss_scaler.__name__):
        _iteration(scaler, opt, param, overflow=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["LossScaler's loss scale is at its minimum, min_scale=1: one more back-off raises "
                        "ScaleCollapseError"]


# ---------------------------------------------------------------- fp16 underflow


class Fp16Linear(nn.Module):
    """fp32 master parameters, cast to fp16 in forward: the gradient flows back through fp16 tensors."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) * 0.1)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        return F.linear(x.to(dtype), self.weight.to(dtype), self.bias.to(dtype)).float()


LOSS_WEIGHT = 1e-7  # a small loss term: d(loss)/d(output) ~ 1e-9, below fp16's smallest subnormal 6e-8


def _regression():
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    y = x @ torch.randn(8, 4)
    return x, y


def _tiny_loss(model: Fp16Linear, x, y, dtype=torch.float16) -> torch.Tensor:
    return LOSS_WEIGHT * F.mse_loss(model(x, dtype), y)


def test_fp16_gradients_underflow_without_scaling():
    x, y = _regression()
    torch.manual_seed(1)
    model = Fp16Linear(8, 4)
    _tiny_loss(model, x, y, dtype=torch.float32).backward()
    assert model.weight.grad.abs().min() > 0  # the true gradient is non-zero...
    model.zero_grad()
    _tiny_loss(model, x, y).backward()
    assert torch.count_nonzero(model.weight.grad) == 0  # ...but flushes to zero through fp16
    assert torch.count_nonzero(model.bias.grad) == 0


def test_scaler_recovers_fp16_gradients_and_trains():
    x, y = _regression()
    torch.manual_seed(1)
    model = Fp16Linear(8, 4)
    reference = copy.deepcopy(model)
    _tiny_loss(reference, x, y, dtype=torch.float32).backward()

    scaler = LossScaler()
    scaler.scale(_tiny_loss(model, x, y)).backward()
    scaler.unscale_(torch.optim.Adam(model.parameters(), lr=1e-2))
    assert model.weight.grad.abs().min() > 0
    torch.testing.assert_close(model.weight.grad, reference.weight.grad, rtol=1e-2, atol=0)

    def train(use_scaler: bool) -> tuple[float, float]:
        torch.manual_seed(1)
        model = Fp16Linear(8, 4)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        scaler = LossScaler(enabled=use_scaler)
        start = F.mse_loss(model(x), y).item()
        for _ in range(100):
            opt.zero_grad()
            scaler.scale(_tiny_loss(model, x, y)).backward()
            scaler.step(opt)
            scaler.update()
        return start, F.mse_loss(model(x), y).item()

    start, end = train(use_scaler=False)
    assert end == start  # zero gradients: Adam never moves
    start, end = train(use_scaler=True)
    assert end < 0.5 * start


# ---------------------------------------------------------------- unscale_, clipping, call order


def test_clip_after_unscale_sees_true_gradients():
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    reference = copy.deepcopy(model)
    x = torch.randn(10, 6)

    reference(x).pow(2).sum().backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    torch.optim.SGD(reference.parameters(), lr=0.1).step()

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler()
    scaler.scale(model(x).pow(2).sum()).backward()
    assert model.weight.grad.abs().max() > 1000  # still scaled by 2**16
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    torch.testing.assert_close(norm, ref_norm)
    assert ref_norm > 1.0  # clipping did act
    scaler.step(opt)  # must not unscale a second time
    scaler.update()
    for p, ref_p in zip(model.parameters(), reference.parameters(), strict=False):
        torch.testing.assert_close(p, ref_p)


def test_unscale_twice_raises():
    param, opt, scaler = _one_param_setup()
    scaler.scale(param.sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(AmpPassError, match="unscale_.*already"):
        scaler.unscale_(opt)


def test_call_order_mistakes_raise():
    param, opt, scaler = _one_param_setup()
    with pytest.raises(AmpPassError, match="before scaler.scale"):
        scaler.step(opt)
    scaler.scale(param.sum())  # no backward
    with pytest.raises(AmpPassError, match="backward"):
        scaler.step(opt)
    with pytest.raises(AmpPassError, match="before scaler.step"):
        scaler.update()
    scaler.scale(param.sum()).backward()
    scaler.step(opt)
    with pytest.raises(AmpPassError, match="already called"):
        scaler.step(opt)
    with pytest.raises(AmpPassError, match="after scaler.step"):
        scaler.unscale_(opt)
    with pytest.raises(AmpPassError, match="closure"):
        scaler.step(opt, closure=lambda: None)
    scaler.update()
    _iteration(scaler, opt, param)  # a fresh iteration works after update()


def test_unscale_refuses_fp16_gradients():
    param = nn.Parameter(torch.ones(3, dtype=torch.float16))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = LossScaler()
    param.grad = scaler.scale(torch.ones(3, dtype=torch.float16))
    with pytest.raises(AmpPassError, match="fp32 master"):
        scaler.unscale_(opt)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": "cuda"}, "init_scale"),
        ({"init_scale": INF}, "init_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 2.5}, "growth_interval"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"enabled": "yes"}, "enabled"),
        ({"dtype": torch.float32}, "dtype"),
        ({"dtype": "auto"}, "dtype"),
    ],
)
def test_bad_constructor_arguments_name_the_argument(kwargs, name):
    with pytest.raises(AmpPassError, match=name):
        LossScaler(**kwargs)


# ---------------------------------------------------------------- scale(), backward()


def test_scale_handles_nested_lists_and_tuples():
    scaler = LossScaler(init_scale=4.0)
    a, b, c = torch.tensor(1.0), torch.tensor([2.0, 3.0]), torch.tensor(5.0)
    scaled = scaler.scale([a, (b, [c])])
    assert isinstance(scaled, list) and isinstance(scaled[1], tuple) and isinstance(scaled[1][1], list)
    assert scaled[0].item() == 4.0
    assert torch.equal(scaled[1][0], torch.tensor([8.0, 12.0]))
    assert scaled[1][1][0].item() == 20.0
    with pytest.raises(AmpPassError, match="dict"):
        scaler.scale({"loss": a})


def test_backward_is_scale_then_backward():
    param, _, scaler = _one_param_setup(init_scale=8.0)
    scaler.backward((param * 3).sum())
    assert torch.equal(param.grad, torch.full((3,), 24.0))


# ---------------------------------------------------------------- bf16 / disabled passthrough


@pytest.mark.parametrize("kwargs", [{"dtype": torch.bfloat16}, {"dtype": "bf16"}, {"enabled": False}])
def test_passthrough_scaler(kwargs, caplog, capsys):
    with caplog.at_level(logging.INFO, logger="amppass.training.loss_scaler"):
        scaler = LossScaler(**kwargs)
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "passthrough" in caplog.records[0].getMessage()

    param, opt, _ = _one_param_setup()
    loss = (param * 2).sum()
    assert scaler.scale(loss) is loss
    assert not scaler.is_enabled()
    assert scaler.get_scale() == 1.0
    loss.backward()
    scaler.unscale_(opt)
    assert torch.equal(param.grad, torch.full((3,), 2.0))
    scaler.step(opt)  # just optimizer.step()
    scaler.update()
    assert torch.allclose(param, torch.full((3,), 0.8))
    assert scaler.state_dict() == {}
    assert len(caplog.records) == 1  # said once, at construction
    assert capsys.readouterr() == ("", "")


def test_fp16_spelled_as_string_scales():
    assert LossScaler(dtype="fp16", init_scale=8.0).scale(torch.tensor(1.0)).item() == 8.0


# ---------------------------------------------------------------- fused optimizers: no host sync

SYNCING_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


def _fused_adam_supported() -> bool:
    try:
        param = nn.Parameter(torch.ones(2))
        opt = torch.optim.Adam([param], fused=True)
        param.grad = torch.ones(2)
        opt.step()
    except (RuntimeError, ValueError):
        return False
    return getattr(opt, "_step_supports_amp_scaling", False)


@pytest.fixture
def forbid_host_sync():
    """A context in which reading a tensor's value on the host raises (its own patches: others' stay)."""

    class Forbid:
        def __enter__(self):
            def sync(*args, **kwargs):
                raise AssertionError("host sync")

            self.patch = pytest.MonkeyPatch()
            for method in SYNCING_METHODS:
                self.patch.setattr(torch.Tensor, method, sync)

        def __exit__(self, *exc):
            self.patch.undo()

    return Forbid()


def test_plain_optimizer_syncs_once_per_step(forbid_host_sync):
    """The guard works: a plain optimizer needs the skip decision on the host."""
    param, opt, scaler = _one_param_setup()
    scaler.scale(param.sum()).backward()
    with forbid_host_sync, pytest.raises(AssertionError, match="host sync"):
        scaler.step(opt)


@pytest.mark.skipif(not _fused_adam_supported(), reason="this torch has no fused Adam on CPU")
@pytest.mark.parametrize("clip", [False, True])
def test_fused_adam_steps_and_skips_without_host_sync(forbid_host_sync, clip):
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    fused_model, plain_model = _small_model(), _small_model()
    fused_opt = torch.optim.Adam(fused_model.parameters(), lr=1e-2, fused=True)
    plain_opt = torch.optim.Adam(plain_model.parameters(), lr=1e-2)
    fused_scaler, plain_scaler = LossScaler(init_scale=2.0**10), LossScaler(init_scale=2.0**10)

    for overflow in [False, False, True, False]:
        for model, opt, scaler, fused in [
            (fused_model, fused_opt, fused_scaler, True),
            (plain_model, plain_opt, plain_scaler, False),
        ]:
            opt.zero_grad()
            loss = F.mse_loss(model(x), y) * (INF if overflow else 1.0)
            scaler.scale(loss).backward()
            before = _snapshot(model, opt)
            if fused:
                with forbid_host_sync:
                    if clip:
                        scaler.unscale_(opt)
                    scaler.step(opt)
                    scaler.update()
            else:
                if clip:
                    scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
            if overflow:
                _assert_same_tree(_snapshot(model, opt), before)
        assert fused_scaler.get_scale() == plain_scaler.get_scale()
        for p_fused, p_plain in zip(fused_model.parameters(), plain_model.parameters(), strict=False):
            torch.testing.assert_close(p_fused, p_plain)
    assert fused_scaler.get_scale() == 2.0**9


@pytest.mark.skipif(not _fused_adam_supported(), reason="this torch has no fused Adam on CPU")
def test_fused_adam_counters_are_read_once_a_minute(forbid_host_sync, clock, caplog):
    """Fused optimizers skip on the device: the host reads the counters only when the report interval has
    passed, then logs the skips and raises a collapse that happened meanwhile."""
    model = _small_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    scaler = LossScaler(init_scale=2.0)
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def iteration(overflow: bool) -> None:
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(x), y) * (INF if overflow else 1.0)).backward()
        scaler.step(opt)
        scaler.update()

    with caplog.at_level(logging.INFO, logger=loss_scaler.__name__):
        with forbid_host_sync:
            iteration(overflow=True)  # 2 -> 1
            iteration(overflow=True)  # a back-off due at min_scale: noted on the device
            iteration(overflow=False)
        assert _skip_lines(caplog) == []
        clock.now += loss_scaler.REPORT_INTERVAL_S
        with pytest.raises(ScaleCollapseError, match="2 steps skipped"):
            iteration(overflow=False)
        assert _skip_lines(caplog) == []  # the error says it
        iteration(overflow=False)  # the collapse was told once; training goes on
    assert scaler.skipped_steps == 2
