"""LossScaler against torch.amp.GradScaler: scripted training sequences bit for bit, the differences that are
deliberate, the public methods, and the exceptions misuse raises."""

from __future__ import annotations

import copy
import random
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amppass.errors import AmpPassError, ScaleCollapseError, ScalerUsageError
from amppass.training.loss_scaler import LossScaler

INF = float("inf")


def ours(**kwargs: Any) -> LossScaler:
    return LossScaler(**kwargs)


def grad_scaler(**kwargs: Any) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", **kwargs)


class Recorder:
    """What a sequence did, step by step: scales, growth trackers, step results, parameters, optimizer state."""

    def __init__(self, model: nn.Module, *optimizers: torch.optim.Optimizer) -> None:
        self.model, self.optimizers, self.rows = model, optimizers, []

    def __call__(self, scaler, result: Any = None) -> None:
        self.rows.append({
            "scale": scaler.get_scale(),
            "growth_tracker": scaler.state_dict().get("_growth_tracker"),
            "result": result,
            "factors": (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval())
            if scaler.is_enabled() else None,
            "params": [p.detach().clone() for p in self.model.parameters()],
            "optimizers": [copy.deepcopy(o.state_dict()) for o in self.optimizers],
        })


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(16, 4, generator=generator), torch.randn(16, 1, generator=generator)


def _overflows(seed: int, steps: int, rate: float) -> list[bool]:
    rng = random.Random(seed)
    return [rng.random() < rate for _ in range(steps)]


def _mse_backward(scaler, model: nn.Module, step: int, overflow: bool) -> None:
    """One batch's scaled backward; an overflow multiplies the loss by inf."""
    x, y = _batch(step)
    scaler.scale(F.mse_loss(model(x), y) * (INF if overflow else 1.0)).backward()


def _loop(make: Callable, optimizer: Callable, pattern: list[bool], *, model: Callable[[], nn.Module] = _mlp,
          backward: Callable = _mse_backward, clip: bool = False, before: Callable | None = None,
          new_scale: dict | None = None, **settings: Any) -> list:
    """The plain loop on an overflow pattern: zero_grad, ``backward(scaler, model, step, overflow)``,
    (unscale_ + clip), step, update.

    ``before(step, scaler, make)`` may return another scaler at the start of a step; ``new_scale`` maps steps to
    the argument of that step's ``update``.
    """
    net = model()
    opt = optimizer(net.parameters())
    scaler = make(**settings)
    record = Recorder(net, opt)
    for step, overflow in enumerate(pattern):
        scaler = before(step, scaler, make) if before else scaler
        opt.zero_grad()
        backward(scaler, net, step, overflow)
        if clip:
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        result = scaler.step(opt)
        scaler.update((new_scale or {}).get(step))
        record(scaler, result)
    return record.rows


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def _fused_adam(params):
    return torch.optim.Adam(params, lr=1e-2, fused=True)


def seq_sgd_random(make):
    return _loop(make, _sgd, _overflows(0, 60, 0.3), init_scale=8.0, growth_interval=3)


def seq_adam_clip(make):
    return _loop(make, _adam, _overflows(1, 40, 0.2), clip=True, init_scale=2.0**10, growth_interval=4)


def seq_fused_adam(make):
    return _loop(make, _fused_adam, _overflows(2, 40, 0.2), init_scale=2.0**10, growth_interval=4)


def seq_fused_adam_clip(make):
    return _loop(make, _fused_adam, _overflows(3, 40, 0.2), clip=True, init_scale=2.0**10, growth_interval=4)


def seq_two_optimizers(make):
    """Two optimizers over two halves of the model; an inf in one half's gradient skips both (one update)."""
    model = _mlp()
    first, second = torch.optim.SGD(model[0].parameters(), lr=0.1), _adam(model[2].parameters())
    scaler = make(init_scale=2.0**6, growth_interval=2)
    record = Recorder(model, first, second)
    for step, overflow in enumerate(_overflows(4, 30, 0.25)):
        x, y = _batch(step)
        first.zero_grad()
        second.zero_grad()
        scaler.scale(F.mse_loss(model(x), y)).backward()
        if overflow:
            model[2].bias.grad.fill_(INF)
        results = (scaler.step(first), scaler.step(second))
        scaler.update()
        record(scaler, results)
    return record.rows


