"""Low-precision dtypes: their facts in one value (:class:`LowType`), and parsing user spellings of them.

Every part of amppass that needs to know about the low dtype (the range rules, painting's reasons, the
rewrites, the ONNX element types, the report) reads it from one :class:`LowType`, carried by the
:class:`~amppass.targets.target.Target` a plan is made for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from onnx import TensorProto
from torch import Tensor

from .errors import InputError

FP16_MAX = 65504.0
FP16_MIN_NORMAL = 6.103515625e-05
FP16_MIN_SUBNORMAL = 5.960464477539063e-08


@dataclass(frozen=True)
class LowType:
    """A low-precision floating type: its names in torch and ONNX and the numbers that bound it."""

    name: str  # "fp16" or "bf16", as reasons and reports spell it
    torch: torch.dtype
    onnx: int  # TensorProto element type
    max: float  # largest finite value
    min_normal: float  # smallest positive normal value
    significand_bits: int  # with the implicit leading one: a sum of 2**bits terms loses them all

    @property
    def smallest_subnormal(self) -> float:
        """Smallest positive value: non-zero magnitudes below half of it round to zero."""
        return self.min_normal * 2.0 ** -(self.significand_bits - 1)

    @property
    def wide_range(self) -> bool:
        """Whether the type has fp32's exponent range (bf16): no overflow or underflow rules apply."""
        return self.max > FP16_MAX

    def __str__(self) -> str:
        return self.name


FP16 = LowType("fp16", torch.float16, TensorProto.FLOAT16, FP16_MAX, FP16_MIN_NORMAL, 11)
BF16 = LowType("bf16", torch.bfloat16, TensorProto.BFLOAT16, float(torch.finfo(torch.bfloat16).max),
               float(torch.finfo(torch.bfloat16).tiny), 8)
LOW_TYPES = (FP16, BF16)

_SPELLINGS = {
    "fp16": FP16, "float16": FP16, "half": FP16, torch.float16: FP16,
    "bf16": BF16, "bfloat16": BF16, torch.bfloat16: BF16,
}

SHORT_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
               torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def low_type(dtype: object, device: torch.device | str | None = None) -> LowType:
    """``dtype`` (a torch dtype, "fp16"/"bf16"/..., a LowType or "auto") as a :class:`LowType`.

    ``"auto"`` picks fp16 when ``device`` is CUDA and bf16 otherwise (CPUs have bf16 kernels, not fp16 ones).
    """
    if isinstance(dtype, LowType):
        return dtype
    key = dtype.strip().lower() if isinstance(dtype, str) else dtype
    if key == "auto":
        device_type = torch.device(device).type if device is not None else "cpu"
        return FP16 if device_type == "cuda" else BF16
    try:
        found = _SPELLINGS.get(key)  # type: ignore[call-overload]
    except TypeError:  # an unhashable value
        found = None
    if found is None:
        raise InputError(f"dtype={dtype!r} is not a low-precision dtype amppass can target; use torch.float16, "
                         "torch.bfloat16, 'fp16', 'bf16' or 'auto'")
    return found


_FP32_TINY = float(torch.finfo(torch.float32).tiny)


@dataclass(frozen=True)
class Fp8Format:
    """An 8-bit float a scaled matrix product reads: its names and the numbers a per-tensor scale needs.

    A tensor ``x`` is stored as ``(x / scale).to(torch)`` and read back as ``stored.float() * scale``;
    :meth:`scale_for` picks ``scale`` so that the largest magnitude seen lands ``margin`` powers of two
    below :attr:`max`.
    """

    name: str  # "e4m3" or "e5m2", as reasons and reports spell it
    torch: torch.dtype
    onnx: int  # TensorProto element type
    max: float  # largest finite value
    min_normal: float  # smallest positive normal value

    def scale_for(self, amax: float, margin: int = 0) -> float:
        """The per-tensor scale that maps ``amax`` to ``max / 2**margin``: finite and positive for any ``amax``.

        A zero, negative, NaN or infinite ``amax`` (an all-zero or constant-zero tensor, a broken range)
        gives a scale of 1.0, and a scale is never below fp32's smallest normal, so dividing an fp32 tensor
        by it never makes an inf or a NaN.
        """
        if not math.isfinite(amax) or amax <= 0.0:
            return 1.0
        return max(amax * 2.0 ** margin / self.max, _FP32_TINY)

    def scales_for(self, amax: Tensor, margin: int = 0) -> Tensor:
        """:meth:`scale_for` of every element of ``amax`` (one range per row or per channel), as an fp32 tensor of
        its shape, with the same rules: 1.0 for a zero, negative, NaN or infinite range, never below fp32's smallest
        normal, so no row's scale is zero, inf or NaN."""
        amax = amax.detach().float()
        usable = torch.isfinite(amax) & (amax > 0)
        scaled = (amax * 2.0 ** margin / self.max).clamp_min(_FP32_TINY)
        return torch.where(usable, scaled, torch.ones_like(amax))

    def __str__(self) -> str:
        return self.name


# finer fp8 scales (row-wise inputs, per-channel weights) are taken where they leave less than this share of the
# per-tensor e4m3 error: a smaller gain does not pay for the extra ranges (a judgement, not a measured break-even)
FINER_SCALES_GAIN = 0.9

E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, TensorProto.FLOAT8E4M3FN,
                 float(torch.finfo(torch.float8_e4m3fn).max), float(torch.finfo(torch.float8_e4m3fn).tiny))
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, TensorProto.FLOAT8E5M2,
                 float(torch.finfo(torch.float8_e5m2).max), float(torch.finfo(torch.float8_e5m2).tiny))


_FP8_SPELLINGS = {"fp8": E4M3, "float8": E4M3, "e4m3": E4M3, "float8_e4m3fn": E4M3, torch.float8_e4m3fn: E4M3}


def fp8_format(dtype: object) -> Fp8Format | None:
    """The fp8 format a ``dtype=`` argument asks products to take ("fp8", "e4m3", torch.float8_e4m3fn), or None.

    An fp8 plan is a bf16 plan (or fp16 where the target says so) with some matrix products lowered further,
    to e4m3 inputs and weights; e5m2 is the format of gradients in training, not one a user asks for.
    """
    key = dtype.strip().lower() if isinstance(dtype, str) else dtype
    try:
        return _FP8_SPELLINGS.get(key)  # type: ignore[call-overload]
    except TypeError:  # an unhashable value
        return None


def short_name(dtype: torch.dtype) -> str:
    """'fp16', 'bf16' or 'fp32' for the torch dtypes amppass plans with; str(dtype) otherwise."""
    return SHORT_NAMES.get(dtype, str(dtype).replace("torch.", ""))
