"""The original module, kept in fp32, where every converted plan measured slower on the target.

A captured graph runs the ops the model's Python code called, one by one. Some modules run faster eagerly
than any graph of their ops can: ``nn.TransformerEncoder`` in inference takes PyTorch's fused "fast path"
kernel, which torch.export decomposes. When profitability (:mod:`amppass.fx.profit`) finds the converted
graph slower than the original module in fp32 on the target, :func:`amppass.convert` returns a
:class:`KeptFp32` instead: it runs a private copy of the original module (tensors shared, never written)
and carries the measurement, which :func:`amppass.report` shows as its one row.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..analysis.record import META_KEY
from ..fx.copies import shared_copy
from ..fx.guards import plain_inputs
from ..report.report import Report, Row


class KeptFp32(nn.Module):
    """Runs the original module in fp32; ``meta["amppass"]`` says why (module docstring)."""

    def __init__(self, original: nn.Module, info: dict[str, Any]):
        super().__init__()
        self.original = shared_copy(original)  # own module objects: .train() never reaches the caller's
        self.original.eval()
        self.meta = {META_KEY: info}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.original(*plain_inputs(args), **plain_inputs(kwargs))  # the caller's containers stay unwritten

    def drop_original(self) -> None:
        """Nothing to release: this module holds its own copy of the caller's module objects, never the caller's
        module itself, and runs the caller's fp32 tensors, which it needs (as every converted module has it)."""

    def report(self) -> Report:
        """The one decision: the whole module runs fp32, with the times that decided it."""
        info = self.meta[META_KEY]
        whole = info["whole_model"]
        reason = (f"profitability: the converted graph took {whole['converted_ms']:.3g} ms per call on this "
                  f"{info['target']['name'].upper()} against {whole['original_ms']:.3g} ms for the original "
                  "module in fp32 (its eager kernels are faster than any captured graph of them here); the "
                  "original runs, in fp32. plan_for='coverage' or 'memory' converts it anyway")
        row = Row(type(self.original).__name__, "module", "fp32", reason, "profitability", [], dict(whole),
                  "whole-model")
        return Report([row], info)
