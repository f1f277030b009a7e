"""Keep torch quiet while amppass captures a model, unless the user asked for detail.

A failed ``torch.export`` logs fake-tensor and symbolic-shape warnings and prints the partial graph
straight to ``sys.stderr``, 40-60 lines before amppass raises one :class:`~amppass.errors.CaptureError`
that says what failed and what to do; the retries with other dynamic shapes repeat them. Inside
:func:`quiet_torch`:

- the ``torch`` logger's level is raised above CRITICAL, so its children that inherit it (all of them,
  unless ``TORCH_LOGS`` or ``torch._logging.set_logs`` gave one a level of its own) say nothing;
- what the capturing thread writes to ``sys.stderr`` (torch's prints, Python warnings) is dropped; other
  threads' writes go through.

Both are restored on the way out. ``AMPPASS_DEBUG=1`` in the environment, or the ``amppass`` logger
enabled for DEBUG (``logging.getLogger("amppass").setLevel(logging.DEBUG)``), leaves torch as it is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from typing import Any, Iterator, TextIO

DEBUG_ENV = "AMPPASS_DEBUG"

_lock = threading.Lock()
_depth: dict[int, int] = {}  # quiet thread id -> nesting depth
_saved_level = logging.NOTSET  # the torch logger's own level, while any thread is quiet
_installed: _MutedStream | None = None  # the sys.stderr this module put in place


def wants_detail() -> bool:
    """Whether the user asked to see torch's own capture logs (module docstring)."""
    return os.environ.get(DEBUG_ENV, "").strip() not in ("", "0") or \
        logging.getLogger("amppass").isEnabledFor(logging.DEBUG)


@contextlib.contextmanager
def quiet_torch() -> Iterator[None]:
    """Silence torch's logging and this thread's stderr for the duration (module docstring)."""
    if wants_detail():
        yield
        return
    _enter()
    try:
        yield
    finally:
        _exit()


class _MutedStream:
    """``sys.stderr`` as it was, except that writes from quiet threads are dropped."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> int:
        if threading.get_ident() in _depth:
            return len(text)
        return self.stream.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, ... of the real stream
        return getattr(self.stream, name)


def _enter() -> None:
    global _saved_level, _installed
    with _lock:
        if not _depth:
            torch_logger = logging.getLogger("torch")
            _saved_level = torch_logger.level
            torch_logger.setLevel(logging.CRITICAL + 1)
            _installed = sys.stderr = _MutedStream(sys.stderr)
        ident = threading.get_ident()
        _depth[ident] = _depth.get(ident, 0) + 1


def _exit() -> None:
    global _installed
    with _lock:
        ident = threading.get_ident()
        _depth[ident] -= 1
        if not _depth[ident]:
            del _depth[ident]
        if not _depth:
            logging.getLogger("torch").setLevel(_saved_level)
            if sys.stderr is _installed:  # unless someone replaced it meanwhile
                sys.stderr = _installed.stream
            _installed = None
