"""What the training benchmarks share: what an amppass row actually trained in, and the threads of a quick run.

A train-mode plan for speed (``plan_for='speed'``, every entry point's default) on a device without native
arithmetic for the low dtype (a CPU without bf16/fp16 instructions) keeps the original fp32 model, decided before
capture by :func:`amppass.analysis.profitability.fp32_by_device`, which logs one warning with the device's reason.
A row named "amppass bf16" would then measure plain fp32: the training benchmarks watch for that warning while a
variant converts and say in a ``trained`` column what ran, with the reason the warning gave (nothing hard-coded
about this CPU).

A ``--quick`` run is a smoke test with a budget of CPU seconds: it trains on one torch thread (:func:`threads`),
since on a shared machine idle intra-op threads spin, burning CPU seconds that measure nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator

import torch

_LOGGER = "amppass.analysis.profitability"


class DeviceRule(logging.Handler):
    """While installed: the reason the device rule gave each time it kept a train-mode plan fp32, by thread name
    (a benchmark that interleaves its variants trains each in a thread of its own)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reasons: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.funcName == "fp32_by_device":  # its arguments: the model's name, the device's reason, the advice
            self.reasons[record.threadName] = str(record.args[1])

    def trained(self, dtype: str, thread: str | None = None) -> str:
        """``dtype`` where the variant trained in it; where the device rule kept it fp32 (in ``thread``, this one
        by default), "fp32" with the reason's first clause."""
        reason = self.reasons.get(thread or threading.current_thread().name)
        return dtype if reason is None else f"fp32: kept by the device rule ({reason.split(':')[0]})"


@contextlib.contextmanager
def watched() -> Iterator[DeviceRule]:
    """A :class:`DeviceRule` listening for the block."""
    logger, handler = logging.getLogger(_LOGGER), DeviceRule()
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def threads(quick: bool) -> Iterator[None]:
    """One torch intra-op thread for the block when ``quick``, the number set before otherwise; restored after."""
    before = torch.get_num_threads()
    if quick:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
