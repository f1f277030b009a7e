"""A tiny front end for the calibration template and its checkpoint rules (:mod:`amppass.analysis.calibration`):
a chain of numpy ops, node ``n{i}`` computing ``OPS[i]`` of the value before it (the batch for ``n0``), whose
trial plans round the outputs of the nodes they run low to fp16."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from amppass.analysis.calibration import Calibration, Perturbation, Trials
from amppass.analysis.checkpoints import Checkpoints
from amppass.analysis.plan import Category, Decision, Precision, PrecisionPlan
from amppass.analysis.stats import CalibrationStats
from amppass.analysis.view import GraphView, OpView

OPS = [np.exp, np.sin, np.tanh, np.cos, np.sqrt, np.log1p, np.arctan, np.cosh]
NAMES = [f"n{i}" for i in range(len(OPS))]


def rounded(x: np.ndarray) -> np.ndarray:
    """``x`` stored in fp16 and read back."""
    return x.astype(np.float16).astype(np.float32)


def run_from(start: int, low: set[int], x: np.ndarray) -> np.ndarray:
    """The chain from node ``start`` on, fed ``x``, the nodes of ``low`` rounding their outputs to fp16."""
    for i in range(start, len(OPS)):
        x = OPS[i](x)
        x = rounded(x) if i in low else x
    return x


def view() -> GraphView:
    """The chain as the analysis sees it: every node LOW, reading the value before it."""
    return GraphView([OpView(name, op.__name__, Category.LOW, "chain", [f"v{i - 1}" if i else "x"], [f"v{i}"])
                      for i, (name, op) in enumerate(zip(NAMES, OPS, strict=False))], outputs=[f"v{len(OPS) - 1}"])


class Chain(Checkpoints[int]):
    """The checkpoint rule on the chain: checkpoint ``i`` keeps the one value live before node ``i``."""

    def __init__(self, checkpoints: Iterable[int]):
        super().__init__(checkpoints)
        self.resumed: list[tuple[int | None, int]] = []  # each run's (checkpoint it resumed from, first change)

    def record(self, batch: int | None, x: np.ndarray,
               seen: Callable[[int, np.ndarray], None] | None = None) -> np.ndarray:
        """The fp32 run of ``x``, keeping the value live at each checkpoint as it passes it on kept ``batch``
        (None: not kept); ``seen(i, value)`` hears of each node's value. Returns the output."""
        for i, op in enumerate(OPS):
            if batch is not None and i in self.order:
                self.keep(batch, i, {"in": x}, {f"v{i - 1}": x.nbytes})
            x = op(x)
            if seen is not None:
                seen(i, x)
        return x

    def run(self, low: set[int], batch: int, x: np.ndarray) -> np.ndarray:
        """Trial ``low`` on kept ``batch`` (input ``x``), from the checkpoint it resumes from where it has one."""
        start = self.resume(batch, self.cut((i not in low for i in range(len(OPS))), {i: i for i in self.order}))
        self.resumed.append((start, min(low, default=len(OPS))))
        if start is not None:
            x = self.values[batch][start]["in"]
        self.count(start or 0, len(OPS))
        return run_from(start or 0, low, x)


class ChainRunner:
    """The chain's half of the data pass (:class:`amppass.analysis.calibration.Runner`)."""

    def __init__(self, chain: Chain, replay: bool = False):
        self.data: Calibration[np.ndarray] = Calibration(CalibrationStats())
        self.chain, self.replay = chain, replay
        self.events: list[tuple] = []  # ("run", index, kept) and ("finish",), in the order they happen

    def batches(self, calibration: Iterable[Any]) -> Iterator[tuple[int, np.ndarray]]:
        """Each batch as a float32 array."""
        for index, batch in enumerate(calibration):
            yield index, np.asarray(batch, dtype=np.float32)

    def run(self, index: int, batch: np.ndarray, kept: int | None) -> list[np.ndarray] | None:
        """The fp32 chain on ``batch``, its values folded into the stats; on batch 0 with ``replay`` each node's
        local error (its output rounded) and each value's norm."""
        self.events.append(("run", index, kept))

        def seen(i: int, value: np.ndarray) -> None:
            self.data.stats.update(f"v{i}", value)
            if self.replay and index == 0:
                self.data.local_error[NAMES[i]] = float(np.linalg.norm(rounded(value) - value) / np.linalg.norm(value))
                self.data.norms[f"v{i}"] = float(np.linalg.norm(value))

        out = self.chain.record(kept, batch, seen)
        self.data.stats.batches += 1
        return None if kept is None else [out]

    def finish(self) -> None:
        """Nothing to derive: the event is recorded."""
        self.events.append(("finish",))


class ChainTrials(Trials[np.ndarray]):
    """The chain's half of the tolerance search's runs: from its checkpoints, or whole without them."""

    def __init__(self, data: Calibration[np.ndarray], chain: Chain | None):
        super().__init__(data)
        self.chain = chain
        self.reject = False  # the fp32 model rejects perturbed copies

    def run(self, plan: PrecisionPlan, decisions: Mapping[str, Decision],
            batches: Sequence[int]) -> Iterator[tuple[int, list[np.ndarray] | None]]:
        """Each batch through the chain with ``plan``'s low nodes rounding."""
        low = {i for i, name in enumerate(NAMES) if plan[name].precision is Precision.LOW}
        for b in batches:
            x = self.data.kept[b]
            yield b, [self.chain.run(low, b, x) if self.chain is not None else run_from(0, low, x)]

    def noisy(self, batch: np.ndarray) -> bool:
        """More than one element."""
        return batch.size > 1

    def perturb(self, batch: np.ndarray, how: Perturbation) -> np.ndarray:
        """``how`` applied to the array."""
        return how.apply(batch)

    def references(self, batches: list[np.ndarray]) -> list[list[np.ndarray]]:
        """The fp32 chain's outputs, unless it rejects the copies."""
        if self.reject:
            raise ValueError("rejected")
        return [[run_from(0, set(), x)] for x in batches]

    def checkpoints(self) -> list[Checkpoints]:
        """The chain's, where it has them."""
        return [self.chain] if self.chain is not None else []
