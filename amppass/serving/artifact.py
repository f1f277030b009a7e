"""Which converted artifact an object is, and what each kind answers for itself.

``amppass.convert`` returns one of several modules (this folder): a converted graph (a
:class:`~amppass.serving.serving_graph.ServingGraph` with per-shape plans, or another ``GraphModule`` carrying a
record: a symbolic trace's, a compile backend's), a train-mode model (:class:`~amppass.serving.train_eval.
TrainEvalGraphs`), the original kept in fp32 (:class:`~amppass.serving.fp32_original.Fp32Original`), the model in its
own class around its converted graph (:class:`~amppass.serving.dropin.DropIn`), or a model converted by parts
(:class:`~amppass.serving.parts.ByParts`).

Each kind is one subclass of :class:`Artifact`, and only that class knows the kind: it recognises its modules
(:meth:`Artifact.found`) and answers for them with its record, its :meth:`~Artifact.report`, why nothing of it
runs in low precision where nothing does (:meth:`~Artifact.fp32_because`), the graph a ``.pt2`` file holds or why
it holds none (:meth:`~Artifact.saved_graph`) and why ``export_onnx`` refuses it (:meth:`~Artifact.export_refusal`).
What takes a converted model (report, save, export_onnx, converting again, conversion by parts) asks
:func:`record_of` and calls these; none of them switches on the kind, so a new kind is one class here.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

from torch import fx

from ..analysis.plan import Precision
from ..analysis.record import META_KEY
from ..errors import InputError
from ..reporting.fx_reader import read_graph_module
from ..reporting.report import Report, merged
from .dropin import DropIn, TransformersDropIn
from .fp32_original import Fp32Original, kept_because
from .parts import PartsRecord, parts_of
from .serving_graph import ServingGraph
from .train_eval import TrainEvalGraphs

# why a converted module runs nothing in low precision (:meth:`Artifact.fp32_because`)
KEPT = "kept in fp32: its converted graph measured slower than the original here"
NOTHING_LOW = "nothing in it runs in low precision (its ops stay fp32 by the policy)"
KINDS: list[type["Artifact"]] = []  # every kind, in the order defined: a more particular kind before a general one


class Artifact:
    """A converted module of one kind, as :func:`record_of` found it, and what it answers for itself.

    ``module``: the object found. ``record``: the conversion's summary (``meta["amppass"]``: dtype, mode, target,
    ...) of the graph that holds it; a kept original's own, with the times that decided it; for a model converted by
    parts, the dtype and mode of the conversion (each part holds its own record). ``graph``: the converted graph
    holding the record and each node's decision (the graph itself, a train-mode model's train graph, a drop-in's
    converted graph), or None (a kept original, a model converted by parts).
    """

    kind: ClassVar[str]  # the kind's name, for what a caller shows
    # what it was and what to pass export_onnx instead (:meth:`export_refusal`)
    export_advice: ClassVar[str] = ("already converted by amppass: pass the original float32 model "
                                    "(amppass.export_onnx(model, example_inputs, path))")
    in_model_class: ClassVar[bool] = False  # the module is already of the model's own class (nothing to wrap)

    def __init__(self, module: Any, record: Mapping[str, Any], graph: fx.GraphModule | None = None):
        self.module, self.record, self.graph = module, record, graph

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A kind is known by being defined: :func:`record_of` asks every kind, in the order they are defined."""
        super().__init_subclass__(**kwargs)
        KINDS.append(cls)

    @classmethod
    def found(cls, module: Any) -> "Artifact | None":
        """``module`` as this kind, or None where it is not one."""
        raise NotImplementedError

    def decisions(self) -> fx.GraphModule:
        """The graph whose nodes hold the conversion's decisions (every kind without one answers its own way)."""
        if self.graph is None:
            raise TypeError(f"a {self.kind} artifact has no graph of decisions")
        return self.graph

    def report(self) -> Report:
        """The report of the conversion: read from the graph that holds its decisions."""
        return read_graph_module(self.decisions())

    def fp32_because(self) -> str | None:
        """Why nothing of it runs in low precision, or None where something does: read from each node's decision."""
        low = Precision.LOW.value
        if any(node.meta[META_KEY].get("precision") == low for node in self.decisions().graph.nodes
               if META_KEY in node.meta):
            return None
        return NOTHING_LOW

    def refuse_training(self, why: str) -> None:
        """Make its graph refuse a call in train mode with gradients enabled (training it), saying ``why``, where
        its graph serves inference and can; nothing otherwise."""

    def saved_graph(self) -> ServingGraph:
        """The graph ``amppass.save`` writes, or the :class:`InputError` saying why a ``.pt2`` file holds none."""
        raise InputError(f"amppass.save takes the module amppass.convert returned, got {type(self.module).__name__}")

    def export_refusal(self) -> str:
        """Why ``amppass.export_onnx`` takes the original float32 model instead, and what to pass."""
        return (f"export_onnx exports a float32 model and converts it; this {type(self.module).__name__} was "
                f"{self.export_advice}")


