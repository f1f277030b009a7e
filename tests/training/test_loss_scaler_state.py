"""LossScaler.load_state_dict with untrusted checkpoints: every value checked before any is assigned, no
checkpoint loosens the bounds the scaler was built with, and no hysteresis stalls training without a word."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from amppass.errors import AmpPassError, ScaleCollapseError, ScalerValueError
from amppass.training import loss_scaler
from amppass.training.loss_scaler import LossScaler
from amppass.training.scaler_values import MAX_HYSTERESIS

INF, NAN = float("inf"), float("nan")


def _iteration(scaler: LossScaler, optimizer, param: torch.Tensor, overflow: bool = False) -> None:
    optimizer.zero_grad()
    scaler.scale((param * (INF if overflow else 1.0)).sum()).backward()
    scaler.step(optimizer)
    scaler.update()


def _trained_scaler() -> tuple[LossScaler, torch.optim.Optimizer, nn.Parameter]:
    """A scaler whose trackers and counters are all off their initial values."""
    param = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = LossScaler(init_scale=2.0**10, growth_interval=5, hysteresis=2)
    for overflow in [True, False, True, True, False, False]:
        _iteration(scaler, opt, param, overflow)
    return scaler, opt, param


def _donor_state() -> dict:
    """A valid state that differs from the trained scaler's in every key, so a partial load would show."""
    return {
        "scale": 512.0,
        "growth_factor": 3.0,
        "backoff_factor": 0.25,
        "growth_interval": 7,
        "_growth_tracker": 5,
        "hysteresis": 4,
        "_hysteresis_tracker": 3,
        "min_scale": 2.0,
        "max_scale": 2.0**20,
        "skipped_steps": 9,
    }


BAD_VALUES = [
    # the reported ones
    ("hysteresis", 2**31 - 1),
    ("_growth_tracker", "abc"),
    ("_growth_tracker", 2**40),
    ("skipped_steps", 2**70),
    ("growth_interval", 10**30),
    # bools, floats for ints, NaN, inf, negatives, non-numbers, values past the bounds
    ("growth_interval", True),
    ("growth_interval", 2000.0),
    ("growth_interval", NAN),
    ("growth_interval", INF),
    ("growth_interval", -5),
    ("growth_interval", 0),
    ("growth_interval", "2000"),
    ("growth_interval", None),
    ("growth_interval", 2**30 + 1),
    ("_growth_tracker", -1),
    ("_growth_tracker", 3.0),
    ("_growth_tracker", False),
    ("_growth_tracker", -(2**31)),
    ("hysteresis", 0),
    ("hysteresis", 2.0),
    ("hysteresis", True),
    ("hysteresis", MAX_HYSTERESIS + 1),
    ("hysteresis", -1),
    ("_hysteresis_tracker", -1),
    ("_hysteresis_tracker", 5),  # above the state's hysteresis=4
    ("_hysteresis_tracker", 2**31),
    ("_hysteresis_tracker", 1.0),
    ("skipped_steps", -1),
    ("skipped_steps", 1.5),
    ("skipped_steps", True),
    ("skipped_steps", INF),
    ("skipped_steps", 2**53 + 1),
    ("scale", True),
    ("scale", NAN),
    ("scale", -INF),
    ("scale", 10**400),
    ("scale", [65536.0]),
    ("growth_factor", True),
    ("growth_factor", NAN),
    ("growth_factor", INF),
    ("growth_factor", 10**400),
    ("growth_factor", -2.0),
    ("growth_factor", "2"),
    ("backoff_factor", True),
    ("backoff_factor", NAN),
    ("backoff_factor", -0.5),
    ("backoff_factor", 1.0),
    ("backoff_factor", 1 - 1e-12),  # the float32 scale would never move: every overflow skipped, no collapse
    ("backoff_factor", None),
    ("min_scale", NAN),
    ("min_scale", -1.0),
    ("min_scale", 0.0),
    ("min_scale", 2.0**-127),
    ("min_scale", True),
    ("min_scale", "1"),
    ("max_scale", INF),
    ("max_scale", NAN),
    ("max_scale", 1.0),  # below the state's min_scale=2
    ("max_scale", False),
    ("max_scale", 10**400),
]


