"""The values a :class:`~amppass.training.loss_scaler.LossScaler` takes, checked: its constructor's, its setters' and
a checkpoint's (``load_state_dict``).

A checkpoint is read as untrusted input: every value is checked, whole, before any is assigned, and each refusal is
a :class:`~amppass.errors.ScalerValueError` naming the key, the value (shortened) and the fix. Bounds:

- ``hysteresis`` at most :data:`MAX_HYSTERESIS`, so a run that keeps overflowing still reaches
  :class:`~amppass.errors.ScaleCollapseError`; ``backoff_factor`` at most :data:`MAX_BACKOFF`, so a back-off moves
  the float32 scale at all;
- ``growth_interval`` and the growth tracker at most :data:`MAX_GROWTH_INTERVAL` (the int32 tracker never wraps);
  the skipped-step count at most :data:`MAX_SKIPPED_STEPS` (read back exactly through a float64);
- a checkpoint's ``min_scale``/``max_scale`` looser than the bounds the scaler was built with are not loaded: the
  built ones stay, with a warning; bounds that do not overlap the built ones are refused.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

import torch

from ..errors import ScalerValueError

logger = logging.getLogger(__name__)

_FP32_MAX = torch.finfo(torch.float32).max
_FP32_TINY = torch.finfo(torch.float32).tiny  # 2**-126: the smallest scale whose inverse is finite and exact
# Integer settings and counters, bounded so that the int32/int64 tensors hold them and the scale keeps moving.
MAX_HYSTERESIS = 1000  # overflows in a row that may pass before the first back-off (Megatron-LM's default is 2)
MAX_GROWTH_INTERVAL = 2**30  # the int32 clean-step tracker counts up to it, one step past it at most
# a back-off closer to 1 barely moves the scale (past 1 - 2**-24 the float32 scale does not move at all): overflowing
# steps would be skipped for ever without reaching ScaleCollapseError. At 0.99 the scale falls 2**10 in 690 steps
MAX_BACKOFF = 0.99
MAX_SKIPPED_STEPS = 2**53  # the skipped-step counter is read back through a float64, exact up to here



def _shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` for a message, cut at ``limit`` characters: a checkpoint's value may be huge or hostile
    (an int of millions of digits has no repr at all in Python >= 3.11, and a repr may raise)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<{'negative ' if value < 0 else ''}int of {value.bit_length()} bits>"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - any object may sit in a checkpoint
        text = f"<{type(value).__name__} without a repr>"
    return text if len(text) <= limit else text[:limit] + " ..."


def _bound(value: int) -> str:
    """An int bound as a message writes it: 2**30 rather than 1073741824."""
    return f"2**{value.bit_length() - 1}" if value >= 2**16 and value & (value - 1) == 0 else str(value)


def _is_number(value: Any) -> bool:
    if not isinstance(value, Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def check_bounds(min_scale: Any, max_scale: Any, where: str = "") -> None:
    """Raise ScalerValueError unless ``min_scale`` and ``max_scale`` are finite bounds within float32's normals."""
    if not (_is_number(min_scale) and min_scale >= _FP32_TINY):
        raise ScalerValueError(
            f"{where}min_scale={_shown(min_scale)} must be a number >= 2**-126 (float32's smallest normal, so that "
            "1/scale stays finite), e.g. 1.0"
        )
    if not (_is_number(max_scale) and min_scale <= max_scale <= _FP32_MAX):
        raise ScalerValueError(
            f"{where}max_scale={_shown(max_scale)} must be a number between min_scale={_shown(min_scale)} and "
            "float32's largest (3.4e38), e.g. 2.**24"
        )


def _check_overlap(min_scale: float, max_scale: float, built: tuple[float, float]) -> None:
    """A checkpoint's bounds must share at least one scale with the ones the scaler was built with."""
    if min_scale > built[1] or max_scale < built[0]:
        raise ScalerValueError(
            f"the state dict's [min_scale, max_scale] = [{min_scale:.10g}, {max_scale:.10g}] lies wholly outside "
            f"the [{built[0]:.10g}, {built[1]:.10g}] this scaler was built with, which a checkpoint may narrow but "
            "not move; build the scaler with LossScaler(min_scale=..., max_scale=...) "
            "that cover the checkpoint's bounds"
        )


def bounds_kept(min_scale: float, max_scale: float, built: tuple[float, float]) -> tuple[float, float]:
    """A checkpoint's (checked, overlapping) bounds, never looser than the built ones, saying when it kept those."""
    kept = (max(min_scale, built[0]), min(max_scale, built[1]))
    for key, saved, value, side in (
        ("min_scale", min_scale, kept[0], "below"),
        ("max_scale", max_scale, kept[1], "above"),
    ):
        if saved != value:
            logger.warning(
                "LossScaler.load_state_dict: the state dict's %s %.10g lies %s the %s=%.10g this scaler was built "
                "with, and a checkpoint may not loosen the scale's bounds; kept %.10g. Build the scaler with "
                "LossScaler(%s=%.10g) to load it",
                key,
                saved,
                side,
                key,
                value,
                value,
                key,
                saved,
            )
    return kept


def _check_positive_scale(name: str, value: Any) -> None:
    if not (_is_number(value) and value > 0):
        raise ScalerValueError(
            f"{name}={_shown(value)} must be a positive finite number such as 2.**16 (LossScaler takes its device "
            "from the loss, so drop the device argument a torch.amp.GradScaler call may have)"
        )


