"""amppass.json_input: JSON from a file, bounded in size and value count before the parser and in depth after it."""

from __future__ import annotations

import json

import pytest

from amppass import InputError
from amppass.json_input import read_json


def test_the_value_count_is_bounded_before_the_parser_runs(monkeypatch):
    """100,001 empty objects in 300 KB: refused from the text's commas and brackets, json never called."""
    text = b"[" + b"{}," * 100_000 + b"{}]"
    monkeypatch.setattr(json, "loads", lambda *a, **k: pytest.fail("parsed"))
    with pytest.raises(InputError, match="entry 'x' may hold 100,002 JSON values .* more than the 1,000 amppass "
                                         "reads there; save it again"):
        read_json(text, "entry 'x'", max_bytes=1 << 20, max_values=1000, fix="save it again")


def _values(value) -> int:
    """The values of a parsed JSON value: itself, and those of every list item and dict value."""
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return 1 + sum(_values(child) for child in children)


@pytest.mark.parametrize("value", [[1, 2, 3], {"a": [1, {"b": None}], "c": "x"}, [], 5, [[[]]], {"k": {}}])
def test_a_limit_of_exactly_the_values_held_reads_the_text(value):
    """Without commas or brackets in its strings, the count before the parser is the count of what json builds:
    the bound never refuses a text that holds no more values than the limit."""
    text = json.dumps(value)
    assert read_json(text, "v", max_bytes=1 << 10, max_values=_values(value)) == value
    with pytest.raises(InputError, match="JSON values"):
        read_json(text, "v", max_bytes=1 << 10, max_values=_values(value) - 1)
