"""The target a precision plan is made for: the device and runtime the converted model will run on.

A :class:`Target` carries everything about the deployment that changes a plan:

- ``low``: the low dtype and its range facts (:class:`~amppass.dtypes.LowType`).
- ``kernels`` (ONNX): which ops the runtime runs in the low dtype. For ``"cpu"`` that is the installed
  onnxruntime's own CPU kernel registry, asked at run time; for ``"cuda"`` and ``"tensorrt"``, machines
  this one usually cannot load, the static tables of :mod:`amppass.targets.onnx_kernel_tables`, each naming its source.
- ``conditions`` (ONNX): attribute values a registered kernel refuses at run time (the CPU provider's
  ScatterND with ``reduction='add'`` in fp16), read from the kernel sources; none are recorded for the GPU
  providers.
  TensorRT's ONNX runtime provider hands what TensorRT does not support to the CUDA provider, so the
  TensorRT target falls back to the CUDA table for those ops.
- ``judge``: how the tolerance search measures a candidate's error. Where this machine runs the target it
  runs the candidate there ("runtime": onnxruntime's CPU provider for ONNX, the model's own device for
  torch); otherwise the fp16-storage simulation of :mod:`amppass.onnx.simulate` stands in ("simulation").
- ``profitable`` (torch, on this machine's device): whether profitability is measured, i.e. a region of
  the plan runs low only where its low-precision kernels and casts beat fp32 here
  (:mod:`amppass.analysis.profitability`).
- kernels (torch): which ops have a low-precision kernel on the device is asked of torch itself where this
  machine has the device, and read from a packaged table otherwise (:mod:`amppass.fx.view.low_kernels`,
  :mod:`amppass.targets.torch_kernel_facts`).
- ``slow_low`` (torch): ATen ops the device runs in low precision only through a slow reference path, kept
  fp32 by the plan whatever is measured. On CPUs torch has oneDNN's fused low-precision LSTM, but GRU and
  plain RNN layers and cells run bf16 through unfused code, several times slower than fp32 and less
  accurate (torch.autocast on CPU keeps them fp32 too).
- ``slow_backward`` (torch, train mode): ATen ops whose low-precision backward the device runs only through a slow
  reference path, kept fp32 in a train-mode plan for speed (``plan_for="coverage"`` keeps them low). On CPUs
  torch computes an fp16 convolution's backward (1-D, 2-D, 3-D, transposed) with a reference loop: a 64-channel
  3x3 convolution on 8x64x32x32 took 1.04 s forward and backward in fp16 against 11 ms in fp32 and 12 ms in bf16
  (2-core Xeon with avx512_fp16, torch 2.13), while its fp16 forward alone is fast, so timing forwards would not
  see it.

Targets are made by :func:`onnx_target` and :func:`torch_target` and are recorded in the converted model
(``describe()``) and shown in its report.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..dtypes import LowType, low_type
from ..errors import InputError
from .onnx_kernel_tables import NO_CONDITIONS, KernelConditions, KernelTable, load, load_conditions
from .torch_kernel_facts import torch_facts

ONNX_TARGETS = ("cpu", "cuda", "tensorrt")
TORCH_TARGETS = ("cpu", "cuda")
FP8_CAPABILITY = (8, 9)  # CUDA compute capability with fp8 (e4m3, e5m2) matrix kernels: Ada, Hopper and later

log = logging.getLogger(__name__)


class Kernels(Protocol):
    """Which ops a runtime runs on which element type: ``status`` answers "native", "via-fp32" (the
    runtime casts around an fp32 kernel by itself), "none" or "unknown" (a custom op)."""

    def status(self, domain: str, op: str, opset: int, elem_type: int) -> str:
        """How the runtime runs ``domain::op`` at ``opset`` on ``elem_type``: one of the four answers above."""
        ...

    def describe(self) -> dict[str, Any]:
        """Where the facts come from, for the report."""
        ...


@dataclass(frozen=True, eq=False)
class Target:
    """Where a converted model runs (module docstring). Compared and hashed by identity: targets are made
    once per (kind, dtype) and shared, so caches keyed by them stay small."""

    name: str  # "cpu", "cuda" or "tensorrt"
    front_end: str  # "fx" or "onnx"
    low: LowType
    runtime: str  # what runs the model: "torch", "onnxruntime CPUExecutionProvider", ...
    judge: str  # "runtime" or "simulation"
    kernels: Kernels | None = None  # ONNX only
    conditions: KernelConditions = NO_CONDITIONS  # ONNX: attribute values its kernels refuse at run time
    profitable: bool = False  # torch on this machine's device: profitability measured
    slow_low: frozenset[str] = frozenset()  # torch: ATen packets without a fast low-precision kernel
    slow_backward: frozenset[str] = frozenset()  # torch, train mode: ATen packets without a fast low backward

    def describe(self) -> dict[str, Any]:
        """What the converted model's metadata and report say about the target."""
        info: dict[str, Any] = {"name": self.name, "runtime": self.runtime, "dtype": self.low.name,
                                "error_judged_by": "running it" if self.judge == "runtime" else
                                "fp16-storage simulation (this machine cannot run the target)"}
        if self.kernels is not None:
            info["kernels"] = self.kernels.describe()
        if self.front_end == "fx":
            info["profitability"] = "measured on this machine" if self.profitable else "off"
            asked = (
                "asked of torch on this machine (one test call per op form), else " if self.judge == "runtime" else ""
            )
            info["kernels"] = {"source": asked + torch_facts().describe()}
        return info

    def __str__(self) -> str:
        return f"{self.name} ({self.runtime}, {self.low})"


