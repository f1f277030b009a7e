"""Low-precision target dtypes: parsing user spellings and the numbers that bound them."""

from __future__ import annotations

import torch

from .errors import InputError

FP16_MAX = 65504.0
FP16_MIN_NORMAL = 6.103515625e-05
FP16_MIN_SUBNORMAL = 5.960464477539063e-08

_SPELLINGS = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}

SHORT_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def resolve_dtype(dtype: object, device: torch.device | str | None = None) -> torch.dtype:
    """Turn ``dtype`` (torch dtype, "fp16"/"bf16"/... or "auto") into torch.float16 or torch.bfloat16.

    ``"auto"`` picks fp16 when ``device`` is CUDA and bf16 otherwise (CPUs have bf16 kernels, not fp16 ones).
    """
    if dtype in (torch.float16, torch.bfloat16):
        return dtype  # type: ignore[return-value]
    if isinstance(dtype, str):
        key = dtype.strip().lower()
        if key == "auto":
            device_type = torch.device(device).type if device is not None else "cpu"
            return torch.float16 if device_type == "cuda" else torch.bfloat16
        if key in _SPELLINGS:
            return _SPELLINGS[key]
    raise InputError(
        f"dtype={dtype!r} is not a low-precision dtype amppass can target; "
        "use torch.float16, torch.bfloat16, 'fp16', 'bf16' or 'auto'"
    )


def short_name(dtype: torch.dtype) -> str:
    """'fp16', 'bf16' or 'fp32' for the dtypes amppass plans with; str(dtype) otherwise."""
    return SHORT_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def max_finite(dtype: torch.dtype) -> float:
    """Largest finite value of ``dtype``."""
    return float(torch.finfo(dtype).max)