def seq_accumulation(make):
    """Two micro-batches accumulate scaled gradients before one step; an overflow comes in the second."""

    def backward(scaler, model: nn.Module, step: int, overflow: bool) -> None:
        for micro in range(2):
            x, y = _batch(2 * step + micro)
            scaler.scale(F.mse_loss(model(x), y) * (INF if overflow and micro == 1 else 1.0) / 2).backward()

    return _loop(make, _sgd, _overflows(5, 30, 0.2), backward=backward, init_scale=2.0**8, growth_interval=3)


def seq_multiple_losses(make):
    """Two losses scaled as a list, each with its own backward."""

    def backward(scaler, model: nn.Module, step: int, overflow: bool) -> None:
        x, y = _batch(step)
        out = model(x)
        first, second = scaler.scale([F.mse_loss(out, y), out.abs().mean() * (INF if overflow else 1.0)])
        first.backward(retain_graph=True)
        second.backward()

    return _loop(make, _adam, _overflows(6, 30, 0.25), backward=backward, init_scale=2.0**7, growth_interval=2)


def seq_nan_gradient(make):
    """NaN, not inf, in one gradient element."""

    def backward(scaler, model: nn.Module, step: int, overflow: bool) -> None:
        _mse_backward(scaler, model, step, overflow=False)
        if overflow:
            model[0].weight.grad[1, 2] = float("nan")

    return _loop(make, _sgd, _overflows(7, 30, 0.3), backward=backward, init_scale=2.0**12, growth_interval=2)


def seq_new_scale(make):
    """update(new_scale=...) with a float and with a tensor, between ordinary updates."""
    return _loop(make, _sgd, _overflows(8, 20, 0.2), new_scale={5: 64.0, 11: torch.tensor(32.0)},
                 init_scale=2.0**8, growth_interval=2)


def seq_resume_from_state_dict(make):
    """Mid-run, a fresh scaler of the same kind loads the state dict and carries on."""

    def resume(step: int, scaler, make: Callable):
        if step != 13:
            return scaler
        fresh = make()
        fresh.load_state_dict(scaler.state_dict())
        return fresh

    return _loop(make, _adam, _overflows(9, 30, 0.25), before=resume, init_scale=2.0**9, growth_interval=3)


def seq_setters_mid_run(make):
    """set_growth_factor / set_backoff_factor / set_growth_interval mid-run, with factors that are not powers
    of two (the products must round as GradScaler's kernel rounds them)."""

    def change(step: int, scaler, make: Callable):
        if step == 15:
            scaler.set_growth_factor(1.37)
            scaler.set_backoff_factor(0.71)
            scaler.set_growth_interval(scaler.get_growth_interval() + 1)
        return scaler

    return _loop(make, _sgd, _overflows(10, 40, 0.3), before=change, init_scale=1000.0, growth_factor=1.7,
                 backoff_factor=0.3, growth_interval=2)


