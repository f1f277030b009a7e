"""Which converted artifact an object is, and where the record of its conversion lives.

``amppass.convert`` returns one of several modules (this folder): a converted graph (a
:class:`~amppass.serving.serving_graph.ServingGraph` with per-shape plans, or another ``GraphModule`` carrying a
record: a symbolic trace's, a compile backend's), a train-mode model (:class:`~amppass.serving.train_eval.
TrainEvalGraphs`), the original kept in fp32 (:class:`~amppass.serving.fp32_original.KeptFp32`), the model in its
own class around its converted graph (:class:`~amppass.serving.dropin.DropIn`), or a model converted by parts
(:mod:`amppass.serving.parts`). What takes a converted model (report, save, export_onnx, converting again,
conversion by parts) asks :func:`record_of` which one it holds, and each answers in its own words.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping

from torch import fx

from ..analysis.record import META_KEY
from .dropin import DropIn
from .fp32_original import KeptFp32
from .parts import PartsRecord, parts_of
from .serving_graph import ServingGraph
from .train_eval import TrainEvalGraphs


class Kind(Enum):
    """Which converted artifact an object is."""

    SERVING = "serving"  # a ServingGraph: a captured graph serving every input shape
    GRAPH = "graph"  # another GraphModule carrying a record (symbolically traced, a compile backend's graph)
    TRAIN = "train"  # a train-mode model: train and eval graphs
    KEPT = "kept"  # the original module kept in fp32
    DROP_IN = "drop-in"  # the model's own class around its converted module
    PARTS = "parts"  # a model converted by parts


@dataclass(frozen=True)
class Artifact:
    """What :func:`record_of` found.

    ``record``: the conversion's summary (``meta["amppass"]``: dtype, mode, target, ...) of the graph that holds it;
    a kept original's own, with the times that decided it; for a model converted by parts, the dtype and mode of
    the conversion (each part holds its own record). ``graph``: the converted graph holding the record (the graph
    itself, a train-mode model's train graph, a drop-in's converted graph), or None (a kept original, a model
    converted by parts). ``inner``: a drop-in's converted module, as found; ``parts``: a model converted by parts'
    :class:`~amppass.serving.parts.PartsRecord`.
    """

    kind: Kind
    module: Any
    record: Mapping[str, Any]
    graph: fx.GraphModule | None = None
    inner: "Artifact | None" = None
    parts: PartsRecord | None = None


def record_of(module: Any) -> Artifact | None:
    """Which converted artifact ``module`` is and where its record lives, or None for anything amppass did not
    convert (a plain module, a GraphModule without a record, an ONNX model)."""
    parts = parts_of(module)
    if parts is not None:
        return Artifact(Kind.PARTS, module, {"dtype": parts.dtype, "mode": parts.mode}, parts=parts)
    if isinstance(module, DropIn):
        inner = record_of(module.converted)
        return None if inner is None else Artifact(Kind.DROP_IN, module, inner.record, inner.graph, inner)
    if isinstance(module, TrainEvalGraphs):
        graph = module.train_graph
        return Artifact(Kind.TRAIN, module, graph.meta.get(META_KEY, {}), graph)
    if isinstance(module, KeptFp32):
        return Artifact(Kind.KEPT, module, module.meta[META_KEY])
    if isinstance(module, fx.GraphModule) and META_KEY in getattr(module, "meta", {}):
        kind = Kind.SERVING if isinstance(module, ServingGraph) else Kind.GRAPH
        return Artifact(kind, module, module.meta[META_KEY], module)
    return None
