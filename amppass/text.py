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
