"""What ops cost on the device a plan is made for: the times profitability decides on, and the device facts it
times them with.

Profitability (:mod:`amppass.analysis.profitability`) runs a part of the plan in low precision only where that
is faster on the target device. The times it decides on come from a :class:`CostModel`: a cost table passed in
(a converted model's ``info["costs"]``), the device's timing cache (:mod:`amppass.targets.timing_cache`), the
times measured earlier in this process, or timings and estimates made now, each kept with where it came from.
:class:`DeviceFacts` is the device as profitability sees it: its fingerprint and timing cache, whether it runs
the low dtype natively (:func:`amppass.targets.device.native_low`), its cost prior (:mod:`amppass.targets.prior`),
and the interleaved timing of calls on it (:func:`amppass.targets.measure.interleaved`).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Mapping

import torch

from ..dtypes import LowType
from . import device as device_facts
from .measure import Timings, interleaved, probe
from .prior import Prior
from .timing_cache import TimingCache

log = logging.getLogger(__name__)

SPREAD_LIMIT = 0.25  # round ratios agree when their interquartile range is at most this share of their median
# (or the decision lies outside their median's 95% interval: amppass.targets.measure.agree)


class CostModel:
    """Times of ops on one device, each with where it came from (rule 2 of :mod:`amppass.analysis.profitability`).

    ``known`` (a table from a converted model's metadata) is consulted first, then ``cache`` (the device's
    :class:`~amppass.targets.timing_cache.TimingCache`) and the times measured earlier in this process."""

    _memory: dict[str, dict[str, float]] = {}  # per process, per device fingerprint: times measured here

    def __init__(self, known: Mapping[str, float] | None = None, cache: TimingCache | None = None):
        self.known = dict(known or {})
        self.cache = cache
        self.memory = CostModel._memory.setdefault(device_facts.digest(cache.fingerprint), {}) if cache else {}
        self.used: dict[str, float] = {}
        self.sources: dict[str, str] = {}
        self.fresh: dict[str, float] = {}  # measured now and trusted: for the caches

    def lookup(self, key: str) -> float | None:
        """The time of ``key`` from the table or a cache (recorded as used), or None."""
        if key not in self.used:
            stored = self.cache.entries if self.cache is not None else {}
            for source, table in (("table", self.known), ("cached", stored), ("cached", self.memory)):
                if key in table:
                    self.record(key, table[key], source)
                    break
            else:
                return None
        return self.used[key]

    def record(self, key: str, seconds: float, source: str) -> None:
        """Use ``seconds`` for ``key`` from now on; a measured time goes into the caches on :meth:`save`."""
        self.used[key] = round(float(seconds), 9)
        self.sources[key] = source
        if source == "measured":
            self.fresh[key] = self.used[key]

    def save(self) -> None:
        """Store the times measured since the last save in this process's and the device's cache."""
        self.memory.update(self.fresh)
        if self.cache is not None:
            self.cache.add(self.fresh)
        self.fresh = {}

    def table(self) -> dict[str, float]:
        """Every time this model's decisions used, in seconds rounded to nanoseconds, for the metadata."""
        return dict(sorted(self.used.items()))


class DeviceFacts:
    """The target device as profitability needs it: its fingerprint and timing cache, whether it runs the
    low dtype natively, (on demand) its cost prior, and the timing of calls on it. The probe is kept (in this
    process and the timing cache) the first time other load leaves it undisturbed; until then each conversion
    that needs it takes it again."""

    _probes: dict[tuple[str, str], dict[str, float]] = {}  # per process: (fingerprint digest, dtype) -> probe

    def __init__(self, device: torch.device, low: LowType, found: dict[str, Any] | None = None,
                 cache: TimingCache | None = None):
        self.device, self.low = device, low
        self.fingerprint = found if found is not None else device_facts.fingerprint(device)
        self.cache = cache if cache is not None else TimingCache(self.fingerprint)
        self.sync = torch.cuda.synchronize if device.type == "cuda" else None
        self.native = device_facts.native_low(self.fingerprint, low, self._probed(measure=False))
        if not self.native.known:
            self.native = device_facts.native_low(self.fingerprint, low, self._probed(measure=True))
        self._prior: Prior | None = None

    @property
    def kind(self) -> str:
        """The device's kind as a reason names it ("CPU", "CUDA")."""
        return self.device.type.upper()

    def time(self, calls: list[Callable[[], Any]], sides: list[int | None], settled: Callable[[list[float]], bool],
             max_rounds: int, weights: list[int] | None = None) -> Timings:
        """``calls`` timed in interleaved rounds on this device (:func:`amppass.targets.measure.interleaved`)."""
        return interleaved(calls, sides, settled, max_rounds, weights=weights, sync=self.sync)

    def prior(self) -> Prior:
        """The device's prior (:mod:`amppass.targets.prior`): from the probe where it can be trusted."""
        if self._prior is None:
            probed = self._probed(measure=True)
            self._prior = Prior.from_probe(probed) if probed else Prior.default(self.native.native)
        return self._prior

    def _probed(self, measure: bool) -> dict[str, float] | None:
        """The probe's numbers from the cache or this process; with ``measure``, taken now where missing
        (and kept only if undisturbed by other load)."""
        prefix = f"probe|{self.low.name}|"
        stored = {**{k[len(prefix):]: v for k, v in self.cache.entries.items() if k.startswith(prefix)},
                  **DeviceFacts._probes.get((device_facts.digest(self.fingerprint), self.low.name), {})}
        if len(stored) == 4 or not measure:
            return stored if len(stored) == 4 else None
        found, ratio_spread = probe(self.device, self.low)
        if ratio_spread > SPREAD_LIMIT:
            how = (f"its rounds spread {ratio_spread:.0%}" if math.isfinite(ratio_spread)
                   else "no round of it was undisturbed")
            log.info("profitability: the device probe was disturbed by other load (%s); not kept", how)
            return None
        DeviceFacts._probes[(device_facts.digest(self.fingerprint), self.low.name)] = found
        self.cache.add({prefix + k: v for k, v in found.items()})
        return found

    def describe(self) -> dict[str, Any]:
        """What the report says about the device: native support and why, the fingerprint, the cache."""
        return {"native_low": self.native.native, "why": self.native.reason,
                "fingerprint": device_facts.digest(self.fingerprint), "timing_cache": self.cache.describe()}


def forget() -> None:
    """Forget the times and probes measured in this process (the timing cache on disk is kept): the next
    conversion starts from the cache alone, as a new process would."""
    CostModel._memory.clear()
    DeviceFacts._probes.clear()