class PartsArtifact(Artifact):
    """A model converted by parts (:mod:`amppass.pipelines.parts`); ``parts``: its
    :class:`~amppass.serving.parts.PartsRecord`."""

    kind = "parts"
    export_advice = ("converted by parts by amppass: pass the original float32 model, which export_onnx exports with "
                     "the TorchScript exporter where the dynamo exporter cannot take it whole")

    def __init__(self, module: Any, parts: PartsRecord):
        super().__init__(module, {"dtype": parts.dtype, "mode": parts.mode})
        self.parts = parts

    @classmethod
    def found(cls, module: Any) -> "PartsArtifact | None":
        """A :class:`~amppass.serving.parts.ByParts` model, with its record."""
        parts = parts_of(module)
        return None if parts is None else cls(module, parts)

    def report(self) -> Report:
        """One report over the parts (rows named ``<path>.<node>``), with what runs as the model's code and why."""
        record = self.parts
        whole = merged((path, _artifact(part).report()) for path, part in record.modules(self.module).items())
        whole.info.update({
            "front_end": "fx", "dtype": record.dtype, "mode": record.mode,
            "parts": {"converted": list(record.converted), "eager": dict(record.eager),
                      "why_whole": record.why_whole, **record.info},
        })
        return whole

    def fp32_because(self) -> str | None:
        """None where a part converted (each runs low: a part that does not is left out)."""
        return None if self.parts.converted else "no part of it converted"

    def saved_graph(self) -> ServingGraph:
        """Refused: a ``.pt2`` file holds one graph, and the model's own Python runs between its parts."""
        raise InputError(f"{type(self.module).__name__} was converted by parts: its own Python runs between the "
                         "converted parts, and a .pt2 file holds one graph; save its state_dict() and convert the "
                         "original again where it runs, or amppass.save(model.<part>, path) for one part")


class DropInArtifact(Artifact):
    """The model in its own class around its converted module; ``inner``: that module, as found."""

    kind = "drop-in"

    def __init__(self, module: Any, inner: Artifact):
        super().__init__(module, inner.record, inner.graph)
        self.inner = inner

    @classmethod
    def found(cls, module: Any) -> "DropInArtifact | None":
        """A :class:`~amppass.serving.dropin.DropIn` whose converted module is an artifact."""
        if not isinstance(module, DropIn):
            return None
        inner = record_of(module.converted)
        return None if inner is None else cls(module, inner)

    def report(self) -> Report:
        """Its converted module's."""
        return self.inner.report()

    def refuse_training(self, why: str) -> None:
        """Its converted module's graph refuses."""
        self.inner.refuse_training(why)

    def fp32_because(self) -> str | None:
        """Its converted module's answer."""
        return self.inner.fp32_because()

    def saved_graph(self) -> ServingGraph:
        """Its converted graph where the class adds nothing but ``forward`` (a transformers model that does not
        generate); refused otherwise: the file would lose the class's methods."""
        if isinstance(self.module, TransformersDropIn) and not self.module.can_generate():
            return self.inner.saved_graph()  # a forward and nothing else to lose: the file holds its graph
        raise InputError(f"{type(self.module).__name__} is a converted model in its own class; amppass.save writes a "
                         "graph alone, without the class's methods (generate(), encode()): "
                         "amppass.save(model.converted, path), or convert the model where it runs")