def clamp_loaded_scale(value: float, min_scale: float, max_scale: float) -> float:
    """A checkpoint's (checked) scale, clamped into the bounds (GradScaler's own scale is unbounded), saying so."""
    clamped = min(max(value, min_scale), max_scale)
    if clamped != value:
        logger.warning(
            "LossScaler.load_state_dict: the state dict's scale %.10g lies outside [min_scale, max_scale] = "
            "[%.10g, %.10g] (a torch.amp.GradScaler scale is unbounded); loaded as %.10g. Widen the bounds with "
            "LossScaler(min_scale=..., max_scale=...) to keep it",
            value,
            min_scale,
            max_scale,
            clamped,
        )
    return clamped


def check_scale(name: str, value: Any, min_scale: float, max_scale: float) -> None:
    """Raise ScalerValueError unless ``value`` is a positive finite scale within the bounds."""
    _check_positive_scale(name, value)
    if not min_scale <= value <= max_scale:
        raise ScalerValueError(
            f"{name}={_shown(value)} lies outside [min_scale, max_scale] = [{min_scale:.10g}, {max_scale:.10g}]; "
            "pass a scale within them, or widen them with LossScaler(min_scale=..., max_scale=...)"
        )


def check_growth_factor(value: Any, where: str = "") -> None:
    """Raise ScalerValueError unless ``value`` is a finite number above 1."""
    if not (_is_number(value) and value > 1):
        raise ScalerValueError(f"{where}growth_factor={_shown(value)} must be a finite number > 1, e.g. 2.0")


def check_backoff_factor(value: Any, where: str = "") -> None:
    """Raise ScalerValueError unless ``value`` is in (0, MAX_BACKOFF]."""
    if not (_is_number(value) and 0 < value <= MAX_BACKOFF):
        raise ScalerValueError(f"{where}backoff_factor={_shown(value)} must be a number above 0 and at most "
                               f"{MAX_BACKOFF}, e.g. 0.5 (closer to 1 the scale barely backs off, and overflowing "
                               "steps are skipped without end)")


def _check_int(name: str, value: Any, low: int, high: int, note: str) -> None:
    """An int (not a bool, not a float that happens to be whole) from ``low`` to ``high``."""
    if not (isinstance(value, Integral) and not isinstance(value, bool) and low <= int(value) <= high):
        raise ScalerValueError(f"{name}={_shown(value)} must be an int from {low} to {_bound(high)} ({note})")


def check_growth_interval(value: Any, where: str = "") -> None:
    """Raise ScalerValueError unless ``value`` is an int from 1 to MAX_GROWTH_INTERVAL."""
    _check_int(f"{where}growth_interval", value, 1, MAX_GROWTH_INTERVAL, "clean steps before a growth, e.g. 2000")


def check_hysteresis(value: Any, where: str = "") -> None:
    """Raise ScalerValueError unless ``value`` is an int from 1 to MAX_HYSTERESIS."""
    _check_int(
        f"{where}hysteresis",
        value,
        1,
        MAX_HYSTERESIS,
        "overflows tolerated before a back-off: 1 is GradScaler's rule, 2 Megatron-LM's default",
    )


@dataclass(frozen=True)
class ScalerBounds:
    """What a loaded state dict is checked against: the scaler's bounds now, the bounds it was built with, and its
    hysteresis (a state dict without one keeps it)."""

    min_scale: float
    max_scale: float
    built: tuple[float, float]
    hysteresis: int


@dataclass(frozen=True)
class LoadedState:
    """A state dict's values, each checked, in the types the scaler keeps; built whole before any is assigned."""

    scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    growth_tracker: int
    hysteresis: int
    hysteresis_tracker: int
    min_scale: float
    max_scale: float
    skipped_steps: int

    @classmethod
    def check(cls, state_dict: Mapping[str, Any], current: ScalerBounds) -> LoadedState:
        """Raise ScalerValueError naming the first key whose value a scaler now at ``current`` cannot use."""
        where = "the state dict's "
        min_scale = state_dict.get("min_scale", current.min_scale)
        max_scale = state_dict.get("max_scale", current.max_scale)
        check_bounds(min_scale, max_scale, where)
        _check_overlap(float(min_scale), float(max_scale), current.built)
        _check_positive_scale(f"{where}scale", state_dict["scale"])
        check_growth_factor(state_dict["growth_factor"], where)
        check_backoff_factor(state_dict["backoff_factor"], where)
        check_growth_interval(state_dict["growth_interval"], where)
        _check_int(
            f"{where}_growth_tracker",
            state_dict["_growth_tracker"],
            0,
            MAX_GROWTH_INTERVAL,
            "clean steps in a row since the last overflow or growth",
        )
        hysteresis = state_dict.get("hysteresis", current.hysteresis)
        check_hysteresis(hysteresis, where)
        hysteresis_tracker = state_dict.get("_hysteresis_tracker", hysteresis)
        _check_int(
            f"{where}_hysteresis_tracker",
            hysteresis_tracker,
            0,
            int(hysteresis),
            "overflows left before a back-off, at most the hysteresis",
        )
        skipped_steps = state_dict.get("skipped_steps", 0)
        _check_int(f"{where}skipped_steps", skipped_steps, 0, MAX_SKIPPED_STEPS, "optimizer steps skipped so far")
        return cls(
            scale=float(state_dict["scale"]),
            growth_factor=float(state_dict["growth_factor"]),
            backoff_factor=float(state_dict["backoff_factor"]),
            growth_interval=int(state_dict["growth_interval"]),
            growth_tracker=int(state_dict["_growth_tracker"]),
            hysteresis=int(hysteresis),
            hysteresis_tracker=int(hysteresis_tracker),
            min_scale=float(min_scale),
            max_scale=float(max_scale),
            skipped_steps=int(skipped_steps),
        )
