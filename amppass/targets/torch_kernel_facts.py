"""Packaged facts about torch's low-precision kernels, for when the target's torch cannot be asked.

The FX plan asks the torch that will run the model directly where it can (:mod:`amppass.fx.view.low_kernels`). The
facts here answer where it cannot: a CUDA target planned on a machine without a GPU, a symbolically traced
graph whose nodes carry no example values, an op whose test call fails in fp32 too. They travel as data,
``data/torch_kernel_facts.json``, made by ``scripts/torch_kernel_tables.py`` from torch's own sources, each named
in the file:

- ``autocast_fp32``: the ops torch.autocast runs in fp32 on each device (its fp32 cast lists).
- ``no_low_kernel``: per device and low dtype, the ATen ops whose entries in PyTorch's op database support
  float32 but not that dtype.
- ``notes``: facts neither states (cuFFT's half precision takes power-of-two sizes only), each with its reason.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from importlib import resources
from types import MappingProxyType
from typing import Any, Mapping

from ..dtypes import LowType

FILE = "torch_kernel_facts.json"


@dataclass(frozen=True, eq=False)
class TorchKernelFacts:
    """The packaged table (module docstring); devices are "cpu" and "cuda", dtypes "bfloat16" and "float16"."""

    source: Mapping[str, Any]
    autocast_fp32: Mapping[str, frozenset[str]] = field(repr=False)
    no_low_kernel: Mapping[tuple[str, str], frozenset[str]] = field(repr=False)
    notes: Mapping[tuple[str, str], Mapping[str, str]] = field(repr=False)

    def missing(self, device: str, low: LowType, op: str) -> str:
        """Why torch on ``device`` has no ``low`` kernel for ATen op ``op`` (packet name), "" when the table
        knows of none."""
        key = (device, _dtype_name(low))
        note = self.notes.get(key, {}).get(op)
        if note:
            return f"{note}; kept fp32"
        if op in self.no_low_kernel.get(key, frozenset()):
            return (f"PyTorch's op database (torch {self.source.get('torch', '?')}) lists no {low} kernel for {op} "
                    f"on {device}; kept fp32")
        return ""

    def noted(self, device: str, low: LowType, op: str) -> bool:
        """Whether ``notes`` decides ``op``: a fact a test call on this machine cannot overturn."""
        return op in self.notes.get((device, _dtype_name(low)), {})

    def autocast_keeps_fp32(self, device: str, op: str) -> bool:
        """Whether torch.autocast runs ATen op ``op`` in fp32 on ``device``."""
        return op in self.autocast_fp32.get(device, frozenset())

    def describe(self) -> str:
        """Where the table comes from, for the report."""
        return (f"packaged table from torch {self.source.get('torch', '?')}'s op database and autocast fp32 lists "
                f"({self.source.get('made_by', 'scripts/torch_kernel_tables.py')})")


def _dtype_name(low: LowType) -> str:
    return str(low.torch).replace("torch.", "")


@functools.lru_cache(maxsize=None)
def torch_facts() -> TorchKernelFacts:
    """The packaged table, read once per process."""
    data = json.loads(resources.files(__package__).joinpath("data").joinpath(FILE).read_text(encoding="utf-8"))
    return TorchKernelFacts(
        MappingProxyType(data["source"]),
        MappingProxyType({device: frozenset(ops) for device, ops in data["autocast_fp32"].items()}),
        MappingProxyType({(device, dtype): frozenset(ops) for device, by_dtype in data["no_low_kernel"].items()
                          for dtype, ops in by_dtype.items()}),
        MappingProxyType({(device, dtype): MappingProxyType(dict(reasons)) for device, by_dtype in
                          data["notes"].items() for dtype, reasons in by_dtype.items()}),
    )

