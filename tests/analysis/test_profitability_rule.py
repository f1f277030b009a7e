"""The front-end-neutral profitability rule (amppass.analysis.profitability) on a fake timing source.

No kernel is timed: each region's calls do nothing, and the fake device answers every timing with the
rounds a test gives it, so the decisions asserted here (which side is faster, the margin, disagreeing rounds
and a busy machine falling back to the prior) do not depend on this machine's load.
"""

from __future__ import annotations

import pytest

from amppass.analysis import profitability
from amppass.analysis.plan import Category, Decision, Precision, Source
from amppass.analysis.profitability import MARGIN, Profitability, Region, TimedCall
from amppass.dtypes import low_type
from amppass.targets.cost_model import CostModel
from amppass.targets.device import Native
from amppass.targets.measure import Timings
from amppass.targets.prior import Prior

BF16 = low_type("bf16")
FP32_S = 1e-4  # every fp32 kernel the fake device times takes this long
CATEGORIES = {"mm": Category.LOW, "relu": Category.FOLLOW}
REGION = Region(("mm", "relu"), ("x",), ("relu",))  # a matrix product and the ReLU after it, cast in and out


class FakeDevice:
    """A timing source that answers each timing with the next of ``rounds``: the ratios of the undisturbed
    rounds (low kernels and casts over fp32), every fp32 kernel taking :data:`FP32_S`."""

    kind = "CPU"

    def __init__(self, *rounds: list[float], native: bool = True, prior: Prior | None = None):
        self.rounds = list(rounds)
        self.native = Native(native, True, "this test CPU has native bf16" if native else "this test CPU has no bf16")
        self._prior = prior or Prior(2e-11, 1e-11, 1e-10, 5e-6, "a test prior where bf16 is faster")
        self.timed: list[list[int | None]] = []  # the sides of each timing asked for

    def prior(self) -> Prior:
        """The prior a test gave, or one where bf16 multiplies twice as fast."""
        return self._prior

    def time(self, calls, sides, settled, max_rounds, weights=None) -> Timings:
        """The next rounds, as interleaved timing finds them: fp32 kernels at FP32_S, the rest at the ratio."""
        self.timed.append(list(sides))
        ratios = self.rounds.pop(0)
        low = FP32_S * (ratios[0] if ratios else 1.0)
        return Timings([FP32_S if side == 0 else low for side in sides], ratios, max(len(ratios), 3))


def calls(region: Region, low_raises: bool = False, fp32_raises: bool = False) -> list[TimedCall]:
    """The region's calls as a front end builds them: each node in fp32 and in bf16, then its casts."""
    def fine() -> None:
        """A kernel that runs."""

    def broken() -> None:
        """A kernel that raises, as a missing one does."""
        raise RuntimeError("no kernel for this dtype")

    found = []
    for node in region.nodes:
        key = f"{node}|f32[64,64]|{id(region)}"
        found.append(TimedCall(f"{key}|fp32", "fp32", broken if fp32_raises else fine,
                               lambda prior: prior.op(64 ** 3, 3 * 64 * 64, False, 2), node))
        found.append(TimedCall(f"{key}|low", "low", broken if low_raises and node == "mm" else fine,
                               lambda prior: prior.op(64 ** 3, 3 * 64 * 64, True, 2), node))
    for value in (*region.cast_in, *region.cast_out):
        found.append(TimedCall(f"cast|{value}|{id(region)}", "cast", fine,
                               lambda prior: prior.cast(64 * 64, 2)))
    return found


def decide(rule: Profitability, *found: Region, given: dict[str, Decision] | None = None, **options):
    """The rule's decisions and records for ``found`` (default: :data:`REGION`)."""
    return rule.decide(found or (REGION,), lambda region: calls(region, **options), CATEGORIES, given or {})


def test_a_region_slower_low_is_kept_fp32_with_both_times_in_its_reason():
    rule = Profitability(CostModel(), FakeDevice([1.5] * 9), BF16)
    decisions, records = decide(rule)
    assert set(decisions) == {"mm"}  # its LOW node; painting then runs the ReLU fp32 too
    decision = decisions["mm"]
    assert decision.precision is Precision.FP32 and decision.source is Source.PROFITABILITY
    assert decision.rule == "profitability" and "(measured); runs fp32" in decision.reason
    assert "on this CPU its region of 2 node(s)" in decision.reason and "for 2 cast(s)" in decision.reason
    assert records == [{"first": "mm", "nodes": 2, "timing": "measured", "fp32_us": 200.0, "low_us": 150.0,
                        "casts_us": 150.0, "runs": "fp32"}]
    assert decision.evidence == {"rule": "profitability", "timing": "measured", "low_us": 150.0, "casts_us": 150.0,
                                 "fp32_us": 200.0, "region": 2}


