"""The :class:`Report`: one row per planned node and a summary, read back from a converted artifact."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA_VERSION = 1


@dataclass
class Row:
    """One node's decision as a user reads it."""

    name: str
    op: str
    precision: str  # "fp16", "bf16", "fp32" or "-" for nodes without floating-point work
    reason: str
    source: str
    casts: list[str] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass
class Report:
    """All decisions for one converted model plus what the conversion did overall."""

    rows: list[Row]
    info: dict[str, Any]

    def counts(self) -> dict[str, int]:
        """Number of nodes per precision."""
        return dict(Counter(row.precision for row in self.rows))

    def summary(self) -> str:
        """A few lines: nodes per precision, casts, weight bytes, and the unknown ops."""
        info = self.info
        counts = self.counts()
        parts = ", ".join(f"{counts[p]} {p}" for p in ("fp16", "bf16", "fp32", "-") if p in counts)
        lines = [
            f"amppass {info.get('front_end', '')} plan, target {info.get('dtype')} ({info.get('mode', 'inference')}): "
            f"{len(self.rows)} nodes: {parts}",
            f"casts inserted: {info.get('casts', 0)}",
        ]
        before, after = info.get("weight_bytes_before"), info.get("weight_bytes_after")
        if before:
            lines.append(f"weight bytes: {before:,} -> {after:,} ({after / before:.2f} of fp32)")
        sources = Counter(row.source for row in self.rows if row.precision != "-")
        lines.append("decided by: " + ", ".join(f"{n} {s}" for s, n in sources.most_common()))
        unknown = sorted({row.op for row in self.rows if row.evidence.get("unknown")})
        if unknown:
            lines.append("ops not in the policy table (followed their inputs): " + ", ".join(unknown))
        if not info.get("calibrated"):
            lines.append("uncalibrated: decisions come from op semantics and weights only")
        return "\n".join(lines)

    def table(self) -> str:
        """Every row as plain text columns."""
        width = max((len(r.name) for r in self.rows), default=4)
        op_width = max((len(r.op) for r in self.rows), default=2)
        lines = [f"{'node':<{width}}  {'op':<{op_width}}  prec  source       reason"]
        for r in self.rows:
            lines.append(f"{r.name:<{width}}  {r.op:<{op_width}}  {r.precision:<4}  {r.source:<11}  {r.reason}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: ``{"schema_version", "info", "rows"}``."""
        return {"schema_version": SCHEMA_VERSION, "info": self.info, "rows": [asdict(r) for r in self.rows]}

    def to_json(self, path: str | None = None) -> str:
        """The report as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2, default=str)
        if path is not None:
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(text)
        return text