def seq_sparse_embedding(make):
    """A sparse embedding gradient with repeated indices (uncoalesced), plain SGD."""
    torch.manual_seed(0)
    model = nn.Embedding(10, 3, sparse=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make(init_scale=2.0**4, growth_interval=2)
    record = Recorder(model, opt)
    for step, overflow in enumerate(_overflows(11, 20, 0.25)):
        opt.zero_grad()
        indices = torch.tensor([1, 3, 3, 7, 1, step % 10])
        scaler.scale(model(indices).sum() * (INF if overflow else 1.0)).backward()
        result = scaler.step(opt)
        scaler.update()
        record(scaler, result)
    return record.rows


def seq_unused_parameter(make):
    """A parameter that never gets a gradient (None), beside ones that do."""

    def model() -> nn.Module:
        net = _mlp()
        net.register_parameter("unused", nn.Parameter(torch.ones(2)))
        return net

    return _loop(make, _adam, _overflows(12, 20, 0.3), model=model, init_scale=2.0**6, growth_interval=2)


def seq_disabled(make):
    return _loop(make, _sgd, _overflows(13, 10, 0.0), enabled=False)


def seq_long_clean_run(make):
    """Growth every step from 2**20: GradScaler passes 2**24, LossScaler stops at max_scale=2**24."""
    return _loop(make, _sgd, [False] * 8, init_scale=2.0**20, growth_interval=1)


def seq_overflows_in_a_row(make):
    """Overflow after overflow from 2**4: GradScaler goes below 1, LossScaler stops at min_scale=1 and raises."""
    return _loop(make, _sgd, [True] * 8, init_scale=2.0**4)


SEQUENCES = {
    "sgd_random": seq_sgd_random,
    "adam_clip": seq_adam_clip,
    "fused_adam": seq_fused_adam,
    "fused_adam_clip": seq_fused_adam_clip,
    "two_optimizers": seq_two_optimizers,
    "accumulation": seq_accumulation,
    "multiple_losses": seq_multiple_losses,
    "nan_gradient": seq_nan_gradient,
    "new_scale": seq_new_scale,
    "resume_from_state_dict": seq_resume_from_state_dict,
    "setters_mid_run": seq_setters_mid_run,
    "sparse_embedding": seq_sparse_embedding,
    "unused_parameter": seq_unused_parameter,
    "disabled": seq_disabled,
}


def _assert_same_rows(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want, strict=False)):
        assert a["scale"] == b["scale"], f"step {step}"
        assert a["growth_tracker"] == b["growth_tracker"], f"step {step}"
        assert a["result"] == b["result"] if not isinstance(a["result"], torch.Tensor) else torch.equal(
            a["result"], b["result"]), f"step {step}"
        _assert_same_tree(a["params"], b["params"], f"step {step} params")
        _assert_same_tree(a["optimizers"], b["optimizers"], f"step {step} optimizer state")


