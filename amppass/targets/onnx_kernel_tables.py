"""Static per-provider kernel tables: which float types each op's kernels take, by opset.

:func:`amppass.targets.onnxruntime_facts.kernel_status` asks the installed onnxruntime's CPU provider at run time.
Models are deployed on onnxruntime's CUDA provider and on TensorRT too, which this machine often
cannot load, so their kernel facts travel as data: ``data/*.json``, made by ``scripts/kernel_tables.py``
from the support matrices each project publishes (onnxruntime's ``docs/OperatorKernels.md``,
onnx-tensorrt's ``docs/operators.md``). Every table names its source: repository, file, version,
commit and date. Only float types are recorded (float, float16, bfloat16, double).

A registry says which types an op's kernel takes, not which attribute values it takes them with:
onnxruntime's CPU provider registers ScatterND for float16, loads the model, and raises at the first run when
``reduction='add'``. Such :class:`Condition` facts travel as data too (``data/*_conditions.json``, read from
the kernel sources each entry names) and :class:`KernelConditions` applies them per node.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from importlib import resources
from types import MappingProxyType
from typing import Mapping

from onnx import TensorProto

from ..errors import InputError

TABLES = MappingProxyType({
    "onnxruntime-cpu": "onnxruntime_cpu.json",
    "onnxruntime-cuda": "onnxruntime_cuda.json",
    "tensorrt": "tensorrt.json",
})

CONDITIONS = MappingProxyType({"onnxruntime-cpu": "onnxruntime_cpu_conditions.json"})

TYPE_NAMES: Mapping[int, str] = MappingProxyType({
    TensorProto.FLOAT: "float",
    TensorProto.FLOAT16: "float16",
    TensorProto.BFLOAT16: "bfloat16",
    TensorProto.DOUBLE: "double",
})

Span = tuple[int, int, frozenset[str]]  # since, until (inclusive), float types of the kernels


@dataclass(frozen=True, eq=False)
class KernelTable:
    """One provider's kernels: ``(domain, op) -> opset spans``, with the document they were read from.

    Domains are stored as ONNX writes them in a model, the default domain as "" (a caller may also
    spell it "ai.onnx").
    """

    provider: str
    source: Mapping[str, str]
    spans: Mapping[tuple[str, str], tuple[Span, ...]] = field(repr=False)

    def status(self, domain: str, op: str, opset: int, elem_type: int) -> str:
        """How the provider runs ``op`` at ``opset`` on ``elem_type`` tensors: "native", "none" or "unknown".

        The same meaning as :func:`amppass.targets.onnxruntime_facts.kernel_status`: "native" when a kernel covering
        ``opset`` takes the type; "none" when the op has kernels but none of them, at that opset, takes it;
        "unknown" when the table does not list the op at all (a custom op).
        """
        if elem_type not in TYPE_NAMES:
            raise InputError(
                f"elem_type={elem_type!r}: kernel tables record float types only; pass one of "
                + ", ".join(f"{code} ({TensorProto.DataType.Name(code)})" for code in TYPE_NAMES)
            )
        spans = self.spans.get((_domain(domain), op))
        if spans is None:
            return "unknown"
        name = TYPE_NAMES[elem_type]
        return "native" if any(a <= opset <= b and name in types for a, b, types in spans) else "none"

    def ops(self) -> tuple[tuple[str, str], ...]:
        """Every ``(domain, op)`` the table lists, sorted; the default domain is ""."""
        return tuple(sorted(self.spans))


@dataclass(frozen=True)
class Condition:
    """A kernel that takes ``types`` except when ``attribute`` holds one of ``values`` (opset ``since`` on)."""

    domain: str
    op: str
    since: int
    attribute: str
    values: frozenset[str]
    types: frozenset[str]
    source: str  # the kernel source file and what in it refuses

    def describe(self, value: str) -> str:
        """The fact, for a reason string: "with reduction='add' (its kernel raises at run time: <source>)"."""
        return f"with {self.attribute}={value!r} (its kernel raises at run time: {self.source})"


@dataclass(frozen=True, eq=False)
class KernelConditions:
    """The :class:`Condition` facts of one provider, looked up per node."""

    provider: str
    conditions: tuple[Condition, ...] = ()

    def attributes(self, domain: str, op: str) -> frozenset[str]:
        """The attribute names some condition on ``op`` reads (empty for most ops)."""
        return frozenset(c.attribute for c in self.conditions if (c.domain, c.op) == (_domain(domain), op))

    def refusal(self, domain: str, op: str, opset: int, elem_type: int,
                attributes: tuple[tuple[str, str], ...]) -> str:
        """Why the provider refuses ``op`` on ``elem_type`` with these ``(name, value)`` attributes, or ""."""
        given = dict(attributes)
        for c in self.conditions:
            if ((c.domain, c.op) == (_domain(domain), op) and opset >= c.since and TYPE_NAMES.get(elem_type) in c.types
                    and given.get(c.attribute) in c.values):
                return c.describe(given[c.attribute])
        return ""


NO_CONDITIONS = KernelConditions("none")


@functools.lru_cache(maxsize=None)
def load_conditions(name: str) -> KernelConditions:
    """The :class:`KernelConditions` of table ``name`` (a key of :data:`CONDITIONS`), read once per process."""
    data = _read(name, CONDITIONS, "kernel conditions")
    found = tuple(Condition(_domain(c["domain"]), c["op"], c["since"], c["attribute"], frozenset(c["values"]),
                            frozenset(c["types"]), c["source"]) for c in data["conditions"])
    return KernelConditions(data["provider"], found)


@functools.lru_cache(maxsize=None)
def load(name: str) -> KernelTable:
    """The kernel table called ``name`` (a key of :data:`TABLES`), read once per process."""
    data = _read(name, TABLES, "kernel table")
    spans = {
        (_domain(domain), op): tuple((since, until, frozenset(types)) for since, until, types in rows)
        for domain, ops in data["ops"].items()
        for op, rows in ops.items()
    }
    return KernelTable(data["provider"], MappingProxyType(data["source"]), MappingProxyType(spans))


def _read(name: str, files: Mapping[str, str], what: str) -> dict:
    """The packaged JSON file ``files[name]``; an unknown ``name`` is an InputError listing the known ones."""
    if name not in files:
        raise InputError(f"no {what} named {name!r}; choose one of: {', '.join(files)}")
    return json.loads(resources.files(__package__).joinpath("data").joinpath(files[name]).read_text(encoding="utf-8"))


def _domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain
