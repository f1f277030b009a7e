"""Checkpoints: where calibration keeps the fp32 values the tolerance search's trials resume from.

A trial of the tolerance search (:mod:`amppass.analysis.calibration`) computes exactly what the fp32 model computed
on the same batch up to the first node it changes (a node run in low precision, a cast, a weight stored low), so
that prefix need not run again. The rules, front-end neutral (:class:`Checkpoints`); a front end
(:mod:`amppass.fx.runners.trial_runs`, :mod:`amppass.onnx.trial_runs`) supplies what is its own: which values are
live at a node and their sizes, which of its nodes a trial leaves unchanged, and how to run a trial from a
checkpoint.

1. Placement (:func:`place`): at most :data:`CHECKPOINTS` of the search's candidate nodes, spread evenly over
   them in graph order. A front end leaves out the nodes it cannot resume from, before placement (FX: inside
   an aliasing group's writes) or after it (ONNX: where a live value is untyped or a graph output).
2. Budget (:meth:`Checkpoints.keep`): on each kept batch, the values live at a checkpoint are kept, a value
   once for all the checkpoints of that batch it crosses, while the values kept for every batch together fit
   :data:`CACHE_BYTES`; a checkpoint whose new values would pass it is not kept for that batch.
3. Resume (:meth:`Checkpoints.cut`, :meth:`Checkpoints.resume`): a trial's cut is the last checkpoint at or
   before the first node it changes; each batch resumes from its latest kept checkpoint at or before the cut,
   or runs the whole trial where it kept none. The result is the whole trial's, to the bit: the values fed
   are the ones the fp32 nodes computed.
4. Reuse (:meth:`Checkpoints.count`, :meth:`amppass.analysis.calibration.Trials.reused`): the nodes each run
   skipped and ran, for the share of the search's node runs that read kept values instead (``tolerance_reused``
   in the report).
"""

from __future__ import annotations

from typing import Any, Generic, Hashable, Iterable, Mapping, Sequence, TypeVar

CHECKPOINTS = 16  # at most this many places where calibration keeps fp32 values for the search's trials
CACHE_BYTES = 256 * 2**20  # at most this many bytes of those values over all batches

K = TypeVar("K", bound=Hashable)  # how a front end names a checkpoint: a node name (FX), a position (ONNX)


def place(candidates: Sequence[K]) -> list[K]:
    """Rule 1: at most :data:`CHECKPOINTS` of ``candidates`` (in graph order), spread evenly over them."""
    step = max(1, len(candidates) // CHECKPOINTS)
    return list(candidates[step // 2::step][:CHECKPOINTS])


class Checkpoints(Generic[K]):
    """The fp32 values kept at the checkpoints of one graph, per kept batch (the module docstring's checkpoint
    rules)."""

    def __init__(self, checkpoints: Iterable[K]):
        self.order = {checkpoint: i for i, checkpoint in enumerate(checkpoints)}  # in graph order
        self.values: dict[int, dict[K, dict[str, Any]]] = {}  # batch -> checkpoint -> value name -> value
        self.bytes = 0
        self.nodes_skipped = 0
        self.nodes_run = 0
        self._held: dict[int, set[Hashable]] = {}  # batch -> the values kept for it, by the keys of keep's sizes

    def keep(self, batch: int, checkpoint: K, live: dict[str, Any], sizes: Mapping[Hashable, int]) -> bool:
        """Rule 2: keep ``live`` (the values live at ``checkpoint`` on kept ``batch``) unless the ones not yet
        kept for this batch would pass the budget; ``sizes`` gives each value's bytes, keyed by what makes two
        values the same (a value kept at an earlier checkpoint of the batch costs nothing again). Whether it
        was kept."""
        held = self._held.setdefault(batch, set())
        fresh = {key: size for key, size in sizes.items() if key not in held}
        if self.bytes + sum(fresh.values()) > CACHE_BYTES:
            return False
        self.bytes += sum(fresh.values())
        held.update(fresh)
        self.values.setdefault(batch, {})[checkpoint] = live
        return True

    def cut(self, unchanged: Iterable[bool], position: Mapping[K, int]) -> K | None:
        """Rule 3: the last checkpoint at or before the first node a trial changes, or None.

        ``unchanged`` says for the trial's nodes in order whether each computes what the fp32 node did (read up
        to the first that does not); ``position`` gives each checkpoint's index in that order.
        """
        first = 0
        for same in unchanged:
            if not same:
                break
            first += 1
        reached = [checkpoint for checkpoint in self.order if checkpoint in position and position[checkpoint] <= first]
        return max(reached, key=position.__getitem__, default=None)

    def resume(self, batch: int, cut: K | None) -> K | None:
        """Rule 3: the checkpoint kept ``batch`` resumes a trial from, given the trial's ``cut``: its latest kept
        one at or before the cut, or None (the whole trial runs)."""
        if cut is None:
            return None
        kept = [c for c in self.values.get(batch, {}) if self.order[c] <= self.order[cut]]
        return max(kept, key=self.order.__getitem__, default=None)

    def count(self, skipped: int, total: int, batches: int = 1) -> None:
        """Rule 4: ``batches`` runs of a trial of ``total`` nodes, each leaving out ``skipped`` of them."""
        self.nodes_skipped += batches * skipped
        self.nodes_run += batches * (total - skipped)
