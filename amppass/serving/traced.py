"""The module ``amppass.convert`` returns for a model converted without example inputs (symbolically traced).

A symbolic trace takes every input shape, so there are no later plans to capture and nothing keeps the
caller's model for them: the graph holds its own copies of the caller's module objects, the low-precision
copies of the weights it reads low, and the caller's own fp32 tensors for the ops it keeps fp32 (it runs
with them, as every converted module does).
"""

from __future__ import annotations

from typing import Any

from torch import fx

from .plan_dtypes import PlanDtypes
from .serving_graph import keep_non_persistent

__all__ = ["TracedGraph"]


class TracedGraph(fx.GraphModule):
    """A converted, symbolically traced graph: a ``GraphModule`` with the methods every converted module has.

    Args:
        gm: the converted graph module; its graph, state and ``meta`` become this module's.
    """

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, gm.graph)
        self.meta = gm.meta
        keep_non_persistent(gm, self)

    def drop_original(self) -> None:
        """Nothing to release: this module never holds the caller's model (a symbolic trace serves every
        shape, so no later conversion needs it), only the caller's fp32 tensors its fp32 ops run with
        (module docstring). Here so that every module ``amppass.convert`` returns has it."""

    def _apply(self, fn: Any, recurse: bool = True) -> "TracedGraph":
        """``.to()`` and its relatives move the device; the dtypes stay the plan's
        (:mod:`amppass.serving.plan_dtypes`)."""
        kept = PlanDtypes(fn)
        result = super()._apply(kept, recurse)
        kept.retarget([self])
        kept.tell(type(self).__name__)
        return result
