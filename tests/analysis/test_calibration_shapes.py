"""Calibration and the tolerance search take batches of any shape the original model takes,
where the capture of the example fixed a dimension: such batches run on a capture of their own, whose
statistics and trial plans are matched to the example's graph by node name and op."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import amppass
from amppass.analysis.calibration import max_runs
from tests.helpers.shape_models import lstm


class SpeakerEncoder(nn.Module):
    """Mel frames -> input projection -> LSTM -> last step -> embedding: export unrolls the LSTM over the
    example's frame count and fixes it."""

    def __init__(self):
        super().__init__()
        self.project = nn.Linear(40, 32)
        self.rnn = nn.LSTM(32, 48, batch_first=True)
        self.embed = nn.Linear(48, 16)

    def forward(self, mels):
        steps, _ = self.rnn(self.project(mels))
        return self.embed(steps[:, -1])


def _mels(batch, frames, seed, scale=1.0):
    return (scale * torch.randn(batch, frames, 40, generator=torch.Generator().manual_seed(seed)),)


def _speaker():
    torch.manual_seed(0)
    return SpeakerEncoder().eval()


def test_batches_of_other_sizes_and_lengths_calibrate_and_search():
    model = _speaker()
    example = _mels(1, 20, 0)
    batches = [_mels(3, 20, 1), _mels(2, 12, 2), _mels(1, 20, 3), _mels(4, 12, 4)]
    fast = amppass.convert(model, example, torch.float16, calibration=batches, tolerance=1e-4, plan_for="coverage")
    info = amppass.report(fast).info
    assert info["calibration_batches"] == 4 and info["tolerance_met"]
    assert info["achieved_error"] <= 1e-4 < info["initial_error"], "the search had to move nodes"
    assert info["held_out"] == "the last 1 of 4 calibration batches" and info["held_out_error"] <= 1e-4
    for batch in batches + [_mels(5, 12, 9), _mels(2, 31, 10)]:
        with torch.no_grad():
            out, ref = fast(*batch), model(*batch)
        assert float((out - ref).norm() / ref.norm()) <= 3e-4


def test_a_range_seen_only_at_another_length_decides_on_the_example_graph():
    """The projection overflows fp16 only on the loud batch, whose length the example's graph does not take:
    its statistics reach the example's node of the same name."""
    model = _speaker()
    example = _mels(1, 20, 0)
    quiet = amppass.convert(model, example, torch.float16, calibration=[_mels(2, 20, 1)], plan_for="coverage")
    assert {r.name: r for r in amppass.report(quiet).rows}["linear"].source != "calibration"
    fast = amppass.convert(model, example, torch.float16, calibration=[_mels(2, 20, 1), _mels(2, 12, 2, scale=3e4)],
                           plan_for="coverage")
    row = {r.name: r for r in amppass.report(fast).rows}["linear"]
    assert row.precision == "fp32" and row.source == "calibration" and row.evidence["rule"] == "overflow"
    assert row.evidence["absmax"] > 65504 / 2
    assert amppass.report(fast).info["calibration_batches"] == 2


def test_a_batch_of_one_where_export_fixed_the_length_of_the_shape_zoo_lstm():
    case = lstm()  # example (2, 40, 16): the LSTM is unrolled over 40 steps
    batches = [case.calls["batch 1"], case.calls["length 17"], case.calls["batch 6"], case.example]
    fast = amppass.convert(case.model, case.example, torch.bfloat16, calibration=batches, tolerance=1e-2,
                           plan_for="coverage")
    info = amppass.report(fast).info
    assert info["calibration_batches"] == 4 and info["tolerance_met"]
    assert info["tolerance_runs"] <= max_runs(sum(r.precision == "bf16" for r in amppass.report(fast).rows) + 64)


def test_a_batch_the_original_model_rejects_names_its_error():
    model = _speaker()
    with pytest.raises(
        amppass.CalibrationError,
        match=re.escape("calibration batch 1: the fp32 model failed on it (mat1 and mat2 shapes cannot be multiplied"),
    ):
        amppass.convert(model, _mels(1, 20, 0), torch.float16, plan_for="coverage",
                        calibration=[_mels(2, 20, 1), (torch.randn(2, 20, 41),)])


class _Masked(torch.nn.Module):
    """Two keyword-able inputs, as a tokenizer's dict feeds a transformer."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x, mask):
        return self.proj(x) * mask.unsqueeze(-1)


def test_dict_batches_in_another_key_order_or_naming_a_positional_input_calibrate():
    """A dict batch whose keys come in another order than the example's, or that names an input the example
    passed by position, is a call the converted module takes; calibration refused it ('captured with 2 input
    values in another structure')."""
    torch.manual_seed(0)
    model = _Masked().eval()
    x, mask = torch.randn(2, 5, 16), torch.ones(2, 5)
    batches = [{"mask": torch.ones(b, 5), "x": torch.randn(b, 5, 16)} for b in (2, 3, 4)]
    for example, kwargs in (((), {"x": x, "mask": mask}), ((x,), {"mask": mask})):
        fast = amppass.convert(model, example, example_kwargs=kwargs, dtype="bf16", calibration=batches,
                               tolerance=1e-2, plan_for="coverage")
        got, expected = fast(**batches[1]), model(**batches[1])
        assert (got - expected).norm() <= 1e-2 * expected.norm()