@pytest.mark.parametrize(("key", "bad"), BAD_VALUES, ids=[f"{k}={v!r}"[:40] for k, v in BAD_VALUES])
def test_a_bad_value_is_refused_naming_the_key_and_nothing_changes(key, bad, caplog):
    scaler, opt, param = _trained_scaler()
    before = scaler.state_dict()
    report_before = scaler._report.known
    state = dict(_donor_state(), **{key: bad})
    with caplog.at_level(logging.WARNING, logger=loss_scaler.__name__):
        with pytest.raises(AmpPassError) as caught:
            scaler.load_state_dict(state)
    assert isinstance(caught.value, ScalerValueError)  # an InputError and a ValueError, as GradScaler raises
    message = str(caught.value)
    assert f"the state dict's {key}=" in message
    assert "Nothing was loaded" in message
    assert len(message) < 600
    assert scaler.state_dict() == before
    assert scaler._report.known == report_before
    assert not caplog.records  # no "loaded as" or "kept" warning for a load that did not happen
    _iteration(scaler, opt, param)  # and the scaler trains on as before
    assert scaler.skipped_steps == before["skipped_steps"]


def test_a_huge_value_is_shortened_in_the_message():
    scaler = LossScaler()
    before = scaler.state_dict()
    with pytest.raises(ScalerValueError) as caught:  # repr() of this int raises ValueError in Python >= 3.11
        scaler.load_state_dict(dict(before, growth_interval=10**5000))
    assert "the state dict's growth_interval=<int of 16610 bits> must be an int from 1 to 2**30" in str(caught.value)
    assert scaler.state_dict() == before


def test_the_reported_values_name_the_key_the_value_and_the_fix():
    expected = {
        "hysteresis": "hysteresis=2147483647 must be an int from 1 to 1000",
        "_growth_tracker": "_growth_tracker='abc' must be an int from 0 to 2**30",
        "skipped_steps": "skipped_steps=1180591620717411303424 must be an int from 0 to 2**53",
        "growth_interval": "growth_interval=1000000000000000000000000000000 must be an int from 1 to 2**30",
    }
    values = {"hysteresis": 2**31 - 1, "_growth_tracker": "abc", "skipped_steps": 2**70, "growth_interval": 10**30}
    for key, words in expected.items():
        with pytest.raises(ScalerValueError) as caught:
            LossScaler().load_state_dict(dict(LossScaler().state_dict(), **{key: values[key]}))
        assert words in str(caught.value)
        assert "torch.amp.GradScaler.state_dict() saved" in str(caught.value)  # the fix


def test_a_non_mapping_is_refused():
    with pytest.raises(ScalerValueError, match="takes the dict .* got list"):
        LossScaler().load_state_dict([("scale", 1.0)])


# ---------------------------------------------------------------- hysteresis cannot stall training


def test_a_hysteresis_of_2_31_cannot_stall_training_without_a_collapse_error():
    """Loaded as it was, 2**31-1 skipped every overflowing step at scale 65536 and never raised."""
    scaler = LossScaler()
    state = dict(scaler.state_dict(), hysteresis=2**31 - 1, _hysteresis_tracker=2**31 - 1)
    with pytest.raises(ScalerValueError, match="hysteresis=2147483647 must be an int from 1 to 1000"):
        scaler.load_state_dict(state)
    with pytest.raises(ScalerValueError, match="hysteresis=2147483647"):
        LossScaler(hysteresis=2**31 - 1)


def test_the_largest_hysteresis_still_reaches_scale_collapse_error():
    param = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = LossScaler()  # scale 2**16, min_scale 1
    scaler.load_state_dict(dict(scaler.state_dict(), hysteresis=MAX_HYSTERESIS, _hysteresis_tracker=MAX_HYSTERESIS))
    # the MAX_HYSTERESIS-th overflow backs off to 2**15, 15 more reach 1, the next one is due at min_scale
    steps = 0
    with pytest.raises(ScaleCollapseError):
        while steps < 2 * MAX_HYSTERESIS:
            steps += 1
            _iteration(scaler, opt, param, overflow=True)
    assert steps == MAX_HYSTERESIS + 15 + 1
    assert scaler.skipped_steps == steps


def test_constructor_and_setter_use_the_same_bounds():
    with pytest.raises(ScalerValueError, match="hysteresis=1001 must be an int from 1 to 1000"):
        LossScaler(hysteresis=MAX_HYSTERESIS + 1)
    with pytest.raises(ScalerValueError, match=r"growth_interval=2000.0 must be an int"):
        LossScaler(growth_interval=2000.0)
    scaler = LossScaler()
    with pytest.raises(ScalerValueError, match=r"growth_interval=1073741825 must be an int from 1 to 2\*\*30"):
        scaler.set_growth_interval(2**30 + 1)
    assert scaler.get_growth_interval() == 2000
    assert LossScaler(hysteresis=MAX_HYSTERESIS, growth_interval=2**30).state_dict()["growth_interval"] == 2**30


# ---------------------------------------------------------------- the built bounds


