"""Caps on what amppass reads from a file, which a user raises or lowers from the environment.

A cap bounds what an untrusted file can make amppass copy, parse or walk (a .pt2 file's bytes, an ONNX model's
nodes); a real model past it is rare, and its user sets the cap's environment variable rather than edit code.
"""

from __future__ import annotations

import os

from .errors import InputError


def env_cap(variable: str, default: int, meaning: str, example: int) -> int:
    """The cap ``$variable`` sets, or ``default`` where it is unset or blank: a whole number above 0, written with
    ``_`` or ``,`` between digits if the user likes. Anything else is an InputError naming the variable and its
    value, what it caps (``meaning``: "the most nodes a model may hold"), an ``example`` setting and the default."""
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    try:
        limit = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        limit = 0
    if limit < 1:
        raise InputError(f"{variable}={text[:40]!r} is not a whole number above 0; set it to {meaning} (e.g. "
                         f"{variable}={example}), or unset it for the default {default:,}")
    return limit
