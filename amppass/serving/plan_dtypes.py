"""``.to(dtype)``, ``.half()``, ``.float()`` on a converted module: the device follows, the dtypes stay the plan's.

A converted module holds each tensor in the dtype its plan chose: a weight the graph reads only in low
precision as its low-precision copy, the others (layer norms, a train-mode model's master weights) in fp32,
and the graph's casts are written for exactly those dtypes. ``nn.Module.to(dtype)`` and its relatives would
change every floating tensor to one dtype, and the next call would fail inside the graph (``mat1 and mat2
must have the same dtype, but got BFloat16 and Float``), even for ``fast.to(fast.dtype)``, which the fp32
face (:mod:`amppass.serving.fp32_parameters`) makes look like a no-op. So a converted module's ``_apply`` runs
:class:`PlanDtypes` instead of the function it is given: the function's device change (``.to("cuda")``,
``.cpu()``) and anything else it does to a tensor happen as asked; a floating tensor keeps its dtype,
logged once per call (a warning, or INFO where fp32 was asked: the dtype the module faces its caller with).
Converting the original again with the other ``dtype`` is the way to another low dtype. The graphs' device
literals follow a device move (:mod:`amppass.fx.rewrite.device_literals`).
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

import torch
from torch import fx

from ..fx.rewrite.device_literals import retarget

log = logging.getLogger(__name__)


class PlanDtypes:
    """``fn`` of ``nn.Module._apply`` with any change of a floating tensor's dtype left out (module docstring)."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]):
        self.fn = fn
        self.asked: set[torch.dtype] = set()
        self.moves: dict[torch.device, torch.device] = {}  # device before -> device after, for the graphs' literals

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """``fn(tensor)`` with the tensor's floating dtype kept, noting where its device moved."""
        result = self._kept(tensor)
        self.moves.setdefault(tensor.device, result.device)
        return result

    def _kept(self, tensor: torch.Tensor) -> torch.Tensor:
        if not (tensor.is_floating_point() or tensor.is_complex()):
            return self.fn(tensor)
        made = self.fn(torch.empty(0, dtype=tensor.dtype, device=tensor.device))  # what fn makes of such a tensor
        if made.dtype == tensor.dtype:
            return self.fn(tensor)
        self.asked.add(made.dtype)
        return tensor.to(made.device)

    def retarget(self, graphs: Iterable[fx.GraphModule]) -> None:
        """Move the device literals of ``graphs`` as the tensors moved (:mod:`amppass.fx.rewrite.device_literals`)."""
        for gm in graphs:
            retarget(gm, self.moves)

    def tell(self, name: str) -> None:
        """Log what was asked and left out, once for the whole ``_apply``."""
        if not self.asked:
            return
        asked = ", ".join(sorted(str(d).replace("torch.", "") for d in self.asked))
        level = logging.INFO if self.asked == {torch.float32} else logging.WARNING
        log.log(level, "%s: a converted model keeps the dtypes its plan chose (%s asked); the device follows. "
                "To run in another dtype, convert the original model with that dtype", name, asked)