class TrainArtifact(Artifact):
    """A train-mode model: its train graph holds the record."""

    kind = "train"
    export_advice = ("converted by amppass in train mode: load what it learned into the original model "
                     "(original.load_state_dict(model.state_dict()): the keys are the original's) and pass the "
                     "original")

    @classmethod
    def found(cls, module: Any) -> "TrainArtifact | None":
        """A :class:`~amppass.serving.train_eval.TrainEvalGraphs`, answering with its train graph."""
        if not isinstance(module, TrainEvalGraphs):
            return None
        graph = module.train_graph
        return cls(module, graph.meta.get(META_KEY, {}), graph)

    def saved_graph(self) -> ServingGraph:
        """Refused: amppass.save writes inference models. The way to ship what it learned names its own dtype, so an
        fp8 model ships as fp8 (its record says ``fp8``; its low dtype alone would say bf16)."""
        dtype = "fp8" if "fp8" in self.record else self.record.get("dtype")
        raise InputError("amppass.save writes inference models; for a train-mode model save its state_dict() as a "
                         "checkpoint, and to ship what it learned load that into the original (the keys are the "
                         f"original's) and convert it with amppass.convert(original, example_inputs, dtype={dtype!r}) "
                         "(mode='inference')")


class KeptArtifact(Artifact):
    """The original kept in fp32, with the measurement that decided it."""

    kind = "kept"
    in_model_class = True

    @classmethod
    def found(cls, module: Any) -> "KeptArtifact | None":
        """A :class:`~amppass.serving.fp32_original.Fp32Original`, with its measurement."""
        return cls(module, module.meta[META_KEY]) if isinstance(module, Fp32Original) else None

    def report(self) -> Report:
        """Its one row: the whole module runs fp32, with the times that decided it."""
        return self.module.report()

    def fp32_because(self) -> str | None:
        """It was measured slower converted."""
        return KEPT

    def saved_graph(self) -> ServingGraph:
        """Refused: there is no converted graph, and the original ships as it is."""
        raise InputError(f"amppass.convert kept the original {self.module.original_class.__name__} in fp32 "
                         f"({kept_because(self.record)}), so there is no converted graph to save: ship the original "
                         "model as it is, or convert with plan_for='coverage' (or on the machine you deploy on, or "
                         "with costs= from it) to save a converted one")


class ServingArtifact(Artifact):
    """A captured graph serving every input shape: what a ``.pt2`` file holds."""

    kind = "serving"

    @classmethod
    def found(cls, module: Any) -> "ServingArtifact | None":
        """A :class:`~amppass.serving.serving_graph.ServingGraph` carrying a record."""
        if not isinstance(module, ServingGraph) or not _recorded(module):
            return None
        return cls(module, module.meta[META_KEY], module)

    def refuse_training(self, why: str) -> None:
        """The graph refuses a call that would train it."""
        self.module.refuse_training(why)

    def saved_graph(self) -> ServingGraph:
        """The graph itself."""
        return self.module


class GraphArtifact(Artifact):
    """Another ``GraphModule`` carrying a record: symbolically traced, or a compile backend's graph."""

    kind = "graph"

    @classmethod
    def found(cls, module: Any) -> "GraphArtifact | None":
        """Any ``GraphModule`` carrying a record (asked last: every graph kind above is one too)."""
        if not isinstance(module, fx.GraphModule) or not _recorded(module):
            return None
        return cls(module, module.meta[META_KEY], module)

    def saved_graph(self) -> ServingGraph:
        """Refused: a symbolic trace has no input shapes to export."""
        raise InputError(f"{type(self.module).__name__} was converted without example inputs (symbolically traced), "
                         "so it has no input shapes to export; convert it with example_inputs to save it")


def _recorded(module: Any) -> bool:
    """Whether ``module`` carries a conversion's record."""
    return META_KEY in getattr(module, "meta", {})


def _artifact(part: Any) -> Artifact:
    """A converted part of a model converted by parts as its artifact (every converted part is one)."""
    found = record_of(part)
    if found is None:
        raise TypeError(f"a converted part ({type(part).__name__}) holds no amppass record")
    return found


def record_of(module: Any) -> Artifact | None:
    """Which converted artifact ``module`` is (the first kind of :data:`KINDS` that recognises it), or None for anything
    amppass did not convert (a plain module, a GraphModule without a record, an ONNX model)."""
    return next((found for kind in KINDS if (found := kind.found(module)) is not None), None)
