"""JSON from a file amppass did not write, read with bounds before and after the parser.

Every JSON value amppass takes from a model file (a ``.pt2``'s entries, an ONNX model's ``metadata_props``,
the decisions stored on nodes) comes through :func:`read_json`:

1. The text is bounded in size before ``json`` sees it: the caller names the largest size that entry can
   honestly have, so a file never makes the parser build more than that.
2. The value is bounded in the number of values it holds (``max_values``) before the parser runs, counted
   from the text (:func:`_most_values`: never fewer than json would build), and in nesting
   (:data:`MAX_DEPTH`) after it: the readers after this one walk what they are given, some of them recursively.
3. Every failure is an :class:`~amppass.errors.InputError` naming ``where`` and ending with ``fix``; never a
   ``ValueError``, ``RecursionError`` or ``MemoryError`` from the parser.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import InputError

MAX_DEPTH = 64  # nesting of any JSON value amppass reads from a file
_FIX = "the file is damaged or was edited: save the model again"


def read_json(data: bytes | str, where: str, *, max_bytes: int, max_values: int | None = None,
              fix: str = _FIX) -> Any:
    """``data`` (UTF-8 bytes or text) parsed as JSON within the bounds of the module docstring.

    ``max_values`` defaults to ``max_bytes // 2``: a JSON value takes at least two characters with its separator,
    so the default bounds nothing an honest file holds; a caller whose entry holds few values names fewer.
    """
    size = len(data)
    if size > max_bytes:
        raise InputError(f"{where} holds {size:,} {'bytes' if isinstance(data, bytes) else 'characters'} of "
                         f"JSON, more than the {max_bytes:,} amppass reads there; {fix}")
    limit = max_bytes // 2 if max_values is None else max_values
    most = _most_values(data)
    if most > limit:
        raise InputError(f"{where} may hold {most:,} JSON values (its commas and opening brackets), more than the "
                         f"{limit:,} amppass reads there; {fix}")
    kind = "UTF-8 JSON" if isinstance(data, bytes) else "valid JSON"
    try:
        value = json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)
    except RecursionError:  # json's parser recurses: thousands of levels stop it first
        raise InputError(f"{where} is not {kind} (RecursionError: it nests deeper than {MAX_DEPTH} levels); "
                         f"{fix}") from None
    except ValueError as err:  # UnicodeDecodeError is a ValueError
        raise InputError(f"{where} is not {kind} ({type(err).__name__}: {str(err)[:80]}); {fix}") from None
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if depth > MAX_DEPTH:
            raise InputError(f"{where} nests deeper than {MAX_DEPTH} levels; {fix}")
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        pending.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return value


def _most_values(data: bytes | str) -> int:
    """The most values JSON ``data`` can hold, counted without parsing: the top value, then one for each comma
    and each opening bracket (a container's first value) but those of empty containers (``[]``, ``{}``). Commas
    and brackets inside strings only raise the count (a ``[]`` in a string takes back its own ``[``), so it
    never falls short, and it is exact for compact JSON whose strings hold none."""
    if isinstance(data, bytes):
        counts = [data.count(mark) for mark in (b",", b"[", b"{", b"[]", b"{}")]
    else:
        counts = [data.count(mark) for mark in (",", "[", "{", "[]", "{}")]
    return 1 + sum(counts[:3]) - sum(counts[3:])

