"""Text that came from a model file, made safe to print on a terminal.

Node names, ops, reasons and metadata in a model file are the file author's text. Printed as they are, a
control character is an instruction to the terminal (clear the screen, set the window title, an OSC 8 link
that shows one address and opens another) and a bidirectional override reorders what the reader sees. So:

1. Every character Python does not call printable, except the plain space (controls, format and
   bidirectional marks, line and paragraph separators, surrogates, private-use and unassigned code points), is
   written as an escape: ``\\x1b``, ``\\u202e``, ``\\U000e0001``; a backslash as ``\\\\``, so that every
   backslash printed starts an escape and none can be forged.
2. Escaping comes first, shortening second, and shortening treats an escape as one unit: a shortened text
   never ends in half an escape.
3. Names shortened together stay apart (:func:`shorten_names`): what every name shares is dropped first, then
   the segments that tell one from another are kept whole (a layer's index, the last segment), so that rows of
   a table that named different nodes still read differently.
"""

from __future__ import annotations

import re

ELLIPSIS = "…"
_UNIT = re.compile(r"\\\\|\\x[0-9a-f]{2}|\\u[0-9a-f]{4}|\\U[0-9a-f]{8}|.", re.S)


def printable(text: str) -> str:
    """``text`` with every character a terminal could act on escaped (rule 1)."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(c if (c.isprintable() or c == " ") and c != "\\" else _escape(c) for c in text)


def elide(text: str, width: int) -> str:
    """``text`` (escaped by :func:`printable`) in at most ``width`` characters, its middle replaced by an
    ellipsis when longer; an escape is kept whole or left out."""
    if len(text) <= width:
        return text
    if width < 2:
        return ELLIPSIS[:width]
    units = _UNIT.findall(text)
    head = _fit(units, (width - 1) // 2)
    tail = _fit(units[len(head):][::-1], width - 1 - sum(map(len, head)))[::-1]
    return "".join(head) + ELLIPSIS + "".join(tail)


def cut(text: str, width: int) -> str:
    """``text`` (escaped by :func:`printable`) in at most ``width`` characters, its end replaced by an
    ellipsis when longer; an escape is kept whole or left out."""
    if len(text) <= width:
        return text
    return "".join(_fit(_UNIT.findall(text), max(width - 1, 0))) + ELLIPSIS[:width]


def shorten_names(names: list[str], width: int) -> list[str]:
    """``names`` (escaped by :func:`printable`) each in at most ``width`` characters, as distinct as they came.

    Where every name fits, each is as it came. A name is read as segments split at ``/`` (else ``.``, else
    ``_``). The leading segments every name shares are dropped, up to the first with a digit (``/m/encoder/...``
    loses ``/m/``). A name still too long has its segments abbreviated to their first
    character from the left, as logging libraries shorten class names, except its last segment and those with a
    digit (a layer's index): ``e/layer.3/a/o/LayerNorm/LayerNormalization``. Names that would read alike keep more
    segments whole, from the right, until they differ; what still does not fit loses the end of its last segment
    (the op column says the op), else its middle; names that still read alike are elided whole (:func:`elide`).
    """
    if all(len(n) <= width for n in names):
        return list(names)
    sep = next((c for c in "/._" if any(c in n for n in names)), "")
    split = [n.split(sep) if sep else [n] for n in names]
    shared = 0
    while len(split) > 1 and all(len(p) > shared + 1 and p[shared] == split[0][shared] for p in split) \
            and not any(c.isdigit() for c in split[0][shared]):  # a shared layer index still says where
        shared += 1
    split = [p[shared:] for p in split]
    whole: list[set[int]] = [set() for _ in names]
    shown = [_abbreviated(p, sep, width, w) for p, w in zip(split, whole, strict=False)]
    for _ in range(max((len(p) for p in split), default=0)):
        clashing = _clashes(shown, names)
        if not clashing:
            break
        for i in clashing:
            short = [j for j in range(len(split[i]) - 1) if j not in whole[i] and len(split[i][j]) > 1]
            whole[i].update(short[-1:])
            shown[i] = _abbreviated(split[i], sep, width, whole[i])
    for i in _clashes(shown, names):
        shown[i] = elide(sep.join(split[i]), width)
    return shown


def _abbreviated(segments: list[str], sep: str, width: int, whole: set[int]) -> str:
    """``segments`` joined, the earlier ones cut to their first character (or escape) from the left until the
    text fits ``width``, except the last, those with a digit, and those in ``whole``; then the last segment loses its
    end (or, where the rest leaves it no room, the whole its middle)."""
    parts = list(segments)
    for i in range(len(parts) - 1):
        if len(sep.join(parts)) <= width:
            break
        if i not in whole and not any(c.isdigit() for c in parts[i]):
            parts[i] = _UNIT.findall(parts[i])[0] if parts[i] else parts[i]
    head = sep.join(parts[:-1]) + sep if len(parts) > 1 else ""
    if len(head) + 3 <= width:  # the last segment loses its end, the index before it stays
        return head + cut(parts[-1], width - len(head))
    return elide(sep.join(parts), width)


def _clashes(shown: list[str], names: list[str]) -> list[int]:
    """The positions whose shortened text another, different name also got."""
    seen: dict[str, set[str]] = {}
    for text, name in zip(shown, names, strict=False):
        seen.setdefault(text, set()).add(name)
    return [i for i, text in enumerate(shown) if len(seen[text]) > 1]


def _fit(units: list[str], width: int) -> list[str]:
    """The longest prefix of ``units`` whose characters fit in ``width``."""
    taken, used = [], 0
    for unit in units:
        if used + len(unit) > width:
            break
        taken.append(unit)
        used += len(unit)
    return taken


def _escape(char: str) -> str:
    if char == "\\":
        return "\\\\"
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
