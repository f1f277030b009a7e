"""Dynamic loss scaling for fp16 training, with the API of ``torch.amp.GradScaler``.

fp16 gradients below 6e-8 flush to zero. Multiplying the loss by a large scale lifts them into fp16's range;
``unscale_`` divides the fp32 master gradients back before the optimizer sees them. The scale is dynamic:

1. A step whose gradients hold inf/NaN is skipped, so parameters and optimizer state stay untouched. Skipped
   steps are counted (``skipped_steps``, kept in ``state_dict``) and logged at INFO, at most once a minute.
2. Overflowing steps back the scale off by ``backoff_factor`` under the rule of Megatron-LM's
   ``DynamicGradScaler``: each overflow counts a tracker down from ``hysteresis``; once it reaches zero that
   overflow backs off, and so does every further one until a growth refills the tracker. Clean steps do not
   refill it, so overflows every other step back off too. ``hysteresis=1`` (the default) backs off on every
   overflow: GradScaler's rule.
3. After ``growth_interval`` clean steps in a row the scale grows by ``growth_factor`` and the hysteresis
   tracker is refilled.
4. The scale stays within ``[min_scale, max_scale]``. The defaults are 1, the floor of Megatron-LM
   (``--min-loss-scale``), MindSpore (``DynamicLossScaleUpdateCell``) and DeepSpeed (``min_loss_scale``), and
   2**24, Apex amp's ``max_loss_scale``. GradScaler has neither: 144 overflows in a row take its scale from
   2**16 to 2**-128, whose inverse is inf, and the next clean step writes inf into every parameter. A back-off
   that falls due with the scale already at ``min_scale`` raises :class:`~amppass.errors.ScaleCollapseError`
   instead (DeepSpeed raises there too): gradients that overflow at that scale will not stop overflowing.
5. Ranks agree on the overflow flag where their gradients can differ (sharded DTensor gradients, or an explicit
   ``process_group``), with one all-reduce per step; see :mod:`amppass.training.overflow`.

The scale and trackers are tensors on the loss's device and ``update()`` changes them with tensor ops, so the
only host synchronisation per step is the skip decision of an optimizer that cannot take the flag itself
(plus one read of the counters on a step it skips). Optimizers with ``_step_supports_amp_scaling`` (fused
Adam/AdamW/SGD/Adagrad) get the flag and the scale as tensors (``optimizer.found_inf``,
``optimizer.grad_scale``) and skip or unscale inside their kernel: no sync, and the counters are read at most
once a minute for the log.

bf16 has fp32's range and needs no scaling: ``LossScaler(dtype=torch.bfloat16)`` (or ``enabled=False``) is a
passthrough, so one training loop serves both dtypes.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..dtypes import low_type
from ..errors import ScaleCollapseError, ScalerUsageError, ScalerValueError
from .overflow import unscale_and_check
from .scaler_values import (
    LoadedState,
    ScalerBounds,
    bounds_kept,
    check_backoff_factor,
    check_bounds,
    check_growth_factor,
    check_growth_interval,
    check_hysteresis,
    check_scale,
    clamp_loaded_scale,
)

logger = logging.getLogger(__name__)

__all__ = ["LossScaler"]

REPORT_INTERVAL_S = 60.0  # at most one log line about skipped steps per this many seconds
WORLD = "world"  # process_group spelling of the default group, looked up at each step


class _LeftOut:
    """The default of ``process_group``, told apart from an explicit None (what group.WORLD is before init)."""

    def __repr__(self) -> str:
        return "<left out: sharded DTensors' meshes only>"


_PROCESS_GROUP_LEFT_OUT = _LeftOut()


def _clock() -> float:
    return time.monotonic()


def _distributed_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _is_world(group: Any) -> bool:
    return isinstance(group, str) and group == WORLD


def _is_process_group(group: Any) -> bool:
    return dist.is_available() and isinstance(group, dist.ProcessGroup)


class _Stage(enum.Enum):
    READY = "ready"  # gradients still carry the scale
    UNSCALED = "unscaled"  # unscale_() ran: gradients hold their true values
    STEPPED = "stepped"  # step() ran: waiting for update()


@dataclass
class _OptimizerState:
    """Where one optimizer is in the current iteration."""

    stage: _Stage = _Stage.READY
    found_inf: torch.Tensor | None = None  # float32 scalar on the scale's device: 1.0 if any rank saw inf/NaN
    skipped: bool | None = None  # the skip decision, when step() read it on the host (plain optimizers)


class LossScaler:
    """Scales the loss so fp16 gradients do not underflow, and skips steps whose gradients overflow.

    Drop-in for ``torch.amp.GradScaler``::

        scaler = amppass.LossScaler()
        for x, y in data:
            optimizer.zero_grad()
            scaler.scale(loss_fn(model(x), y)).backward()   # or scaler.backward(loss)
            scaler.unscale_(optimizer)                      # optional, e.g. to clip true gradients
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)                          # skipped if any gradient is inf/NaN
            scaler.update()

    With the defaults it follows GradScaler bit for bit while the scale stays within ``[min_scale, max_scale]``.
    Deliberate differences: the scale's bounds (module docstring, rule 4); the scale grows once the clean-step
    count reaches ``growth_interval``, where GradScaler needs it to equal it (so lowering the interval below
    the count with ``set_growth_interval`` stops GradScaler's growth until the next overflow); ``scale()`` takes
    tensors and nested lists/tuples of them, not other iterables; misuse raises amppass's errors, which are
    also the ``RuntimeError``/``ValueError`` GradScaler raises; where GradScaler asserts (a step or update
    before ``scale()``, an update before any step) they are a ``RuntimeError``, not an ``AssertionError``,
    since assertions vanish under ``python -O``.

    Args:
        init_scale: first scale factor.
        growth_factor: the scale is multiplied by this (> 1) after ``growth_interval`` clean steps in a row.
        backoff_factor: the scale is multiplied by this (above 0, at most 0.99) on an
            overflow that backs off.
        growth_interval: clean steps in a row before the scale grows; an int from 1 to 2**30 (``MAX_GROWTH_INTERVAL``).
        hysteresis: overflows before the scale backs off, counted as Megatron-LM's DynamicGradScaler counts
            them (module docstring, rule 2); every overflowing step is skipped either way. 1 = GradScaler. An
            int from 1 to 1000 (``MAX_HYSTERESIS``; Megatron-LM and DeepSpeed default to 2): overflows that will
            not stop still reach ScaleCollapseError, after at most that many skipped steps plus the back-offs
            down to ``min_scale``.
        enabled: False makes the scaler a passthrough.
        dtype: the low-precision dtype of the training graph: torch.float16 / "fp16" scales;
            torch.bfloat16 / "bf16" needs no scaling, so the scaler is a passthrough.
        process_group: left out (default), the overflow flag is all-reduced only where the gradients are
            sharded DTensors (FSDP2, tensor parallel), over their mesh; plain and DDP gradients need no
            collective, so a scaler used on one rank never waits for the others. A group all-reduces the flag
            over it every step, for sharding that DTensors do not describe; every rank of the group must then
            call ``step``. ``"world"`` is the default group, looked up at each step, so it can be given before
            ``init_process_group``. ``torch.distributed.group.WORLD`` is None until ``init_process_group``
            runs: a scaler built before then with ``process_group=None`` raises ScalerUsageError at its first
            step once a process group exists, naming ``"world"`` as the fix, instead of dropping the all-reduce.
        min_scale: the scale never backs off below this (default 1); a back-off due at it raises
            ScaleCollapseError. At least 2**-126, so that the inverse scale stays finite.
        max_scale: the scale never grows above this (default 2**24, Apex amp's); at most float32's largest.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        enabled: bool = True,
        dtype: torch.dtype | str = torch.float16,
        process_group: Any = _PROCESS_GROUP_LEFT_OUT,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
    ) -> None:
        check_bounds(min_scale, max_scale)
        check_scale("init_scale", init_scale, min_scale, max_scale)
        check_growth_factor(growth_factor)
        check_backoff_factor(backoff_factor)
        check_growth_interval(growth_interval)
        check_hysteresis(hysteresis)
        if not isinstance(enabled, bool):
            raise ScalerValueError(f"enabled={enabled!r} must be True or False")
        # torch.distributed.group.WORLD is None before init_process_group: an explicit None then may mean it.
        self._none_before_init = process_group is None and not _distributed_initialized()
        if process_group is _PROCESS_GROUP_LEFT_OUT:
            process_group = None
        if not (process_group is None or _is_world(process_group) or _is_process_group(process_group)):
            raise ScalerValueError(
                f"process_group={process_group!r} is not a torch.distributed process group; pass one, or "
                f"{WORLD!r} for the default group (looked up at each step, so it may be given before "
                "init_process_group), or leave it out to agree only where the gradients are sharded DTensors"
            )
        if isinstance(dtype, str) and dtype.strip().lower() == "auto":
            raise ScalerValueError(
                "LossScaler(dtype='auto') cannot know which dtype the model trains in; pass the dtype the "
                "model was converted with: torch.float16 / 'fp16' (scaled) or torch.bfloat16 / 'bf16' (passthrough)"
            )
        self._dtype = low_type(dtype).torch
        self._enabled = enabled and self._dtype == torch.float16
        if not self._enabled:
            why = "enabled=False" if not enabled else "bf16 has fp32's range, so its gradients do not underflow"
            logger.info(
                "LossScaler is a passthrough (%s): scale() returns the loss unchanged and step() calls "
                "optimizer.step()",
                why,
            )

        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._hysteresis = int(hysteresis)
        self._min_scale = float(min_scale)
        self._max_scale = float(max_scale)
        # The bounds as built: no checkpoint may loosen them (load_state_dict).
        self._built_bounds = (self._min_scale, self._max_scale)
        self._process_group = process_group
        # Created on the CPU; the first scale() moves them to the loss's device, where update() keeps them.
        self._scale = torch.tensor(float(init_scale), dtype=torch.float32)
        self._growth_tracker = torch.tensor(0, dtype=torch.int32)  # clean steps in a row
        self._hysteresis_tracker = torch.tensor(self._hysteresis, dtype=torch.int32)  # overflows left before backoff
        self._skipped = torch.tensor(0, dtype=torch.int64)  # steps skipped since the start
        self._collapsed = torch.tensor(False)  # a back-off fell due at min_scale since the last read
        self._placed = False  # whether scale() has run, i.e. the gradients can carry the scale
        self._per_optimizer: dict[int, _OptimizerState] = defaultdict(_OptimizerState)
        self._report = _SkipReport()

    # ------------------------------------------------------------------ the training-loop API

    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor, or nested lists/tuples of tensors, by the current scale.

        Returns ``outputs`` unchanged when the scaler is a passthrough.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if not self._placed:
                self._place_state(outputs.device)
            return outputs * self._scale.to(outputs.device, non_blocking=True)
        if isinstance(outputs, (list, tuple)):
            scaled = [self.scale(item) for item in outputs]
            if isinstance(outputs, tuple) and hasattr(outputs, "_fields"):  # namedtuple
                return type(outputs)(*scaled)
            return type(outputs)(scaled)
        raise ScalerValueError(
            f"scale() takes a tensor or (nested) lists/tuples of tensors, got {type(outputs).__name__}; "
            "pass the loss tensor"
        )

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``scale(loss).backward(**kwargs)``."""
        self.scale(loss).backward(**kwargs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place and check them for inf/NaN.

        Optional: call it between backward and :meth:`step` to inspect or clip the true gradients. At most
        once per optimizer per iteration, after all backward passes; :meth:`step` unscales otherwise.
        """
        if not self._enabled:
            return
        self._require_scaled("unscale_")
        state = self._per_optimizer[id(optimizer)]
        if state.stage is _Stage.UNSCALED:
            raise ScalerUsageError(
                "unscale_(optimizer) was already called for this optimizer since the last update(); call it "
                "once per iteration, after all backward passes and before scaler.step(optimizer)"
            )
        if state.stage is _Stage.STEPPED:
            raise ScalerUsageError(
                "unscale_(optimizer) was called after scaler.step(optimizer); call unscale_ before step, "
                "or call scaler.update() first to start the next iteration"
            )
        # The reciprocal in float64: a float32 one can be off by an ulp under some compiler flags.
        inv_scale = self._scale.double().reciprocal().float()
        state.found_inf = unscale_and_check(
            optimizer, inv_scale, allow_fp16=False, process_group=self._agreement_group()
        )
        state.stage = _Stage.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` ran) and call ``optimizer.step(*args, **kwargs)`` if no rank saw inf/NaN.

        Returns what ``optimizer.step`` returns, or None for a skipped step of a plain optimizer.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise ScalerUsageError(
                "scaler.step(optimizer, closure=...) is not supported: the closure's backward would not be "
                "scaled; run the forward and scaler.scale(loss).backward() before scaler.step(optimizer)"
            )
        self._require_scaled("step")
        state = self._per_optimizer[id(optimizer)]
        if state.stage is _Stage.STEPPED:
            raise ScalerUsageError(
                "scaler.step(optimizer) was already called for this optimizer since the last update(); "
                "call scaler.update() once at the end of each iteration"
            )
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            result = self._step_in_kernel(optimizer, state, args, kwargs)
        else:
            if state.stage is _Stage.READY:
                self.unscale_(optimizer)
            assert state.found_inf is not None  # unscale_ sets it
            # The one host sync per step: a plain optimizer cannot take the skip decision as a tensor.
            state.skipped = state.found_inf.item() != 0
            result = None if state.skipped else optimizer.step(*args, **kwargs)
        state.stage = _Stage.STEPPED
        return result

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back off, grow or keep the scale from this iteration's overflow flags; call once per iteration.

        ``new_scale`` sets the scale instead (the trackers are kept), as GradScaler's ``update`` does; it must
        lie within ``[min_scale, max_scale]``. Raises ScaleCollapseError when a back-off fell due with the scale
        at ``min_scale`` (for fused optimizers, at the next read of the counters, at most a minute later).
        """
        if not self._enabled:
            return
        self._require_scaled("update")
        states = list(self._per_optimizer.values())
        flags = [s.found_inf for s in states if s.found_inf is not None]
        if new_scale is not None:
            value = float(new_scale)
            check_scale("update(new_scale)", value, self._min_scale, self._max_scale)
            self._scale.fill_(value)
        elif not flags:
            raise ScalerUsageError(
                "scaler.update() was called before scaler.step(optimizer) in this iteration; call "
                "scaler.scale(loss).backward(), then scaler.step(optimizer), then scaler.update()"
            )
        if flags:
            found_inf = flags[0]
            for flag in flags[1:]:
                found_inf = torch.maximum(found_inf, flag)
            self._skipped += (found_inf > 0).to(self._skipped.dtype)
            if new_scale is None:
                self._update_scale(found_inf)
        self._per_optimizer.clear()
        decisions = [s.skipped for s in states if s.found_inf is not None]
        self._read_counters_if_due(decisions)

    def get_scale(self) -> float:
        """The current scale as a float (1.0 for a passthrough scaler). Synchronises with the device."""
        return float(self._scale.item()) if self._enabled else 1.0

    def get_growth_factor(self) -> float:
        """The factor the scale grows by after ``growth_interval`` clean steps."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (> 1) for the following updates."""
        check_growth_factor(new_factor)
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        """The factor the scale is multiplied by on an overflow that backs off."""
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (above 0, at most 0.99) for the following updates."""
        check_backoff_factor(new_factor)
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        """Clean steps in a row before the scale grows."""
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (an int from 1 to 2**30); a clean-step count already at or past it grows next
        step."""
        check_growth_interval(new_interval)
        self._growth_interval = int(new_interval)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped since the start (0 for a passthrough scaler). Synchronises with the device."""
        return int(self._skipped.item()) if self._enabled else 0

    def is_enabled(self) -> bool:
        """Whether the scaler scales; False for bf16 or ``enabled=False``."""
        return self._enabled

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state for a checkpoint; {} for a passthrough scaler.

        Keys: ``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``_growth_tracker`` (the
        names GradScaler uses, so checkpoints move between the two), ``hysteresis``, ``_hysteresis_tracker``,
        ``min_scale``, ``max_scale``, ``skipped_steps``. Call it after :meth:`update`.
        """
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": int(self._growth_tracker.item()),
            "hysteresis": self._hysteresis,
            "_hysteresis_tracker": int(self._hysteresis_tracker.item()),
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, also one from ``torch.amp.GradScaler`` or an older amppass; no-op for
        a passthrough. Keys a dict lacks keep this scaler's settings (``skipped_steps`` restarts at 0).

        A checkpoint may come from anywhere, so the whole dict is checked before anything is assigned: a value
        of the wrong type (a bool, a float where an int belongs, a string), inf, NaN, negative, or beyond its
        bound (``hysteresis`` 1 to 1000, ``growth_interval`` 1 to 2**30, ``_growth_tracker`` 0 to 2**30,
        ``_hysteresis_tracker`` 0 to ``hysteresis``, ``skipped_steps`` 0 to 2**53; see :class:`LossScaler`)
        raises ScalerValueError naming the key and leaves the scaler as it was.

        The bounds the scaler was built with are a floor and a ceiling no checkpoint moves outward: a saved
        ``min_scale`` below them or ``max_scale`` above them is not loaded (the built bound is kept, with a
        warning in the log; build the scaler with the checkpoint's bounds to keep them), while bounds as tight
        or tighter are loaded. Bounds that do not overlap the built ones at all raise ScalerValueError. A
        scale outside the resulting ``[min_scale, max_scale]`` (GradScaler's has no bounds: after a long clean
        run it sits above the default 2**24) is loaded clamped into them, with a warning in the log; an inf,
        NaN or non-positive scale raises ScalerValueError.
        """
        if not self._enabled:
            return
        if not isinstance(state_dict, Mapping):
            raise ScalerValueError(
                f"load_state_dict() takes the dict that LossScaler.state_dict() or torch.amp.GradScaler.state_dict() "
                f"returns, got {type(state_dict).__name__}; pass checkpoint['scaler'], not the whole checkpoint object"
            )
        if not state_dict:
            raise ScalerUsageError(
                "load_state_dict() got an empty state dict, which a disabled or bf16 scaler saves; load it into "
                "a scaler built the same way, or start this fp16 scaler fresh without it"
            )
        required = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
        missing = [key for key in required if key not in state_dict]
        if missing:
            raise ScalerValueError(
                f"load_state_dict() is missing {missing}; pass the dict from LossScaler.state_dict() "
                "or torch.amp.GradScaler.state_dict()"
            )
        try:
            current = ScalerBounds(self._min_scale, self._max_scale, self._built_bounds, self._hysteresis)
            loaded = LoadedState.check(state_dict, current)
        except ScalerValueError as err:
            raise ScalerValueError(
                f"load_state_dict(): {err}. Nothing was loaded; pass the dict that LossScaler.state_dict() or "
                "torch.amp.GradScaler.state_dict() saved, or leave an optional key out to keep this scaler's "
                "own setting"
            ) from None
        # Nothing below raises: the scaler changes whole or not at all.
        min_scale, max_scale = bounds_kept(loaded.min_scale, loaded.max_scale, self._built_bounds)
        scale = clamp_loaded_scale(loaded.scale, min_scale, max_scale)
        self._growth_factor = loaded.growth_factor
        self._backoff_factor = loaded.backoff_factor
        self._growth_interval = loaded.growth_interval
        self._hysteresis = loaded.hysteresis
        self._min_scale, self._max_scale = min_scale, max_scale
        self._scale.fill_(scale)
        self._growth_tracker.fill_(loaded.growth_tracker)
        self._hysteresis_tracker.fill_(loaded.hysteresis_tracker)
        self._skipped.fill_(loaded.skipped_steps)
        self._report = _SkipReport(known=loaded.skipped_steps)

    # ------------------------------------------------------------------ internals

    def _place_state(self, device: torch.device) -> None:
        for name in ("_scale", "_growth_tracker", "_hysteresis_tracker", "_skipped", "_collapsed"):
            setattr(self, name, getattr(self, name).to(device))
        self._placed = True

    def _require_scaled(self, method: str) -> None:
        if not self._placed:
            raise ScalerUsageError(
                f"scaler.{method}() was called before scaler.scale(); call scaler.scale(loss).backward() "
                "first so the gradients carry the scale"
            )

    def _agreement_group(self) -> Any:
        """The group this step's overflow flag is all-reduced over; None: only sharded DTensors' meshes."""
        if _is_world(self._process_group):
            if not _distributed_initialized():
                raise ScalerUsageError(
                    f"LossScaler(process_group={WORLD!r}) all-reduces over the default process group, but "
                    "torch.distributed is not initialized in this process; call "
                    "torch.distributed.init_process_group before the first scaler.step, or leave process_group out"
                )
            return dist.group.WORLD
        if self._none_before_init and _distributed_initialized():
            raise ScalerUsageError(
                "LossScaler(process_group=None) was built before torch.distributed.init_process_group, and a "
                "process group exists now. torch.distributed.group.WORLD is None until init_process_group, so "
                "a scaler given it then cannot all-reduce over it; pass process_group='world' (the default "
                "group, looked up at each step) or build the scaler after init_process_group. Leave "
                "process_group out to agree only where the gradients are sharded DTensors"
            )
        return self._process_group

    def _step_in_kernel(
        self, optimizer: torch.optim.Optimizer, state: _OptimizerState, args: tuple, kwargs: dict
    ) -> Any:
        """Hand the overflow flag and the scale to an optimizer that skips and unscales inside its kernel."""
        if state.stage is _Stage.READY:
            # Only look for inf/NaN (dividing by 1): the fused kernel divides by grad_scale itself.
            state.found_inf = unscale_and_check(
                optimizer, torch.ones_like(self._scale), allow_fp16=True, process_group=self._agreement_group()
            )
            grad_scale = self._scale
        else:
            grad_scale = None  # unscale_() already divided the gradients
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = state.found_inf  # type: ignore[attr-defined]
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]

    def _update_scale(self, found_inf: torch.Tensor) -> None:
        """Apply the backoff/growth rules (module docstring, rules 2-4) with tensor ops, so no host sync."""
        overflow = found_inf > 0
        hysteresis_left = torch.where(overflow, (self._hysteresis_tracker - 1).clamp(min=0), self._hysteresis_tracker)
        back_off = overflow & (hysteresis_left == 0)
        clean_steps = torch.where(overflow, 0, self._growth_tracker + 1)
        grow = clean_steps >= self._growth_interval  # never on an overflow: clean_steps is 0 there
        # float64 products rounded once to float32, as GradScaler's kernel computes them
        scale = self._scale.double()
        new_scale = torch.where(
            back_off,
            (scale * self._backoff_factor).clamp(min=self._min_scale),
            torch.where(grow, (scale * self._growth_factor).clamp(max=self._max_scale), scale),
        )
        self._collapsed |= back_off & (self._scale <= self._min_scale)
        self._scale.copy_(new_scale)
        self._growth_tracker.copy_(torch.where(grow, 0, clean_steps))
        self._hysteresis_tracker.copy_(torch.where(grow, self._hysteresis, hysteresis_left))

    def _read_counters_if_due(self, decisions: list[bool | None]) -> None:
        """Read the counters on the host when a step was skipped on the host's decision, or (for decisions
        taken on the device) once a report interval has passed; raise on a collapse, log skipped steps."""
        if all(decision is not None for decision in decisions):
            due = any(decisions)  # the host already waited for this step's flag: one more read costs nothing
        else:
            due = self._report.read_due()
        if due:
            skipped, collapsed, scale = torch.stack(
                (self._skipped.double(), self._collapsed.double(), self._scale.double())
            ).tolist()
            self._report.read(int(skipped), scale)
            if collapsed:
                self._collapsed.fill_(False)
                raise ScaleCollapseError(
                    f"the gradients overflowed (inf/NaN) with the loss scale already at min_scale="
                    f"{self._min_scale:g}, so it cannot back off further ({int(skipped)} steps skipped so far). "
                    "The loss or the gradients are inf/NaN without scaling: check the data and the loss for "
                    "inf/NaN, lower the learning rate, keep the overflowing ops in fp32 (amppass.convert(..., "
                    "keep_fp32=[...])) or train in bf16; lower min_scale only if a scale below it still helps"
                )
        self._report.log_if_due(self._min_scale)


class _SkipReport:
    """What the host knows of skipped steps, and when it last said so (one INFO line per REPORT_INTERVAL_S)."""

    def __init__(self, known: int = 0) -> None:
        self.known = known  # skipped steps as of the last read
        self.reported = known  # skipped steps the log has told of
        self.scale = math.nan  # the scale as of the last read
        self.last_read = _clock()
        self.last_line: float | None = None  # None: the first skipped step is logged at once

    def pending(self) -> bool:
        return self.known > self.reported

    def read_due(self) -> bool:
        return _clock() - self.last_read >= REPORT_INTERVAL_S

    def read(self, skipped: int, scale: float) -> None:
        self.known, self.scale, self.last_read = skipped, scale, _clock()

    def log_if_due(self, min_scale: float) -> None:
        now = _clock()
        if not self.pending() or (self.last_line is not None and now - self.last_line < REPORT_INTERVAL_S):
            return
        since = "" if self.last_line is None else f" in the last {now - self.last_line:.0f} s"
        logger.info(
            "LossScaler%s skipped %d optimizer step(s)%s because gradients held inf/NaN (%d in all); loss scale "
            "after the last: %g",
            _on_rank(),
            self.known - self.reported,
            since,
            self.known,
            self.scale,
        )
        if self.scale <= min_scale:
            logger.warning(
                "LossScaler's loss scale is at its minimum, min_scale=%g: one more back-off raises "
                "ScaleCollapseError",
                min_scale,
            )
        self.reported, self.last_line = self.known, now


def _on_rank() -> str:
    """`` on rank 1 of 2`` in a process group of several ranks, so their log lines can be told apart."""
    if not _distributed_initialized() or dist.get_world_size() < 2:
        return ""
    return f" on rank {dist.get_rank()} of {dist.get_world_size()}"
