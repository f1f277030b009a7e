"""amppass.analysis.stats: the streaming per-value statistics calibration folds its batches into, their thresholds
against what fp16 itself does to the values, the strided sample, and how aggregates alias, merge and absorb."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from amppass.analysis.stats import FLUSH_LIMIT, HEADROOM, SAMPLE, SENTINEL, CalibrationStats, ValueStats, as_tensor
from amppass.dtypes import FP16_MAX, FP16_MIN_NORMAL


def test_thresholds_are_what_fp16_does_to_the_values():
    """A non-zero value counts as flushed exactly when fp16 rounds it to zero, and as below normal exactly when
    fp16 holds it as a subnormal or zero."""
    values = torch.logspace(-12, -3, 2000, dtype=torch.float64).float()
    stats = ValueStats()
    stats.update(values)
    half = values.half()
    assert stats.flush == int((half == 0).sum()) > 0
    assert stats.below_normal == int((half.abs() < FP16_MIN_NORMAL).sum()) > stats.flush
    assert stats.zeros == 0 and stats.sampled == values.numel()
    assert stats.min_nonzero == pytest.approx(float(values.min()))
    assert stats.share_below_normal == pytest.approx(stats.below_normal / values.numel())


def test_large_values_counted_against_the_headroom_and_the_largest_fp16():
    limit = FP16_MAX / HEADROOM
    stats = ValueStats()
    stats.update(torch.tensor([1.0, -limit * 1.01, 60000.0, -70000.0, 1e30]))
    assert stats.above_headroom == 4 and stats.above_max == 2
    assert stats.absmax == pytest.approx(1e30, rel=1e-6) and stats.sentinels == 0
    assert stats.share_above_headroom == pytest.approx(4 / 5)
    assert not stats.nan and not stats.inf


def test_nan_inf_and_sentinels_are_flagged_and_kept_out_of_the_range():
    stats = ValueStats()
    stats.update(torch.tensor([2.0, math.nan, -math.inf, torch.finfo(torch.float32).min, SENTINEL, 0.0]))
    assert stats.nan and stats.inf
    assert stats.sentinels == 2  # finite values at or beyond 1e38: masks' "minus infinity"
    assert stats.absmax == 2.0 and stats.above_headroom == 0
    assert stats.count == 6 and stats.zeros == 1 and stats.sampled == 2  # the sample drops NaN, inf, sentinels
    assert stats.min_nonzero == 2.0


def test_a_tensor_of_sentinels_only_has_no_range():
    stats = ValueStats()
    stats.update(torch.full((3,), -3.4e38))
    assert stats.sentinels == 3 and stats.absmax == 0.0 and stats.sampled == 0 and stats.min_nonzero == math.inf


def test_what_is_not_a_floating_tensor_is_not_counted():
    stats = ValueStats()
    for value in (torch.arange(4), np.arange(4), None, 3.0, "x", torch.tensor([True])):
        stats.update(value)
    assert stats == ValueStats()


def test_an_empty_tensor_counts_as_a_tensor_with_no_elements():
    stats = ValueStats()
    stats.update(torch.ones(3))
    stats.update(torch.empty(0, 4))
    assert stats.tensors == 2 and stats.count == 3 and stats.numel == 0 and stats.absmax == 1.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_every_floating_dtype_is_read(dtype):
    stats = ValueStats()
    stats.update(torch.tensor([0.5, -4.0, 0.0], dtype=dtype))
    assert stats.absmax == 4.0 and stats.zeros == 1 and stats.min_nonzero == 0.5 and stats.count == 3


def test_the_numel_of_a_batch_is_its_first_tensor():
    """Reduction depths read ``numel``: the later outputs of a multi-output op must not overwrite it."""
    stats = ValueStats()
    stats.update(torch.ones(6, 4))
    stats.update(torch.ones(2), first=False)
    assert stats.numel == 24 and stats.tensors == 2 and stats.count == 26


def test_range_reads_every_element_and_small_values_a_strided_sample():
    n = SAMPLE * 4 + 3
    values = torch.ones(n)
    values[1] = 5e4  # not in the sample (stride 4): the range still sees it
    values[2] = 1e-9  # not in the sample either: a sampled count
    stats = ValueStats()
    stats.update(values)
    assert stats.absmax == 5e4 and stats.above_headroom == 1
    assert stats.sampled == len(range(0, n, n // SAMPLE)) and stats.sampled <= SAMPLE + 1
    assert stats.flush == 0 and stats.min_nonzero == 1.0
    assert stats.count == n


def test_numpy_and_torch_fold_into_the_same_aggregate():
    data = np.random.default_rng(0).standard_normal(300).astype(np.float32) * 1e-4
    from_numpy, from_torch = ValueStats(), ValueStats()
    from_numpy.update(data)
    from_torch.update(torch.from_numpy(data.copy()))
    assert from_numpy == from_torch and from_numpy.below_normal > 0


def test_merge_is_folding_the_same_batches_in_one():
    rng = torch.Generator().manual_seed(1)
    batches = [torch.randn(50, generator=rng) * s for s in (1e-6, 1.0, 4e4)]
    one, first, second = ValueStats(), ValueStats(), ValueStats()
    for batch in batches:
        one.update(batch)
    first.update(batches[0])
    second.update(batches[1])
    second.update(batches[2])
    first.merge(second)
    assert first == one
    empty = ValueStats()
    empty.merge(one)
    assert empty == one  # an aggregate that saw nothing takes the other's numel too


def test_to_dict_holds_plain_numbers_and_the_shares():
    stats = ValueStats()
    stats.update(torch.tensor([0.0, 1e-6, 1.0, 4e4]))
    found = stats.to_dict()
    assert found["share_below_normal"] == pytest.approx(1 / 3) and found["share_above_headroom"] == 0.25
    assert found["absmax"] == 4e4 and found["tensors"] == 1 and found["nan"] is False
    assert set(found) >= {f for f in ValueStats.__dataclass_fields__}


def test_shares_of_an_aggregate_that_saw_nothing_are_zero():
    assert ValueStats().share_below_normal == 0.0 and ValueStats().share_above_headroom == 0.0
    zeros = ValueStats()
    zeros.update(torch.zeros(4))
    assert zeros.share_below_normal == 0.0 and zeros.min_nonzero == math.inf


def test_calibration_stats_fold_every_floating_leaf_of_a_value():
    stats = CalibrationStats()
    stats.update("split", (torch.ones(2, 3), [torch.full((4,), 7.0), torch.arange(3)], None))
    seen = stats.get("split")
    assert seen.tensors == 2 and seen.count == 10 and seen.numel == 6 and seen.absmax == 7.0
    assert "split" in stats and "other" not in stats and stats.get("other") is None and len(stats) == 1


def test_calibration_stats_keep_first_seen_order():
    stats = CalibrationStats()
    for name in ("b", "a", "c", "a"):
        stats.update(name, torch.ones(1))
    assert [name for name, _ in stats.items()] == ["b", "a", "c"]
    assert stats.get("a").tensors == 2


def test_an_alias_shares_its_source_aggregate():
    stats = CalibrationStats()
    stats.update("x", torch.ones(4))
    stats.alias("view_of_x", "x")
    stats.update("view_of_x", torch.full((4,), 3.0))
    assert stats.get("x") is stats.get("view_of_x") and stats.get("x").absmax == 3.0 and stats.get("x").tensors == 2


def test_absorb_folds_shared_values_once_and_counts_batches():
    mine, theirs = CalibrationStats(), CalibrationStats()
    mine.update("x", torch.ones(2))
    mine.batches = 2
    theirs.update("x", torch.full((2,), 5.0))
    theirs.alias("x_view", "x")
    theirs.update("only_theirs", torch.ones(3))
    theirs.batches = 3
    mine.absorb(theirs, ["x", "x_view", "absent"])
    assert mine.batches == 5
    assert mine.get("x").tensors == 2 and mine.get("x").absmax == 5.0  # not folded twice through the alias
    assert mine.get("x_view").tensors == 1  # a name new here gets its own copy of their aggregate, folded once
    assert "only_theirs" not in mine and "absent" not in mine


def test_as_tensor_views_numpy_without_a_copy_and_refuses_the_rest():
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    viewed = as_tensor(array)
    assert viewed.data_ptr() == array.ctypes.data and viewed.dtype == torch.float32
    strided = as_tensor(array.T)
    assert torch.equal(strided, torch.from_numpy(array.T.copy()))
    half = torch.ones(2, dtype=torch.float16)
    assert as_tensor(half) is half
    for other in (np.arange(3), torch.arange(3), [1.0], 2.0, torch.ones(2, dtype=torch.complex64)):
        assert as_tensor(other) is None


def test_flush_limit_is_half_the_smallest_fp16_subnormal():
    assert FLUSH_LIMIT == 2.0 ** -25
    assert float(torch.tensor(FLUSH_LIMIT * 1.01).half()) > 0 and float(torch.tensor(FLUSH_LIMIT * 0.99).half()) == 0
