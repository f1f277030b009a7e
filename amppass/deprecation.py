"""Old module paths kept for a release after a move: each still gives what it gave, and warns where it is read.

A module that moved leaves at its old path a module of a docstring (naming the new home and the release that
removes the old path) and one line::

    __getattr__ = moved(__name__, "0.2.0", amppass_backend="amppass.pipelines.backend")

Reading a name from the old path (``from amppass.fx.backend import amppass_backend``, ``amppass.fx.backend.name``, an
entry point ``amppass.fx.backend:amppass_backend``) gives the object its new home holds and emits a
:class:`DeprecationWarning` naming the new home and the release the old path is removed in, at the line that read it.
Nothing warns where nothing reads the old path. tests/test_layering.py fails once ``amppass.__version__`` reaches that
release, so the old path is deleted when it said it would be.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable


def moved(old: str, removed_in: str, **homes: str) -> Callable[[str], Any]:
    """The module ``__getattr__`` (PEP 562) of the old path ``old``: ``homes`` maps each name the old path still gives
    to the module that holds it now; the old path goes away in amppass ``removed_in``."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(f"{old}.{name} has moved to {home}.{name}: import it from there; {old} will be removed in "
                      f"amppass {removed_in}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), name)

    __getattr__.homes = dict(homes)  # type: ignore[attr-defined]  # what tests/test_layering.py checks
    __getattr__.removed_in = removed_in  # type: ignore[attr-defined]
    return __getattr__