@pytest.mark.parametrize(
    ("key", "saved", "kept"),
    [
        ("min_scale", 2.0**-126, 1.0),
        ("min_scale", 0.5, 1.0),
        ("max_scale", 2.0**30, 2.0**24),
        ("max_scale", 3e38, 2.0**24),
    ],
)
def test_a_checkpoint_cannot_loosen_the_built_bounds(key, saved, kept, caplog):
    scaler = LossScaler()
    with caplog.at_level(logging.WARNING, logger=loss_scaler.__name__):
        scaler.load_state_dict(dict(scaler.state_dict(), **{key: saved}))
    assert scaler.state_dict()[key] == kept
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert f"the state dict's {key} {saved:.10g} lies" in message
    assert f"kept {kept:.10g}" in message
    assert f"LossScaler({key}={saved:.10g})" in message  # the fix
    built_so = LossScaler(**{key: saved})  # built with the checkpoint's bound, it loads without a word
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=loss_scaler.__name__):
        built_so.load_state_dict(dict(built_so.state_dict(), **{key: saved}))
    assert built_so.state_dict()[key] == saved
    assert not caplog.records


def test_a_loosened_floor_also_keeps_the_scale_within_the_built_bounds(caplog):
    saved = dict(LossScaler(init_scale=2.0**-20, min_scale=2.0**-126).state_dict())
    scaler = LossScaler()
    with caplog.at_level(logging.WARNING, logger=loss_scaler.__name__):
        scaler.load_state_dict(saved)
    assert (scaler.state_dict()["min_scale"], scaler.get_scale()) == (1.0, 1.0)
    assert [r.getMessage().split(" lies")[0] for r in caplog.records] == [
        "LossScaler.load_state_dict: the state dict's min_scale 1.175494351e-38",
        "LossScaler.load_state_dict: the state dict's scale 9.536743164e-07",
    ]


def test_tighter_bounds_load_and_are_judged_against_the_built_ones(caplog):
    scaler = LossScaler()
    with caplog.at_level(logging.WARNING, logger=loss_scaler.__name__):
        scaler.load_state_dict(_donor_state())  # min 2, max 2**20: inside the built [1, 2**24]
        assert (scaler.state_dict()["min_scale"], scaler.state_dict()["max_scale"]) == (2.0, 2.0**20)
        scaler.load_state_dict(LossScaler().state_dict())  # back to the built bounds: not a loosening
        assert (scaler.state_dict()["min_scale"], scaler.state_dict()["max_scale"]) == (1.0, 2.0**24)
    assert not caplog.records


def test_bounds_that_miss_the_built_ones_are_refused():
    scaler = LossScaler()
    before = scaler.state_dict()
    state = dict(before, min_scale=2.0**25, max_scale=2.0**30, scale=2.0**26)
    with pytest.raises(ScalerValueError, match=r"\[min_scale, max_scale\] = \[33554432, 1073741824\] lies wholly"):
        scaler.load_state_dict(state)
    assert scaler.state_dict() == before


# ---------------------------------------------------------------- what must keep loading


def test_a_trained_grad_scaler_state_loads_and_continues_identically():
    ref_param, ours_param = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    ref_opt, ours_opt = torch.optim.SGD([ref_param], lr=0.1), torch.optim.SGD([ours_param], lr=0.1)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4)
    for overflow in [False, True, False, False]:
        _iteration(ref, ref_opt, ref_param, overflow)
    saved = ref.state_dict()
    assert saved["_growth_tracker"] == 2
    ours = LossScaler()
    ours.load_state_dict(saved)
    ours_param.data.copy_(ref_param.data)
    for overflow in [False, False, True, False]:
        _iteration(ref, ref_opt, ref_param, overflow)
        _iteration(ours, ours_opt, ours_param, overflow)
        assert ours.get_scale() == ref.get_scale()
        assert ours.state_dict()["_growth_tracker"] == ref.state_dict()["_growth_tracker"]


def test_own_state_round_trips_into_a_scaler_built_the_same_way(caplog):
    scaler, _, _ = _trained_scaler()
    state = scaler.state_dict()
    restored = LossScaler(init_scale=2.0**10, growth_interval=5, hysteresis=2)
    with caplog.at_level(logging.WARNING, logger=loss_scaler.__name__):
        restored.load_state_dict(state)
    assert restored.state_dict() == state
    assert not caplog.records


def test_numpy_numbers_load_as_python_ones():
    np = pytest.importorskip("numpy")
    scaler = LossScaler()
    state = dict(scaler.state_dict(), scale=np.float32(256.0), growth_interval=np.int64(7), _growth_tracker=np.int32(3))
    scaler.load_state_dict(state)
    assert scaler.state_dict()["growth_interval"] == 7 and type(scaler.get_growth_interval()) is int
    assert (scaler.get_scale(), scaler.state_dict()["_growth_tracker"]) == (256.0, 3)
    with pytest.raises(ScalerValueError, match="growth_interval="):
        scaler.load_state_dict(dict(state, growth_interval=np.float64(7.0)))
