"""Dynamic loss scaling for fp16 training, with the API of ``torch.amp.GradScaler``.

fp16 gradients below 6e-8 flush to zero. Multiplying the loss by a large scale lifts them into fp16's range;
``unscale_`` divides the fp32 master gradients back before the optimizer sees them. The scale is dynamic:

1. A step whose gradients hold inf/NaN is skipped, so parameters and optimizer state stay untouched.
2. An overflowing step backs the scale off by ``backoff_factor`` once ``hysteresis`` consecutive steps have
   overflowed (``hysteresis=1``, the default, is GradScaler's behaviour: every overflow backs off).
3. After ``growth_interval`` consecutive clean steps the scale grows by ``growth_factor``.
4. Under torch.distributed the found-inf flag is all-reduced (MAX), so every rank skips the same steps even
   when gradients are sharded or only one rank overflowed.

The scale and trackers are tensors on the loss's device and ``update()`` changes them with tensor ops, so the
only host synchronisation per step is the skip decision of an optimizer that cannot take the flag itself.
Optimizers with ``_step_supports_amp_scaling`` (fused Adam/AdamW/SGD/Adagrad) get the flag and the scale as
tensors (``optimizer.found_inf``, ``optimizer.grad_scale``) and skip or unscale inside their kernel: no sync.

bf16 has fp32's range and needs no scaling: ``LossScaler(dtype=torch.bfloat16)`` (or ``enabled=False``) is a
passthrough, so one training loop serves both dtypes.
"""

from __future__ import annotations

import enum
import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from numbers import Real
from typing import Any

import torch
import torch.distributed as dist

from ..dtypes import low_type
from ..errors import AmpPassError, InputError

logger = logging.getLogger(__name__)

__all__ = ["LossScaler"]


class _Stage(enum.Enum):
    READY = "ready"  # gradients still carry the scale
    UNSCALED = "unscaled"  # unscale_() ran: gradients hold their true values
    STEPPED = "stepped"  # step() ran: waiting for update()