def _assert_same_tree(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where  # bit for bit (NaN never appears: skipped steps leave no NaN)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same_tree(a[key], b[key], where)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for x, y in zip(a, b, strict=False):
            _assert_same_tree(x, y, where)
    else:
        assert a == b, where


@pytest.mark.parametrize("name", sorted(SEQUENCES))
def test_sequence_matches_grad_scaler_bit_for_bit(name):
    _assert_same_rows(SEQUENCES[name](ours), SEQUENCES[name](grad_scaler))


def test_long_clean_run_stops_at_max_scale_where_grad_scaler_grows_on():
    got, want = seq_long_clean_run(ours), seq_long_clean_run(grad_scaler)
    assert [r["scale"] for r in want] == [2.0**e for e in range(21, 29)]
    assert [r["scale"] for r in got] == [2.0**21, 2.0**22, 2.0**23] + [2.0**24] * 5
    _assert_same_rows(got[:4], want[:4])  # identical up to the cap


def test_overflows_in_a_row_stop_at_min_scale_and_raise_where_grad_scaler_goes_below_one():
    want = seq_overflows_in_a_row(grad_scaler)
    assert [r["scale"] for r in want] == [2.0**e for e in range(3, -5, -1)]
    with pytest.raises(ScaleCollapseError):
        seq_overflows_in_a_row(ours)  # 2**4 -> 1 in four back-offs; the fifth falls due at the floor


def test_lowering_growth_interval_below_the_count_grows_next_step_where_grad_scaler_never_grows():
    """GradScaler grows when the clean-step count equals the interval; a count already past it never does."""
    def run(make) -> list[float]:
        model = _mlp()
        opt = _sgd(model.parameters())
        scaler = make(init_scale=2.0**8, growth_interval=10)
        scales = []
        for step in range(8):
            if step == 5:
                scaler.set_growth_interval(3)  # five clean steps already counted
            x, y = _batch(step)
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales

    assert run(grad_scaler) == [2.0**8] * 8
    assert run(ours) == [2.0**8] * 5 + [2.0**9, 2.0**9, 2.0**9]


def test_every_public_grad_scaler_method_exists():
    public = {name for name in dir(torch.amp.GradScaler) if not name.startswith("_")}
    assert public <= set(dir(LossScaler))


@pytest.mark.parametrize(
    ("setter", "bad"),
    [("set_growth_factor", 1.0), ("set_backoff_factor", 1.5), ("set_growth_interval", 0),
     ("set_growth_interval", 2.5)],
)
def test_setters_refuse_what_the_constructor_refuses(setter, bad):
    scaler = LossScaler()
    with pytest.raises(ValueError, match=setter.removeprefix("set_")):
        getattr(scaler, setter)(bad)


# ---------------------------------------------------------------- misuse: the same exception classes


def _param_and_optimizer(dtype: torch.dtype = torch.float32):
    param = nn.Parameter(torch.ones(3, dtype=dtype))
    return param, torch.optim.SGD([param], lr=0.1)


def _backward(scaler, param) -> None:
    scaler.scale((param.float() * 2).sum()).backward()


def _after_backward(*calls: str, **step_kwargs: Any) -> Callable:
    """A misuse: one scaled backward, then these scaler methods on the optimizer, in order."""

    def sequence(scaler) -> None:
        param, opt = _param_and_optimizer()
        _backward(scaler, param)
        for call in calls:
            getattr(scaler, call)(opt, **(step_kwargs if call == "step" else {}))

    return sequence


def misuse_load_empty_state_dict(scaler):
    scaler.load_state_dict({})


def misuse_unscale_fp16_gradients(scaler):
    param, opt = _param_and_optimizer(torch.float16)
    param.grad = scaler.scale(torch.ones(3, dtype=torch.float16))
    scaler.unscale_(opt)


def misuse_scale_a_number(scaler):
    scaler.scale(3.0)


MISUSE = {
    "unscale_twice": (_after_backward("unscale_", "unscale_"), RuntimeError),
    "unscale_after_step": (_after_backward("step", "unscale_"), RuntimeError),
    "step_twice": (_after_backward("step", "step"), RuntimeError),
    "closure": (_after_backward("step", closure=lambda: None), RuntimeError),
    "load_empty_state_dict": (misuse_load_empty_state_dict, RuntimeError),
    "unscale_fp16_gradients": (misuse_unscale_fp16_gradients, ValueError),
    "scale_a_number": (misuse_scale_a_number, ValueError),
}


@pytest.mark.parametrize("name", sorted(MISUSE))
def test_misuse_raises_what_grad_scaler_raises(name):
    """An ``except RuntimeError``/``except ValueError`` written for GradScaler catches LossScaler's error too."""
    sequence, kind = MISUSE[name]
    with pytest.raises(kind) as theirs:
        sequence(grad_scaler())
    assert type(theirs.value) is kind
    with pytest.raises(kind) as caught:
        sequence(ours())
    assert isinstance(caught.value, AmpPassError)


def misuse_step_before_scale(scaler):
    scaler.step(_param_and_optimizer()[1])


def misuse_update_before_step(scaler):
    param, _ = _param_and_optimizer()
    _backward(scaler, param)
    scaler.update()


def misuse_step_without_gradients(scaler):
    scaler.scale(torch.ones(()))
    scaler.step(_param_and_optimizer()[1])


@pytest.mark.parametrize("sequence", [misuse_step_before_scale, misuse_update_before_step,
                                      misuse_step_without_gradients])
def test_where_grad_scaler_asserts_loss_scaler_raises_a_runtime_error(sequence):
    """GradScaler raises AssertionError (gone under python -O) for these; LossScaler a RuntimeError."""
    with pytest.raises(AssertionError):
        sequence(grad_scaler())
    with pytest.raises(ScalerUsageError) as caught:
        sequence(ours())
    assert isinstance(caught.value, RuntimeError)
