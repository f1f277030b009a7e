"""What a torch conversion is asked for, as one value: the plan options, the mode, the dtype, the target and the
capture's dynamic shapes, checked once where the conversion starts and read everywhere as attributes.

:func:`amppass.convert` builds a :class:`Settings` from its arguments, the compile backend from its ``options``
(:mod:`amppass.pipelines.backend`), the integrations where their plugin, trainer or ``prepare`` call is made
(:class:`amppass.integrations.routing.TrainConversion`). What the pipeline derives from them (does it measure
speed? store low weights once? check the example for inf and NaN?) is a property here, said once, so the stages of
:mod:`amppass.pipelines.stages` ask the value instead of comparing ``mode`` strings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..analysis.options import PlanOptions, RewriteOptions
from ..dtypes import LowType, low_type
from ..errors import InputError
from ..fx.rewrite.device_literals import module_device
from ..targets.target import Target, torch_target

MODES = ("inference", "train")


@dataclass(frozen=True)
class Settings:
    """One torch conversion's settings (``amppass.convert``'s docstring says what each does).

    ``target`` is the device as the caller named it (None: the model's); ``planned_for`` the :class:`Target` it
    resolves to once the model is known (:meth:`on`), which the stages read."""

    options: PlanOptions = PlanOptions()
    mode: str = "inference"
    dtype: Any = "auto"
    target: str | None = None
    dynamic_shapes: Any = "auto"
    planned_for: Target | None = None

    @classmethod
    def of(cls, mode: str, *, dtype: Any = "auto", target: str | None = None, dynamic_shapes: Any = "auto",
           **options: Any) -> "Settings":
        """The checked settings of a conversion in ``mode`` from :func:`amppass.convert`'s keyword arguments of
        those names: ``mode`` checked first, and a train-mode conversion's calibration read into a list (both of
        its graphs calibrate on it)."""
        if mode not in MODES:
            raise InputError(f"mode={mode!r} is not one of {MODES}: use mode='inference' to serve or evaluate "
                             "the model, mode='train' to train it")
        recipe = options.get("fp8_recipe", "dynamic")
        if recipe != "dynamic" and (mode != "train" or options.get("fp8") is None):
            raise InputError(f"fp8_recipe={recipe!r} applies to fp8 training only: pass dtype='fp8' and mode='train' "
                             "with it, or leave fp8_recipe unset (inference's fp8 input scales are calibrated or "
                             "each call's own)")
        if (mode == "train" or options.get("fp8") is not None) and options.get("calibration") is not None:
            options["calibration"] = list(options["calibration"])  # read again: by the second graph, by fp8's choice
        return cls(PlanOptions(**options), mode, dtype, target, dynamic_shapes)

    def on(self, model: Any) -> "Settings":
        """These settings with their :class:`Target` resolved: ``target``, or the device of ``model``'s
        parameters (``model`` may be a ``torch.device`` itself)."""
        name = device_name(self.target, model)
        try:
            planned_for = torch_target(name, self.dtype)
        except TypeError:  # an unhashable dtype or target
            low_type(self.dtype)
            raise InputError(f"target={self.target!r} is not a device name; pass 'cpu' or 'cuda'") from None
        return dataclasses.replace(self, planned_for=planned_for)

    def replace(self, **options: Any) -> "Settings":
        """A copy whose plan options have ``options`` changed (checked again)."""
        return dataclasses.replace(self, options=self.options.replace(**options))

    def later(self) -> "Settings":
        """The settings of a later capture of the same model (another input shape): its decisions measured on
        calibration data are carried from the first plan, so it neither calibrates nor searches again."""
        return self.replace(calibration=None, tolerance=None, progress=False)

    @property
    def resolved(self) -> Target:
        """The target the plan is made for (:meth:`on` resolved it)."""
        if self.planned_for is None:
            raise AssertionError("Settings.on(model) resolves the target before a plan is made")
        return self.planned_for

    @property
    def low(self) -> LowType:
        """The low dtype of the plan."""
        return self.resolved.low

    @property
    def trains(self) -> bool:
        """A train-mode conversion: fp32 master parameters cast inside the graph, run under autograd."""
        return self.mode == "train"

    @property
    def measures_regions(self) -> bool:
        """Profitability times the plan's regions on the device and keeps fp32 those not faster low (given an
        example to time them on): a speed plan for inference on a target whose kernels this machine runs."""
        return self.options.plan_for == "speed" and not self.trains and self.resolved.profitable

    @property
    def measures_whole_model(self) -> bool:
        """The converted graph is timed against the original module, which is kept where it is not faster (given an
        example): as :attr:`measures_regions`, without calibration (a calibrated plan is kept as it was asked)."""
        return self.measures_regions and not self.options.calibration

    @property
    def avoids_slow_backward(self) -> bool:
        """Ops whose low backward trains far slower than fp32 stay fp32 (a speed plan for training)."""
        return self.trains and self.options.plan_for == "speed"

    @property
    def checks_finite(self) -> bool:
        """The example runs once in fp32 and converted to keep fp32 what goes inf or NaN (inference only: a train
        graph updates running statistics)."""
        return not self.trains

    @property
    def rewrite(self) -> RewriteOptions:
        """How the rewrite writes the plan: weights stored low once for inference (and every fitting weight low for
        a memory plan), cast inside the graph for training."""
        return RewriteOptions(keep_io_types=self.options.keep_io_types, precast_weights=not self.trains,
                              weights_low=self.options.plan_for == "memory" and not self.trains)


def device_name(target: str | None, model: Any) -> Any:
    """The device a plan is for: ``target``, or the device type of ``model``'s parameters ("cpu" without any;
    ``model`` may be a ``torch.device`` itself)."""
    if target is not None:
        return target
    if isinstance(model, torch.device):
        return model.type
    found = module_device(model) if isinstance(model, nn.Module) else None
    return (found or torch.device("cpu")).type