@dataclass
class _OptimizerState:
    """Where one optimizer is in the current iteration."""

    stage: _Stage = _Stage.READY
    found_inf: torch.Tensor | None = None  # float32 scalar on the scale's device: 1.0 if any rank saw inf/NaN


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

    Args:
        init_scale: first scale factor.
        growth_factor: the scale is multiplied by this (> 1) after ``growth_interval`` clean steps in a row.
        backoff_factor: the scale is multiplied by this (between 0 and 1) on an overflow that backs off.
        growth_interval: clean steps in a row before the scale grows.
        hysteresis: overflowing steps in a row before the scale backs off (as in Megatron-LM and DeepSpeed);
            a clean step resets the count. Every overflowing step is skipped either way. 1 = GradScaler.
        enabled: False makes the scaler a passthrough.
        dtype: the low-precision dtype of the training graph: torch.float16 / "fp16" scales;
            torch.bfloat16 / "bf16" needs no scaling, so the scaler is a passthrough.
        process_group: group over which to agree on skipped steps; None uses the default group whenever
            torch.distributed is initialized.
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
        process_group: Any = None,
    ) -> None:
        _check_settings(init_scale, growth_factor, backoff_factor, growth_interval, hysteresis)
        if not isinstance(enabled, bool):
            raise InputError(f"enabled={enabled!r} must be True or False")
        if isinstance(dtype, str) and dtype.strip().lower() == "auto":
            raise InputError(
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
        self._growth_interval = growth_interval
        self._hysteresis = hysteresis
        self._process_group = process_group
        # Created on the CPU; the first scale() moves them to the loss's device, where update() keeps them.
        self._scale = torch.tensor(float(init_scale), dtype=torch.float32)
        self._growth_tracker = torch.tensor(0, dtype=torch.int32)  # clean steps in a row
        self._hysteresis_tracker = torch.tensor(hysteresis, dtype=torch.int32)  # overflows left before backoff
        self._placed = False  # whether scale() has run, i.e. the gradients can carry the scale
        self._per_optimizer: dict[int, _OptimizerState] = defaultdict(_OptimizerState)

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
        raise AmpPassError(
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
            raise AmpPassError(
                "unscale_(optimizer) was already called for this optimizer since the last update(); call it "
                "once per iteration, after all backward passes and before scaler.step(optimizer)"
            )
        if state.stage is _Stage.STEPPED:
            raise AmpPassError(
                "unscale_(optimizer) was called after scaler.step(optimizer); call unscale_ before step, "
                "or call scaler.update() first to start the next iteration"
            )
        # The reciprocal in float64: a float32 one can be off by an ulp under some compiler flags.
        inv_scale = self._scale.double().reciprocal().float()
        state.found_inf = self._unscale_and_check(optimizer, inv_scale, allow_fp16=False)
        state.stage = _Stage.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` ran) and call ``optimizer.step(*args, **kwargs)`` if no rank saw inf/NaN.

        Returns what ``optimizer.step`` returns, or None for a skipped step of a plain optimizer.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise AmpPassError(
                "scaler.step(optimizer, closure=...) is not supported: the closure's backward would not be "
                "scaled; run the forward and scaler.scale(loss).backward() before scaler.step(optimizer)"
            )
        self._require_scaled("step")
        state = self._per_optimizer[id(optimizer)]
        if state.stage is _Stage.STEPPED:
            raise AmpPassError(
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
            result = optimizer.step(*args, **kwargs) if state.found_inf.item() == 0 else None
        state.stage = _Stage.STEPPED
        return result

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back off, grow or keep the scale from this iteration's overflow flags; call once per iteration.

        ``new_scale`` sets the scale instead (the trackers are kept), as GradScaler's ``update`` does.
        Needs no host sync: the scale and trackers are updated with tensor ops.
        """
        if not self._enabled:
            return
        if new_scale is not None:
            value = float(new_scale)
            if not (math.isfinite(value) and value > 0):
                raise InputError(f"update(new_scale={value!r}): the new scale must be a positive finite number")
            self._scale.fill_(value)
        else:
            flags = [s.found_inf for s in self._per_optimizer.values() if s.found_inf is not None]
            if not flags:
                raise AmpPassError(
                    "scaler.update() was called before scaler.step(optimizer) in this iteration; call "
                    "scaler.scale(loss).backward(), then scaler.step(optimizer), then scaler.update()"
                )
            found_inf = flags[0]
            for flag in flags[1:]:
                found_inf = torch.maximum(found_inf, flag)
            self._update_scale(found_inf)
        self._per_optimizer.clear()

    def get_scale(self) -> float:
        """The current scale as a float (1.0 for a passthrough scaler). Synchronises with the device."""
        return float(self._scale.item()) if self._enabled else 1.0

    def is_enabled(self) -> bool:
        """Whether the scaler scales; False for bf16 or ``enabled=False``."""
        return self._enabled

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state for a checkpoint; {} for a passthrough scaler.

        Keys: ``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``_growth_tracker`` (the
        names GradScaler uses, so checkpoints move between the two), ``hysteresis``, ``_hysteresis_tracker``.
        Call it after :meth:`update`.
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
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (also one from ``torch.amp.GradScaler``); no-op for a passthrough."""
        if not self._enabled:
            return
        if not state_dict:
            raise AmpPassError(
                "load_state_dict() got an empty state dict, which a disabled or bf16 scaler saves; load it into "
                "a scaler built the same way, or start this fp16 scaler fresh without it"
            )
        required = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
        missing = [key for key in required if key not in state_dict]
        if missing:
            raise AmpPassError(
                f"load_state_dict() is missing {missing}; pass the dict from LossScaler.state_dict() "
                "or torch.amp.GradScaler.state_dict()"
            )
        hysteresis = state_dict.get("hysteresis", self._hysteresis)
        _check_settings(
            state_dict["scale"],
            state_dict["growth_factor"],
            state_dict["backoff_factor"],
            state_dict["growth_interval"],
            hysteresis,
        )
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = state_dict["growth_interval"]
        self._hysteresis = hysteresis
        self._scale.fill_(float(state_dict["scale"]))
        self._growth_tracker.fill_(int(state_dict["_growth_tracker"]))
        self._hysteresis_tracker.fill_(int(state_dict.get("_hysteresis_tracker", hysteresis)))

    # ------------------------------------------------------------------ internals

    def _place_state(self, device: torch.device) -> None:
        self._scale = self._scale.to(device)
        self._growth_tracker = self._growth_tracker.to(device)
        self._hysteresis_tracker = self._hysteresis_tracker.to(device)
        self._placed = True

    def _require_scaled(self, method: str) -> None:
        if not self._placed:
            raise AmpPassError(
                f"scaler.{method}() was called before scaler.scale(); call scaler.scale(loss).backward() "
                "first so the gradients carry the scale"
            )

    def _step_in_kernel(
        self, optimizer: torch.optim.Optimizer, state: _OptimizerState, args: tuple, kwargs: dict
    ) -> Any:
        """Hand the overflow flag and the scale to an optimizer that skips and unscales inside its kernel."""
        if state.stage is _Stage.READY:
            # Only look for inf/NaN (dividing by 1): the fused kernel divides by grad_scale itself.
            state.found_inf = self._unscale_and_check(optimizer, torch.ones_like(self._scale), allow_fp16=True)
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

    def _unscale_and_check(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, allow_fp16: bool
    ) -> torch.Tensor:
        """Multiply every gradient by ``inv_scale`` in place; return 1.0 if any rank has an inf/NaN, else 0.0."""
        grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if grad.dtype == torch.float16 and not allow_fp16:
                    raise AmpPassError(
                        "unscale_() found an fp16 gradient; unscaling it in fp16 underflows again. Keep fp32 "
                        "master parameters and cast them to fp16 inside the forward (amppass.convert(..., "
                        "mode='train') does)"
                    )
                if grad.is_sparse:
                    if not grad.is_coalesced():
                        # Duplicate indices are summed later; check the sums, which can overflow.
                        grad = param.grad = grad.coalesce()
                    grad = grad._values()
                grads[(grad.device, grad.dtype)].append(grad)
        if not grads:
            raise AmpPassError(
                "none of the optimizer's parameters has a gradient; call scaler.scale(loss).backward() "
                "before scaler.unscale_(optimizer) or scaler.step(optimizer)"
            )

        flags: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for (device, _), tensors in grads.items():
                flag = flags.setdefault(device, torch.zeros((), dtype=torch.float32, device=device))
                torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, inv_scale.to(device))
        found_inf = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for flag in flags.values():
            # max, not sum: fused optimizers subtract the flag from their step counters, so it must stay 0 or 1.
            found_inf = torch.maximum(found_inf, flag.to(found_inf.device, non_blocking=True))

        if self._distributed():
            # With sharded gradients (or an overflow on one rank only) the ranks would otherwise disagree.
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self._process_group)
        return found_inf

    def _distributed(self) -> bool:
        if self._process_group is not None:
            return True
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _update_scale(self, found_inf: torch.Tensor) -> None:
        """Apply the backoff/growth rules (module docstring) with tensor ops, so no host sync."""
        overflow = found_inf > 0
        # Counts down on each overflow, refilled by a clean step; the scale backs off once it reaches zero.
        hysteresis_left = torch.where(overflow, (self._hysteresis_tracker - 1).clamp(min=0), self._hysteresis)
        back_off = overflow & (hysteresis_left == 0)
        clean_steps = torch.where(overflow, 0, self._growth_tracker + 1)
        grow = clean_steps >= self._growth_interval
        grown = self._scale * self._growth_factor
        new_scale = torch.where(
            back_off,
            self._scale * self._backoff_factor,
            torch.where(grow & torch.isfinite(grown), grown, self._scale),  # never grow into inf
        )
        self._scale.copy_(new_scale)
        self._growth_tracker.copy_(torch.where(grow, 0, clean_steps))
        self._hysteresis_tracker.copy_(hysteresis_left)


def _check_settings(
    init_scale: Any, growth_factor: Any, backoff_factor: Any, growth_interval: Any, hysteresis: Any
) -> None:
    """Raise InputError naming the first setting a scaler cannot use."""

    def number(value: Any) -> bool:
        return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)

    def count(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    if not (number(init_scale) and init_scale > 0):
        raise InputError(
            f"init_scale={init_scale!r} must be a positive finite number such as 2.**16 (LossScaler takes its "
            "device from the loss, so drop the device argument a torch.amp.GradScaler call may have)"
        )
    if not (number(growth_factor) and growth_factor > 1):
        raise InputError(f"growth_factor={growth_factor!r} must be a finite number > 1, e.g. 2.0")
    if not (number(backoff_factor) and 0 < backoff_factor < 1):
        raise InputError(f"backoff_factor={backoff_factor!r} must be a number between 0 and 1, e.g. 0.5")
    if not count(growth_interval):
        raise InputError(f"growth_interval={growth_interval!r} must be an int >= 1, e.g. 2000")
    if not count(hysteresis):
        raise InputError(f"hysteresis={hysteresis!r} must be an int >= 1 (1 backs off on every overflow)")
