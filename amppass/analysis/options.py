"""How a plan is made: the options of a conversion, checked once where it starts, then read everywhere as one value.

``amppass.convert`` builds a :class:`PlanOptions` from its arguments, the compile backend from its ``options``, the
integrations from theirs where the plugin, trainer or ``prepare`` call is made
(:class:`amppass.integrations.routing.TrainConversion`), ``amppass.convert_onnx`` and the command line the ONNX
form of it (:class:`amppass.pipelines.convert_onnx.OnnxPlanOptions`); the pipeline passes the value on
instead of a dict of keywords, so following ``calibration`` from ``convert`` to the stage that reads it is following an
attribute. The torch pipeline carries it inside its settings (:class:`amppass.pipelines.settings.Settings`: mode,
dtype, target and dynamic shapes besides), and both front ends' rewrites take one :class:`RewriteOptions`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from ..dtypes import Fp8Format
from ..errors import InputError
from .calibration import check_tolerance
from .overrides import compile_patterns

PLAN_FOR = ("speed", "coverage", "memory")
FP8_RECIPES = ("dynamic", "delayed")  # how fp8 training scales inputs and gradients (docs/fp8.md, Training)


@dataclass(frozen=True)
class PlanOptions:
    """The options of a conversion that decide its plan (``amppass.convert``'s docstring says what each does)."""

    plan_for: str = "speed"
    keep_io_types: bool = True
    keep_fp32: tuple[str, ...] = ()
    force_low: tuple[str, ...] = ()
    low_weight_tables: bool = False
    calibration: Any = None  # an iterable of batches; read once per conversion (a list where read more often)
    tolerance: float | None = None
    progress: bool = False
    costs: Mapping[str, float] | None = None
    fp8: Fp8Format | None = None  # dtype="fp8": a bf16 plan with some matrix products lowered to this format
    fp8_recipe: str = "dynamic"  # fp8 training's input and gradient scales: each call's own, or an amax history

    CALIBRATION_FORM: ClassVar[str] = "[inputs, ...]"  # the form of calibration data messages show

    def __post_init__(self) -> None:
        if self.plan_for not in PLAN_FOR:
            raise InputError(f"plan_for={self.plan_for!r} is not one of {PLAN_FOR}: 'speed' keeps low precision only "
                             "where it is faster on the target, 'coverage' runs low every op numerics allow, 'memory' "
                             "also stores every weight in low precision")
        for name in ("keep_io_types", "low_weight_tables", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name}={getattr(self, name)!r} must be True or False")
        for name in ("keep_fp32", "force_low"):
            object.__setattr__(self, name, _patterns(name, getattr(self, name)))
        if self.costs is not None and not isinstance(self.costs, Mapping):
            raise InputError(f"costs must be the table a conversion recorded (a dict: amppass.report(m).info"
                             f"['costs']), got {type(self.costs).__name__}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise InputError(f"fp8_recipe={self.fp8_recipe!r} is not one of {FP8_RECIPES}: 'dynamic' scales each fp8 "
                             "training product's input and gradient by their own range on every call, 'delayed' by "
                             "the largest of their last 16 ranges (an amax history in the model's state)")
        check_tolerance(self.tolerance, self.calibration, self.CALIBRATION_FORM)

    def replace(self, **changes: Any) -> "PlanOptions":
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class RewriteOptions:
    """How a rewrite writes a plan into the model, the same type for both front ends' rewrites
    (:func:`amppass.fx.rewrite.apply.rewrite`, :func:`amppass.onnx.rewrite.rewrite`) and their tolerance trials.

    ``keep_io_types``: floating graph outputs cast back to fp32; ``precast_weights``: weights read low are stored
    low once (inference; training casts the fp32 parameters inside the graph instead); ``weights_low``: every
    weight whose values fit is stored low, cast up at its fp32 readers (a memory-first plan, with
    ``precast_weights`` only). An ONNX model always stores its low weights once and never all of them low."""

    keep_io_types: bool = True
    precast_weights: bool = True
    weights_low: bool = False


def _patterns(name: str, value: Any) -> tuple[str, ...]:
    """``keep_fp32`` / ``force_low`` as a tuple of strings (one string is one pattern, not its characters), each a
    valid regular expression (:func:`amppass.analysis.overrides.compile_patterns` says what is wrong otherwise)."""
    return tuple(pattern for pattern, _ in compile_patterns(value, name))
