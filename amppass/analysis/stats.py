"""Streaming per-value statistics over calibration batches, front-end neutral.

Each value of the :class:`~amppass.analysis.view.GraphView` (keyed by its view name) gets one
:class:`ValueStats` that folds every batch in as it is seen, so memory does not grow with the number of
batches. Tensors come from torch (FX front end) or numpy (ONNX front end, through onnxruntime).

Thresholds, all for fp16 (bf16 shares fp32's range, so only the counts are kept for it):

- *below normal*: non-zero ``|x| < 6.1e-5`` (fp16's smallest normal): such values keep fewer mantissa bits.
- *flush*: non-zero ``|x| < 2**-25`` (half fp16's smallest subnormal): such values round to zero in fp16.
- *above headroom*: ``|x| > 65504 / HEADROOM``. Calibration samples the input distribution; a value within a
  factor ``HEADROOM`` (2, one binade) of fp16's largest finite value on calibration data is taken to
  overflow on some other input, so the range rules use the same margin.
- *sampling*: ``absmax``, NaN/inf, sentinels and the counts beyond the headroom read every element (one
  pass: ``aminmax``); the small-value counts (zeros, below normal, flush) and ``min_nonzero`` read an evenly
  strided sample of at most ``SAMPLE`` elements per tensor, so statistics cost about one memory pass per
  value and shares below normal are estimates (``sampled`` says over how many elements).
- *sentinels*: finite values with ``|x| >= 1e38``, which models write to mean minus infinity (attention
  masks filled with ``finfo(float32).min``). They are counted apart and kept out of ``absmax``: cast to fp16
  they become the infinity they stand for, and the rewrite saturates them where a kernel needs finite values.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from ..dtypes import FP16_MAX, FP16_MIN_NORMAL, FP16_MIN_SUBNORMAL

HEADROOM = 2.0
FLUSH_LIMIT = FP16_MIN_SUBNORMAL / 2
SENTINEL = 1e38
SAMPLE = 1 << 16


@dataclass
class ValueStats:
    """What the calibration batches showed about one value; every field is a running aggregate."""

    tensors: int = 0  # tensors folded in (one per batch, more for ops returning several)
    count: int = 0  # elements seen (sentinels, NaN and inf included)
    numel: int = 0  # elements of the first tensor of the last batch: reduction depths are read from it
    absmax: float = 0.0  # largest finite magnitude, sentinels left out
    sampled: int = 0  # elements the small-value fields below were read from
    min_nonzero: float = math.inf  # in the sample
    zeros: int = 0  # in the sample
    below_normal: int = 0  # in the sample
    flush: int = 0  # in the sample
    above_headroom: int = 0
    above_max: int = 0
    sentinels: int = 0
    nan: bool = False
    inf: bool = False

    @property
    def share_below_normal(self) -> float:
        """Share of the non-zero values below fp16's smallest normal (estimated from the sample)."""
        nonzero = self.sampled - self.zeros
        return self.below_normal / nonzero if nonzero else 0.0

    @property
    def share_above_headroom(self) -> float:
        """Share of all values beyond ``65504 / HEADROOM``."""
        return self.above_headroom / self.count if self.count else 0.0

    def update(self, value: Any, first: bool = True) -> None:
        """Fold one tensor (torch or numpy, any floating dtype) into the aggregate.

        ``first`` is False for the second and later tensors of an op that returns several in one batch.
        """
        tensor = as_tensor(value)
        if tensor is None:
            return
        self.tensors += 1
        if first:
            self.numel = tensor.numel()
        self.count += tensor.numel()
        if not tensor.numel():
            return
        top = _absmax(tensor.detach())
        a = None
        if not math.isfinite(top) or top >= SENTINEL:
            # rare path (masks, broken batches): split off NaN, inf and sentinels before the range counts
            a = tensor.detach().abs()
            self.nan |= bool(torch.isnan(a).any())
            self.inf |= bool(torch.isinf(a).any())
            self.sentinels += int(torch.count_nonzero(torch.isfinite(a) & (a >= SENTINEL)))
            a = a[a < SENTINEL]
            top = float(a.amax()) if a.numel() else 0.0
        self.absmax = max(self.absmax, top)
        if top > FP16_MAX / HEADROOM:
            a = tensor.detach().abs() if a is None else a
            self.above_headroom += int(torch.count_nonzero(a > FP16_MAX / HEADROOM))
            self.above_max += int(torch.count_nonzero(a > FP16_MAX))
        # the sample is small: numpy reads it single-threaded, without a parallel launch per tiny op
        flat = (a if a is not None else tensor.detach()).reshape(-1)
        sample = np.abs(flat[:: max(1, flat.numel() // SAMPLE)].float().cpu().numpy())
        sample = sample[sample < SENTINEL]
        nonzero = sample[sample > 0]
        small = nonzero[nonzero < FP16_MIN_NORMAL]
        self.sampled += sample.size
        self.zeros += sample.size - nonzero.size
        self.below_normal += small.size
        self.flush += int(np.count_nonzero(small < FLUSH_LIMIT))
        if nonzero.size:
            self.min_nonzero = min(self.min_nonzero, float(nonzero.min()))

    def merge(self, other: "ValueStats") -> None:
        """Fold in what ``other`` saw of the same value (batches another capture of the graph ran)."""
        if not self.tensors:
            self.numel = other.numel
        for name in ("tensors", "count", "sampled", "zeros", "below_normal", "flush", "above_headroom", "above_max",
                     "sentinels"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.absmax = max(self.absmax, other.absmax)
        self.min_nonzero = min(self.min_nonzero, other.min_nonzero)
        self.nan |= other.nan
        self.inf |= other.inf

    def to_dict(self) -> dict[str, Any]:
        """Plain numbers for evidence and reports."""
        result = asdict(self)
        result["share_below_normal"] = self.share_below_normal
        result["share_above_headroom"] = self.share_above_headroom
        return result


class CalibrationStats:
    """:class:`ValueStats` by view value name, plus how many batches were folded in."""

    def __init__(self) -> None:
        self._values: dict[str, ValueStats] = {}
        self.batches = 0

    def update(self, name: str, value: Any) -> None:
        """Fold ``value`` (a tensor, array, or a tuple/list of them: every floating leaf) into ``name``."""
        stats = self._values.setdefault(name, ValueStats())
        for i, leaf in enumerate(_floating_leaves(value)):
            stats.update(leaf, first=i == 0)

    def alias(self, name: str, source: str) -> None:
        """Record that ``name`` holds ``source``'s elements (a reshape or permutation): they share one aggregate."""
        self._values[name] = self._values[source]

    def absorb(self, other: "CalibrationStats", names: Iterable[str]) -> None:
        """Fold ``other``'s stats of ``names`` into the stats of the same names here (the values two captures
        of one model share), and count its batches. Aliases stay shared: an aggregate is folded in once."""
        folded: set[tuple[int, int]] = set()
        for name in names:
            theirs = other.get(name)
            if theirs is None:
                continue
            mine = self._values.setdefault(name, ValueStats())
            if (id(theirs), id(mine)) not in folded:
                mine.merge(theirs)
                folded.add((id(theirs), id(mine)))
        self.batches += other.batches

    def get(self, name: str) -> ValueStats | None:
        """The stats of ``name``, or None if it was never seen (a weight, or a value of no float type)."""
        return self._values.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __len__(self) -> int:
        return len(self._values)

    def items(self) -> Iterator[tuple[str, ValueStats]]:
        """(value name, stats) pairs in the order values were first seen."""
        return iter(self._values.items())


def as_tensor(value: Any) -> torch.Tensor | None:
    """A torch view of a floating torch tensor or numpy array (no copy for numpy); None for anything else."""
    if isinstance(value, np.ndarray):
        if not np.issubdtype(value.dtype, np.floating):
            return None
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value
    return None


def _absmax(tensor: torch.Tensor) -> float:
    """max |x| in one pass (NaN if any); numpy on CPU: one thread, no parallel launch, so it stays cheap
    on a busy machine where torch's thread pool waits for cores."""
    if tensor.device.type == "cpu" and tensor.dtype in (torch.float16, torch.float32, torch.float64):
        array = tensor.numpy()
        low, high = array.min(), array.max()
    else:
        low, high = torch.aminmax(tensor)
    return max(-float(low), float(high))


def _floating_leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from _floating_leaves(item)
    elif as_tensor(value) is not None:
        yield value