class _LiveCpu:
    """The installed onnxruntime's CPU kernel registry (:mod:`amppass.targets.onnxruntime_facts`)."""

    def status(self, domain: str, op: str, opset: int, elem_type: int) -> str:
        from . import onnxruntime_facts

        return onnxruntime_facts.kernel_status(domain, op, opset, elem_type)

    def describe(self) -> dict[str, Any]:
        try:
            import onnxruntime

            version = onnxruntime.__version__
        except ImportError:
            version = "not installed"
        return {"provider": "CPUExecutionProvider", "source": f"kernel registry of the installed onnxruntime "
                f"{version}"}


class _Table:
    """A static kernel table, with another consulted for the ops it does not list at all."""

    def __init__(self, table: KernelTable, fallback: KernelTable | None = None):
        self.table, self.fallback = table, fallback

    def status(self, domain: str, op: str, opset: int, elem_type: int) -> str:
        found = self.table.status(domain, op, opset, elem_type)
        if found == "unknown" and self.fallback is not None:
            return self.fallback.status(domain, op, opset, elem_type)
        return found

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"provider": self.table.provider, "source": _source(self.table)}
        if self.fallback is not None:
            info["fallback"] = {"provider": self.fallback.provider, "source": _source(self.fallback)}
        return info


def _source(table: KernelTable) -> str:
    src = table.source
    return " ".join(str(src[k]) for k in ("repo", "file", "version", "commit") if k in src) or "packaged table"


@functools.lru_cache(maxsize=None)
def onnx_target(name: str = "cpu", dtype: object = "fp16") -> Target:
    """The target for an ONNX model run by onnxruntime's CPU or CUDA provider or by TensorRT.

    ``dtype="auto"`` is fp16 for every ONNX target: onnxruntime's CPU provider runs no bf16 MatMul or Conv,
    and fp16 is what the GPU providers are fastest in.
    """
    name = _checked(name, ONNX_TARGETS, "convert_onnx")
    low = low_type("fp16" if isinstance(dtype, str) and dtype.strip().lower() == "auto" else dtype)
    if name == "cpu":
        return Target("cpu", "onnx", low, "onnxruntime CPUExecutionProvider", "runtime", _LiveCpu(),
                      conditions=load_conditions("onnxruntime-cpu"))
    if name == "cuda":
        return Target("cuda", "onnx", low, "onnxruntime CUDAExecutionProvider", "simulation",
                      _Table(load("onnxruntime-cuda")))
    return Target("tensorrt", "onnx", low, "onnxruntime TensorrtExecutionProvider (TensorRT, CUDA fallback)",
                  "simulation", _Table(load("tensorrt"), load("onnxruntime-cuda")))


@functools.lru_cache(maxsize=None)
def torch_target(name: str, dtype: object) -> Target:
    """The target for a torch model run eagerly or compiled on ``name`` ("cpu" or "cuda").

    Profitability is measured only where this machine has the device (a CUDA target without a GPU here
    keeps the numerics-only plan)."""
    name = _checked(name, TORCH_TARGETS, "convert")
    low = low_type(dtype, device=name)
    local = name == "cpu" or torch.cuda.is_available()
    return Target(name, "fx", low, f"torch {torch.__version__.split('+')[0]} on {name}",
                  "runtime" if local else "simulation", profitable=local,
                  slow_low=_CPU_SLOW_LOW if name == "cpu" else frozenset(),
                  slow_backward=_CPU_SLOW_FP16_BACKWARD if name == "cpu" and low.name == "fp16" else frozenset())


_CPU_SLOW_LOW = frozenset({"gru", "rnn_tanh", "rnn_relu", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
                           "_thnn_fused_gru_cell"})
_CPU_SLOW_FP16_BACKWARD = frozenset({"convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
                                     "conv_transpose2d", "conv_transpose3d"})


def _checked(name: object, choices: tuple[str, ...], function: str) -> str:
    key = str(name).strip().lower() if isinstance(name, str) else name
    if key not in choices:
        raise InputError(f"{function}(target={name!r}): amppass plans for {', '.join(repr(c) for c in choices)}; "
                         f"pass one of them (the device and runtime the converted model will run on)")
    return key  # type: ignore[return-value]


def check_fp8(name: str, plan_for: str) -> None:
    """InputError where ``dtype="fp8"`` cannot be planned for torch target ``name`` (module docstring of
    :mod:`amppass.fx.runners.fp8`): a CUDA device of compute capability below 8.9 (checked where this machine has
    one), a CPU without ``plan_for="coverage"`` (CPUs have no fp8 arithmetic: a CPU plan is for testing, and it
    says it will be slow); the same in both modes (``mode="train"`` trains e4m3 forward, e5m2 gradients)."""
    name = _checked(name, TORCH_TARGETS, "convert")
    if name == "cpu":
        if plan_for != "coverage":
            raise InputError(f"amppass.convert(dtype='fp8', target='cpu', plan_for={plan_for!r}): CPUs have no fp8 "
                             "arithmetic, so an fp8 model runs slower there than fp32 and is for testing the "
                             "numerics only: pass plan_for='coverage' to convert it anyway, dtype='bf16' for a fast "
                             "CPU model, or target='cuda' for a GPU of compute capability 8.9 or later")
        log.warning("dtype='fp8' for target 'cpu' (plan_for='coverage'): for testing only; the CPU has no fp8 "
                    "arithmetic, so torch._scaled_mm computes the fp8 products from e4m3 values in fp32, slower than "
                    "the fp32 model")
        return
    if torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
        if capability < FP8_CAPABILITY:
            raise InputError(f"amppass.convert(dtype='fp8', target='cuda'): this GPU ({torch.cuda.get_device_name()}, "
                             f"compute capability {capability[0]}.{capability[1]}) has no fp8 matrix kernels; they "
                             f"need {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or later (Ada, Hopper): pass dtype='bf16'")