def test_a_region_faster_low_runs_low_and_its_times_are_kept_for_the_cache():
    costs = CostModel()
    rule = Profitability(costs, FakeDevice([0.5] * 9), BF16)
    decisions, records = decide(rule)
    assert decisions == {} and records[0]["runs"] == "bf16" and records[0]["timing"] == "measured"
    assert records[0]["low_us"] + records[0]["casts_us"] == pytest.approx(0.5 * records[0]["fp32_us"])
    assert set(costs.memory) == set(costs.used) and set(costs.sources.values()) == {"measured"}


@pytest.mark.parametrize("saved, runs", [(MARGIN - 0.01, "fp32"), (MARGIN + 0.01, "bf16")])
def test_low_must_save_the_margin_of_fp32_s_time(saved, runs):
    """A region saving less than MARGIN of its fp32 time runs fp32: timing noise never flips a near-even one."""
    rule = Profitability(CostModel(), FakeDevice([1 - saved] * 9), BF16)
    decisions, records = decide(rule)
    assert records[0]["runs"] == runs and bool(decisions) == (runs == "fp32")


def test_rounds_that_do_not_agree_fall_back_to_the_prior_and_nothing_is_cached():
    """Undisturbed rounds on both sides of the margin tell nothing: the region is decided on the prior."""
    slow_prior = Prior(1e-11, 4e-11, 1e-10, 5e-6, "a test prior where bf16 is slower")
    costs = CostModel()
    rule = Profitability(costs, FakeDevice([0.5, 1.5, 0.6, 1.4, 0.5, 1.6], prior=slow_prior), BF16)
    decisions, records = decide(rule)
    assert records[0]["timing"] == "prior" and records[0]["runs"] == "fp32"
    assert "estimated from the device prior" in decisions["mm"].reason
    assert costs.memory == {} and set(costs.sources.values()) == {"prior"}
    assert rule.misses == 0 and not rule.too_busy  # the rounds were undisturbed: the machine is not too busy


def test_a_machine_too_busy_to_time_stops_timing_and_estimates_the_rest(monkeypatch):
    """After GIVE_UP regions in a row with no undisturbed round, the remaining regions are not timed at all."""
    monkeypatch.setattr(profitability, "GIVE_UP", (3, 0.0))  # the count alone, not the seconds it took
    device = FakeDevice([], [], [], [], [])
    rule = Profitability(CostModel(), device, BF16)
    found = [Region((f"mm{i}",), (), ()) for i in range(5)]  # no casts: the prior has bf16 win
    categories = {f"mm{i}": Category.LOW for i in range(5)}
    _, records = rule.decide(found, calls, categories, {})
    assert len(device.timed) == 3 and rule.misses == 3 and rule.too_busy
    assert [r["timing"] for r in records] == ["prior"] * 5
    assert all(r["runs"] == "bf16" for r in records)


def test_a_device_without_native_low_precision_runs_fp32_without_timing():
    device = FakeDevice(native=False)
    decisions, records = decide(Profitability(CostModel(), device, BF16))
    assert device.timed == [] and records == [{"first": "mm", "nodes": 2, "timing": "device", "runs": "fp32"}]
    assert decisions["mm"].reason == "profitability: this test CPU has no bf16; runs fp32 (not timed)"


def test_a_given_table_decides_without_timing_and_names_its_source():
    table = {call.key: (2e-4 if call.kind == "low" else 1e-4) for call in calls(REGION)}
    device = FakeDevice()
    decisions, records = decide(Profitability(CostModel(table), device, BF16))
    assert device.timed == [] and records[0]["timing"] == "table" and records[0]["runs"] == "fp32"
    assert "(from the given cost table)" in decisions["mm"].reason


def test_a_low_kernel_that_raises_makes_its_node_fp32_unless_a_stronger_level_decided():
    decisions, records = decide(Profitability(CostModel(), FakeDevice([0.5] * 9), BF16), low_raises=True)
    assert records[0]["runs"] == "fp32" and records[0]["timing"] == "low kernel failed"
    assert decisions["mm"].rule == "low-kernel-failed" and "no kernel for this dtype" in decisions["mm"].reason
    user = Decision(Precision.LOW, "user asked", Source.OVERRIDE)
    decisions, _ = decide(Profitability(CostModel(), FakeDevice([0.5] * 9), BF16), given={"mm": user},
                          low_raises=True)
    assert decisions == {}


def test_a_region_whose_ops_cannot_run_alone_is_kept_as_painted():
    device = FakeDevice([0.5] * 9)
    decisions, records = decide(Profitability(CostModel(), device, BF16), fp32_raises=True)
    assert decisions == {} and device.timed == []
    assert records == [{"first": "mm", "nodes": 2, "runs": "bf16", "timing": "unmeasured"}]
