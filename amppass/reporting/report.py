"""The :class:`Report`: one row per planned node and a summary, read back from a converted artifact.

The JSON form is described by ``schema.json`` beside this module (JSON Schema, draft 2020-12); its
``schema_version`` changes whenever a field is removed or changes meaning.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any, Iterable

from ..analysis.overrides import same_op
from ..errors import InputError
from ..files import check_regular, write_atomic
from .html import render_html
from .rows import (
    LOCAL_ERROR,
    LOW_PRECISIONS,
    OUTPUT_ERROR,
    PRECISION_FILTERS,
    PRECISIONS,
    SCHEMA_VERSION,
    OpGroup,
    Row,
    finite,
    summary_lines,
)

__all__ = ["LOCAL_ERROR", "LOW_PRECISIONS", "OUTPUT_ERROR", "PRECISIONS", "PRECISION_FILTERS", "SCHEMA_VERSION",
           "OpGroup", "Report", "Row", "finite", "load_schema", "merged", "summary_lines", "write_atomic"]

@dataclass
class Report:
    """All decisions for one converted model plus what the conversion did overall."""

    rows: list[Row]
    info: dict[str, Any]

    def counts(self) -> dict[str, int]:
        """Number of nodes per precision."""
        return dict(Counter(row.precision for row in self.rows))

    def select(self, precision: Iterable[str] = (), op: Iterable[str] = ()) -> list[Row]:
        """The rows in one of the ``precision`` filters and running one of the ``op`` names; an empty
        filter keeps every row.

        Precisions are those of :data:`PRECISION_FILTERS`; ops match case-insensitively, with or without
        a namespace ("add", "aten.add"; "Add"), as ``keep_fp32`` patterns do.
        """
        precision, op = list(precision), list(op)
        unknown = [p for p in precision if p not in PRECISION_FILTERS]
        if unknown:
            raise InputError(f"precision {unknown[0]!r} is not one of {', '.join(PRECISION_FILTERS)}")
        wanted = {p for name in precision for p in {"low": LOW_PRECISIONS, "none": ("-",)}.get(name, (name,))}
        return [row for row in self.rows
                if (not wanted or row.precision in wanted) and (not op or any(same_op(row.op, o) for o in op))]

    def fp8_rows(self) -> list[Row]:
        """The matrix products of an fp8 plan (``dtype="fp8"``): each row's evidence ``fp8`` holds its format and
        scales where it runs in fp8, ``why_not`` where it does not."""
        return [row for row in self.rows if isinstance(row.evidence.get("fp8"), dict)]

    def by_op(self, rows: Iterable[Row] | None = None) -> list[OpGroup]:
        """``rows`` (by default all) grouped by op, most nodes first."""
        groups: dict[str, OpGroup] = {}
        for row in self.rows if rows is None else rows:
            group = groups.setdefault(row.op, OpGroup(row.op))
            group.by_precision[row.precision] = group.by_precision.get(row.precision, 0) + 1
            if row.macs is not None:
                group.macs = (group.macs or 0) + row.macs
        return sorted(groups.values(), key=lambda g: (-g.nodes, g.op))

    def stats(self) -> dict[str, Any]:
        """The summary as numbers: the ``summary`` object of the JSON form."""
        info = self.info
        counted = [(row.macs, row.precision) for row in self.rows if row.macs is not None]
        total = sum(m for m, _ in counted)
        low = sum(m for m, p in counted if p in LOW_PRECISIONS)
        before, after = info.get("weight_bytes_before"), info.get("weight_bytes_after")
        if not before or after is None:  # counted by an older amppass, or not at all
            before = after = None
        return {
            "nodes": len(self.rows),
            "by_precision": self.counts(),
            "casts": int(info.get("casts") or 0),
            "macs": {
                "total": total,
                "low": low,
                "low_share": low / total if total else None,
                "counted_nodes": len(counted),
            },
            "weight_bytes": {"before": before, "after": after},
            "moved_by_tolerance": self._moved_by_tolerance(),
            "calibrated": bool(info.get("calibrated")),
            "sources": dict(Counter(row.source for row in self.rows if row.precision != "-").most_common()),
            "unknown_ops": sorted({row.op for row in self.rows if row.evidence.get("unknown")}),
        }

    def _moved_by_tolerance(self) -> int | None:
        moved = self.info.get("moved_by_tolerance")
        if isinstance(moved, (list, tuple, dict)):
            return len(moved)
        if isinstance(moved, int):
            return moved
        by_rows = sum(1 for row in self.rows if row.source == "tolerance")
        return by_rows or None

    def summary(self) -> str:
        """A few lines: nodes per precision, heavy compute, casts, weight bytes, tolerance, calibration."""
        return "\n".join(summary_lines(self))

    def table(self) -> str:
        """Every row as plain text columns."""
        width = max((len(r.name) for r in self.rows), default=4)
        op_width = max((len(r.op) for r in self.rows), default=2)
        lines = [f"{'node':<{width}}  {'op':<{op_width}}  prec  source       reason"]
        for r in self.rows:
            lines.append(f"{r.name:<{width}}  {r.op:<{op_width}}  {r.precision:<4}  {r.source:<11}  {r.reason}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: ``{"schema_version", "info", "summary", "rows"}`` (see ``schema.json``).

        Non-finite numbers (an ``inf`` smallest non-zero of an all-zero tensor) become ``None``, so the
        JSON is strict.
        """
        return _strict({
            "schema_version": SCHEMA_VERSION,
            "info": self.info,
            "summary": self.stats(),
            "rows": [asdict(r) for r in self.rows],
        })

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The report as JSON text; also written (atomically) to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2, default=str, allow_nan=False)
        if path is not None:
            check_regular(path)  # a FIFO there is refused, never replaced
            write_atomic(path, text)
        return text

    def to_html(self, path: str | os.PathLike | None = None, title: str | None = None) -> str:
        """A self-contained HTML page (no network); also written (atomically) to ``path`` when given.

        ``title`` names the model in the page's heading.
        """
        text = render_html(self, title)
        if path is not None:
            check_regular(path)  # a FIFO there is refused, never replaced
            write_atomic(path, text)
        return text


_SUMMED = ("casts", "weights_converted", "weight_copies", "weight_bytes_before", "weight_bytes_after")


def merged(named: Iterable[tuple[str, Report]]) -> Report:
    """One report over several converted graphs: each row named ``<prefix>.<node>`` (its casts too), the counts of
    the summary summed, dtype and mode the first graph's."""
    rows: list[Row] = []
    info: dict[str, Any] = {}
    for prefix, part in named:
        for row in part.rows:
            row.name = f"{prefix}.{row.name}"
            row.casts = [f"{prefix}.{c}" for c in row.casts]
            rows.append(row)
        for key in _SUMMED:
            info[key] = info.get(key, 0) + int(part.info.get(key) or 0)
        for key in ("dtype", "mode", "target"):
            if key in part.info:
                info.setdefault(key, part.info[key])
    return Report(rows, info)


def _strict(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None, through dicts, lists and tuples."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(item) for item in value]
    return value


def load_schema() -> dict[str, Any]:
    """The JSON Schema that :meth:`Report.to_json` output follows."""
    return json.loads(resources.files(__package__).joinpath("schema.json").read_text(encoding="utf-8"))
