"""The fp32 face of a converted inference module: what code that inspects the module's parameters sees.

A converted module stores each weight the graph reads only in low precision as its low-precision copy,
under the weight's own name (and a weight read in both precisions as the fp32 tensor plus a copy named
``<weight>__fp16`` / ``__bf16``). Its caller still talks to it in fp32 (``keep_io_types=True``: fp32 in,
fp32 out), and pipelines ask the module which dtype to feed it: ``x.to(next(net.parameters()).dtype)``
(a face-detection cascade's own code does), ``net.dtype`` (transformers' models). Rules:

1. ``parameters()`` / ``named_parameters()`` present every parameter in fp32, under the names the graph
   stores them by: a low-precision copy standing for a weight comes out widened to fp32; the extra copies
   of weights the graph reads in both precisions are not listed (the fp32 weight is). ``dtype`` is fp32.
2. Nothing fp32 is kept for this: a widened weight is made when the iteration reaches it and freed when the
   caller lets it go, on the device the graph's own copy is on. It holds the values the graph computes
   with (the low copy's), and it is a fresh tensor on each call: changing it changes nothing in the model.
3. What the graph runs with is unchanged and stays visible where torch's storage is read: attribute
   access (``net.conv1.weight``), ``named_buffers()``, ``state_dict()`` (the low copies under the weights'
   names, so a state dict loads back into a module converted the same way), ``.to()``.
4. Models converted with ``keep_io_types=False`` (low-precision outputs) and train-mode models (fp32
   master parameters already) show their storage as it is, and so does a module traced symbolically
   (converted without example inputs): the face belongs to :class:`~amppass.serving.serving_graph.ServingGraph`,
   what ``amppass.convert`` returns for a model captured with example inputs, and ``amppass.load``.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

from ..analysis.record import META_KEY

LOW_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def low_face(module: nn.Module) -> torch.dtype | None:
    """The low dtype whose weights ``module`` presents in fp32 (rule 1), or None where it shows its storage
    as it is (rule 4)."""
    info = getattr(module, "meta", {}).get(META_KEY, {})
    if info.get("mode") != "inference" or not info.get("keep_io_types", False):
        return None
    return LOW_DTYPES.get(info.get("dtype"))


def fp32_parameters(named: Iterator[tuple[str, torch.Tensor]], low: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` (the storage's ``named_parameters()``) as the fp32 face shows it (rules 1 and 2)."""
    pending = list(named)
    stored = {name for name, _ in pending}
    suffix = "__" + {torch.float16: "fp16", torch.bfloat16: "bf16"}[low]
    for name, tensor in pending:
        if tensor.dtype != low:
            yield name, tensor
        elif not (name.endswith(suffix) and name[: -len(suffix)] in stored):
            yield name, nn.Parameter(tensor.detach().float(), requires_grad=False)


class Fp32Face:
    """Mixin for a converted ``nn.Module``: ``named_parameters()`` (and so ``parameters()``) and ``dtype``
    as the module docstring describes. The storage stays readable through :func:`stored_parameters`."""

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """``nn.Module.named_parameters``, each low-stored weight given as the fp32 one (module docstring)."""
        named = nn.Module.named_parameters(self, *args, **kwargs)
        low = low_face(self)
        return named if low is None else fp32_parameters(named, low)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the module takes and returns its floating values in: fp32 for a converted inference model
        that keeps fp32 inputs and outputs, else that of its first floating parameter."""
        if low_face(self) is not None:
            return torch.float32
        return next((p.dtype for p in self.parameters() if p.is_floating_point()), torch.float32)


def stored_parameters(module: nn.Module, remove_duplicate: bool = True) -> list[tuple[str, torch.Tensor]]:
    """The parameters ``module`` actually stores (for amppass's own bookkeeping), whatever face it shows."""
    return list(nn.Module.named_parameters(module, remove_duplicate=remove_duplicate))
