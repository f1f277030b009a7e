"""The decisions a converted model carries, read as untrusted data.

A converted model can be edited or forged like any file, so what the readers take from its metadata is
checked here: every entry is JSON nested at most :data:`~amppass.json_input.MAX_DEPTH` deep (the limit a .pt2's
plan is read with; the report's views walk what they are given recursively), the model-level summary must be
a JSON object whose counts are finite numbers, and every node's entry must name a known precision with
string reasons. Anything else raises an :class:`~amppass.errors.InputError` naming the node or field, never a
``KeyError``, ``RecursionError`` or ``OverflowError``.
"""

from __future__ import annotations

from typing import Any

from ..archive import MAX_JSON
from ..errors import InputError
from ..json_input import read_json
from .report import Row
from .rows import finite

# numbers the summary reads from the model-level metadata, when present
_NUMBERS = ("casts", "weights_converted", "weight_copies", "weight_bytes_before", "weight_bytes_after",
            "calibration_batches", "calibration_seconds", "calibration_decisions", "calibration_unobserved",
            "tolerance", "achieved_error", "initial_error", "tolerance_runs")
_PRECISIONS = {"low": None, "fp32": "fp32", "fp32-accumulate": "fp32", "keep": "-"}
_FIX = "the model's amppass metadata is damaged or was edited: convert the original model again"


def parse(text: str, what: str) -> Any:
    """JSON ``text`` stored as ``what``, bounded (:func:`amppass.json_input.read_json`); InputError otherwise."""
    return read_json(text, what, max_bytes=MAX_JSON, fix=_FIX)


def model_info(raw: Any, what: str) -> dict[str, Any]:
    """The model-level summary, checked: an object with a string ``dtype`` and finite numbers for counts."""
    if not isinstance(raw, dict):
        raise InputError(f"{what} is a {type(raw).__name__}, not an object; {_FIX}")
    if not isinstance(raw.get("dtype"), str):
        raise InputError(f"{what} names no low-precision dtype (field 'dtype'); {_FIX}")
    for key in _NUMBERS:
        value = raw.get(key)
        if value is not None and finite(value) is None:
            raise InputError(f"{what}: field {key!r} is {str(value)[:40]!r}, not a finite number; {_FIX}")
    moved = raw.get("moved_by_tolerance")
    if moved is not None and not isinstance(moved, (list, dict)) and finite(moved) is None:
        raise InputError(f"{what}: field 'moved_by_tolerance' is {str(moved)[:40]!r}, not a count; {_FIX}")
    return raw


def row(name: str, raw: Any, low: str) -> Row | None:
    """The report row for node ``name`` from its stored decision (None for an inserted cast)."""
    where = f"node {name!r}: its amppass decision"
    if not isinstance(raw, dict):
        raise InputError(f"{where} is a {type(raw).__name__}, not an object; {_FIX}")
    if raw.get("cast"):
        return None
    precision = raw.get("precision")
    if not isinstance(precision, str) or precision not in _PRECISIONS:
        raise InputError(f"{where} has precision {str(precision)[:40]!r}, not one of {sorted(_PRECISIONS)}; {_FIX}")
    texts = {key: raw.get(key) for key in ("op", "reason", "source")}
    wrong = [key for key, value in texts.items() if not isinstance(value, str)]
    if wrong:
        raise InputError(f"{where} has no text for field {wrong[0]!r}; {_FIX}")
    casts = raw.get("casts_in", [])
    evidence = raw.get("evidence", {})
    if not isinstance(casts, list) or not all(isinstance(c, str) for c in casts) or not isinstance(evidence, dict):
        raise InputError(f"{where} has a malformed 'casts_in' or 'evidence' field; {_FIX}")
    rule = raw.get("rule", "")
    if not isinstance(rule, str):
        raise InputError(f"{where} has a rule id that is not text; {_FIX}")
    evidence = dict(evidence)
    if precision == "fp32-accumulate":
        evidence.setdefault("accumulate", "fp32 via dtype= on the low-precision input")
    return Row(name, texts["op"], _PRECISIONS[precision] or low, texts["reason"], texts["source"], list(casts),
               evidence, rule)

