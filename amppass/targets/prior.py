"""A prior for a device: op times estimated from four numbers, where measuring cannot be trusted.

When the machine is too busy for a region's interleaved timings to agree (:mod:`amppass.analysis.profitability`), and no
table or cache holds them, the region is decided on estimates instead of being kept fp32 blindly. An op's
estimated time is a call overhead, plus its multiply-accumulates (:func:`amppass.fx.view.macs.node_macs`)
at the device's matrix-product rate for the dtype, plus the bytes its float operands and results occupy at
the device's copy rate: the roofline of the op, added rather than maxed, which never makes low precision
look better than it is. A cast costs the overhead plus the bytes it reads and writes.

The four numbers come from the device probe (:func:`amppass.targets.measure.probe`, taken once per device and
stored in the timing cache) where it could be trusted, else from defaults by what the device's flags say
(:data:`DEFAULTS`): a CPU with native low-precision arithmetic multiplies twice as fast in it as in fp32
(AMX is faster still; the prior stays on the side of fp32), one without it thirty times slower.
"""

from __future__ import annotations

from dataclasses import dataclass

from .measure import PROBE_COPY, PROBE_SIZE

# seconds per fp32 multiply-accumulate (about 50 GMAC/s), per byte moved (10 GB/s), per call (5 µs)
_FP32_MAC_S, _BYTE_S, _CALL_S = 2e-11, 1e-10, 5e-6
DEFAULTS = {True: 0.5, False: 30.0}  # native low precision -> low MAC time / fp32 MAC time


@dataclass(frozen=True)
class Prior:
    """Per-unit costs on one device (module docstring); ``source`` says where they come from."""

    fp32_mac_s: float
    low_mac_s: float
    byte_s: float
    call_s: float
    source: str

    @classmethod
    def from_probe(cls, probed: dict[str, float]) -> "Prior":
        """The costs per unit from the device probe's timings (seconds per GEMM, per copy, per call)."""
        macs = PROBE_SIZE ** 3
        copied = PROBE_COPY * 4 * 2  # the probe's clone reads and writes that many fp32 values
        return cls(probed["gemm_fp32"] / macs, probed["gemm_low"] / macs, probed["copy_fp32"] / copied,
                   probed["call"], "the device probe")

    @classmethod
    def default(cls, native: bool) -> "Prior":
        """Fixed costs for a device not probed: low MACs faster than fp32 where ``native``, far slower without."""
        return cls(_FP32_MAC_S, _FP32_MAC_S * DEFAULTS[native], _BYTE_S, _CALL_S,
                   f"defaults for a device {'with' if native else 'without'} native low-precision arithmetic")

    def op(self, macs: int, float_values: int, low: bool, low_bytes: int) -> float:
        """Estimated seconds of an op doing ``macs`` multiply-accumulates over ``float_values`` float values
        (operands and results), in fp32 or in the low dtype of ``low_bytes`` bytes per value."""
        per_mac = self.low_mac_s if low else self.fp32_mac_s
        return self.call_s + macs * per_mac + float_values * (low_bytes if low else 4) * self.byte_s

    def cast(self, values: int, low_bytes: int) -> float:
        """Estimated seconds of casting ``values`` values between fp32 and the low dtype."""
        return self.call_s + values * (4 + low_bytes) * self.byte_s
