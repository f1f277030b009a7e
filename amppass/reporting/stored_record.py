"""The decisions a converted model carries, read as untrusted data.

A converted model can be edited or forged like any file, so every field the report (and a conversion of a
loaded model) reads from its metadata passes one validating reader here, :func:`checked`, against a
description of what amppass writes there (:data:`INFO` for the model-level summary, :data:`DECISION` for a
node's entry): each field's type, each text's length, each list's and map's length, each number's range
(counts and byte sizes are non-negative integers of at most 2**53 and 2**63, so nothing sized or repeated by
one is unbounded). Every entry is first JSON nested at most :data:`~amppass.json_input.MAX_DEPTH` deep and of
bounded size (:func:`parse`). Anything else raises an :class:`~amppass.errors.InputError` naming the node and
field, never a ``KeyError``, ``TypeError``, ``RecursionError`` or ``OverflowError``. A field amppass does not
read is kept as it is (the JSON report shows it) but never used. No text from the file is ever a format string.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Iterable

from ..archive import MAX_JSON
from ..errors import InputError
from ..json_input import read_json
from .report import Row

_PRECISIONS = {"low": None, "fp32": "fp32", "fp32-accumulate": "fp32", "keep": "-"}
_FIX = "the model's amppass metadata is damaged or was edited: convert the original model again"
MAX_TEXT = 4096  # characters of one stored text (a reason, a note; amppass's longest are about 400)
MAX_NAME = 512  # characters of a stored node, op or dtype name
MAX_ITEMS = 1 << 20  # entries of one stored list or map (node names of a model: far fewer than this)


@dataclass(frozen=True)
class Number:
    """A JSON number (not a bool) in ``[low, high]``; an integer where ``integer``; inf and NaN only where
    ``finite`` is off (evidence recorded an all-zero tensor's smallest non-zero as inf)."""

    low: float
    high: float
    integer: bool = False
    finite: bool = True

    def fault(self, value: Any) -> str | None:
        """What is wrong with ``value`` in a few words, or None when it is such a number."""
        if isinstance(value, float) and not math.isfinite(value):
            return None if not self.finite else "not a finite number"
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (self.integer and not isinstance(value, int))
        ):
            return f"not {'an integer' if self.integer else 'a number'}"
        return None if self.low <= value <= self.high else f"outside [{self.low:g}, {self.high:g}]"


@dataclass(frozen=True)
class Text:
    """A string of at most ``limit`` characters, one of ``choices`` when given."""

    limit: int = MAX_TEXT
    choices: tuple[str, ...] = ()

    def fault(self, value: Any) -> str | None:
        """What is wrong with ``value`` in a few words, or None when it is such a string."""
        if not isinstance(value, str):
            return "not text"
        if len(value) > self.limit:
            return f"{len(value):,} characters long, more than {self.limit:,}"
        return None if not self.choices or value in self.choices else f"not one of {', '.join(self.choices)}"


@dataclass(frozen=True)
class Items:
    """A list of at most :data:`MAX_ITEMS` values of ``item``; a map from ``key`` texts to ``item`` when
    ``keyed``."""

    item: Any
    keyed: bool = False
    key: Text = Text(MAX_NAME)


@dataclass(frozen=True)
class Fields:
    """An object whose listed fields, where present and not null, are as described (others kept, unread)."""

    fields: dict[str, Any]


BOOL = "bool"
COUNT = Number(0, 2 ** 53, integer=True)  # nodes, casts, runs, batches: a count sizes lists and sentences
BYTES = Number(0, 2 ** 63, integer=True)  # bytes and multiply-accumulates
AMOUNT = Number(0, 1e300)  # seconds, milliseconds, errors and tolerances
NAME = Text(MAX_NAME)
TEXT = Text()

INFO = Fields({  # the model-level summary: every field the summary, the HTML page and a reconversion read
    "amppass_version": NAME, "front_end": NAME, "dtype": Text(16, ("fp16", "bf16")),
    "mode": Text(16, ("inference", "train")), "keep_io_types": BOOL, "calibrated": BOOL, "tolerance_met": BOOL,
    "target": Fields({"name": NAME, "runtime": TEXT, "dtype": NAME, "error_judged_by": TEXT,
                      "profitability": TEXT}),
    **dict.fromkeys(("casts", "weights_converted", "weight_copies", "calibration_batches", "calibration_decisions",
                     "calibration_unobserved", "tolerance_runs", "recaptures"), COUNT),
    **dict.fromkeys(("weight_bytes_before", "weight_bytes_after"), BYTES),
    **dict.fromkeys(("calibration_seconds", "tolerance", "achieved_error", "initial_error", "held_out_error",
                     "tolerance_seconds", "tolerance_reused", "tolerance_margin"), AMOUNT),
    "held_out": TEXT, "plan_for": NAME,
    "moved_by_tolerance": (COUNT, Items(NAME), Items(TEXT, keyed=True)),
    "costs": Items(AMOUNT, keyed=True, key=TEXT),
    "parts": Fields({"converted": Items(NAME), "eager": Items(TEXT, keyed=True), "why_whole": TEXT,
                     "macs_total": BYTES, "macs_low": BYTES}),
    "backward": Fields({"saved_bytes": BYTES, "saved_bytes_by_dtype": Items(BYTES, keyed=True),
                        "saved_measured_on": TEXT}),
    "profitability": Fields({"nodes_fp32": COUNT, "regions_fp32": COUNT, "seconds": AMOUNT, "too_busy": BOOL,
                             "timing": Items(COUNT, keyed=True),
                             "device": Fields({"native_low": BOOL, "why": TEXT})}),
    "whole_model": Fields({"skipped": TEXT, "converted_ms": AMOUNT, "original_ms": AMOUNT}),
    "fixed_dims": Items(TEXT),
    "pytree_types": Items(NAME),
    # an fp8 plan's record (amppass.analysis.record.fp8_record); older ones counted products as one number and an
    # ONNX plan's MACs of its low dtype under "low"
    "fp8": Fields({"format": NAME, "low": NAME, "scales": TEXT, "products": (COUNT, Items(COUNT, keyed=True)),
                   "why_not": Items(COUNT, keyed=True, key=TEXT), "candidates": COUNT, "fp8": COUNT,
                   "macs": Fields(dict.fromkeys(("fp8", "fp16", "bf16", "fp32", "low"), BYTES))}),
})
EVIDENCE = Fields(
    {  # what a node's decision rested on (Row's docstring); numbers only shown, and a non-finite
        # one or one past float's range left out of the views (Row.macs, Row.observed), so only their sign is bounded
        "macs": Number(0, math.inf, finite=False),
        "absmax": Number(0, math.inf, finite=False),
        "min_nonzero": Number(0, math.inf, finite=False),
        "local_error": Number(0, math.inf, finite=False),
        "unknown": BOOL,
        "backward": NAME,
        "saved_bytes": BYTES,
        "saved_dtypes": Items(NAME),
        "fused": TEXT,
        "accumulate": TEXT,
        "fp8": Fields({"format": NAME, "why_not": TEXT}),  # a product's fp8 outcome: format and scales, or why not
    }
)
DECISION = Fields({  # a node's stored decision (a cast inserted by amppass has "cast" and no precision)
    "cast": BOOL, "of": NAME, "to": NAME, "precision": Text(32, tuple(_PRECISIONS)), "op": NAME, "reason": TEXT,
    "source": NAME, "rule": NAME, "casts_in": Items(NAME), "evidence": EVIDENCE,
})


def checked(value: Any, spec: Any, where: str, field: str = "") -> Any:
    """``value`` itself when it is as ``spec`` describes (see the classes above; a tuple: any one of them);
    InputError naming ``where`` and the field otherwise."""
    faults = [_fault(value, option, where, field) for option in (spec if isinstance(spec, tuple) else (spec,))]
    if all(faults):
        shown = f"field '{field}'" if field else "the value"
        raise InputError(f"{where}: {shown} is {_shown(value)}, {faults[0]}; {_FIX}")
    return value


def _fault(value: Any, spec: Any, where: str, field: str) -> str | None:
    """Why ``value`` is not as ``spec`` describes, or None; a fault inside a list or object raises at once."""
    if spec == BOOL:
        return None if isinstance(value, bool) else "not true or false"
    if isinstance(spec, (Number, Text)):
        return spec.fault(value)
    if isinstance(spec, Items):
        if not isinstance(value, dict if spec.keyed else list):
            return f"not {'an object' if spec.keyed else 'a list'}"
        if len(value) > MAX_ITEMS:
            return f"{len(value):,} entries long, more than {MAX_ITEMS:,}"
        entries: Iterable[tuple[Any, Any]] = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in entries:
            inner = f"{field}[{json.dumps(key[:40])}]" if spec.keyed else f"{field}[{key}]"
            if spec.keyed:
                checked(key, spec.key, where, inner)
            checked(item, spec.item, where, inner)
        return None
    if not isinstance(value, dict):
        return "not an object"
    for key, item_spec in spec.fields.items():
        if value.get(key) is not None:
            checked(value[key], item_spec, where, f"{field}.{key}" if field else key)
    return None


def _shown(value: Any) -> str:
    """``value`` as a short quoted text for a message (a file's value may be megabytes long)."""
    text = value if isinstance(value, str) else type(value).__name__ if isinstance(value, (list, dict)) else str(value)
    return repr(text[:40] + ("…" if len(text) > 40 else ""))


def parse(text: str, what: str) -> Any:
    """JSON ``text`` stored as ``what``, bounded (:func:`amppass.json_input.read_json`); InputError otherwise."""
    return read_json(text, what, max_bytes=MAX_JSON, fix=_FIX)


def model_info(raw: Any, what: str) -> dict[str, Any]:
    """The model-level summary, checked against :data:`INFO`; it must name its low-precision dtype."""
    if isinstance(raw, dict) and raw.get("dtype") is None:
        raise InputError(f"{what} names no low-precision dtype (field 'dtype'); {_FIX}")
    return checked(raw, INFO, what)


def row(name: str, raw: Any, low: str) -> Row | None:
    """The report row for node ``name`` from its stored decision (None for an inserted cast), checked against
    :data:`DECISION`."""
    where = f"node {_shown(name)}: its amppass decision"
    checked(raw, DECISION, where)
    if raw.get("cast"):
        return None
    precision = raw.get("precision")
    if precision is None:
        raise InputError(f"{where} has no precision (field 'precision'), one of {sorted(_PRECISIONS)}; {_FIX}")
    texts = {key: raw.get(key) for key in ("op", "reason", "source")}
    missing = [key for key, value in texts.items() if value is None]
    if missing:
        raise InputError(f"{where} has no text for field {missing[0]!r}; {_FIX}")
    evidence = dict(raw.get("evidence") or {})
    if precision == "fp32-accumulate":
        evidence.setdefault("accumulate", "fp32 via dtype= on the low-precision input")
    if precision == "low" and isinstance(evidence.get("fp8"), dict) and evidence["fp8"].get("format"):
        low = "fp8"  # a product an fp8 plan lowered past the plan's low dtype (its format and scales beside it)
    return Row(name, texts["op"], _PRECISIONS[precision] or low, texts["reason"], texts["source"],
               list(raw.get("casts_in") or []), evidence, raw.get("rule") or "")
