"""The ONNX backend test suite as amppass's regression suite.

Every usable case of ``onnx_backend_harness`` (node cases with a float32 input that onnxruntime's CPU
provider reproduces in float32, and the models of onnx's pytorch-converted, pytorch-operator, simple and light
folders), converted under three configurations:

- ``default``: the default plan (fp16, target cpu); outputs within
  :data:`~tests.conformance.onnx_backend_harness.FP16_BOUND` of the expected ones.
- ``force_low``: ``force_low=`` every op type of the model; within the looser ``FORCED_BOUND``.
- ``low_input``: the default plan with each float32 input read through an Identity forced to fp16, so the op
  decides on a low-precision value; within ``FP16_BOUND`` of the expected outputs or of the float32 model on the
  fp16-rounded inputs. Only cases with such an input.

Every converted model must pass ``onnx.checker.check_model(full_check=True)``, load and run in onnxruntime's CPU
provider. A case that is not ``correct`` is listed in ``onnx_expected.json`` with its outcome and reason; a refusal
must be an ``AmpPassError`` whose message names the op. The suite runs in about a minute on two cores.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.conformance import onnx_backend_harness as suite

EXPECTED = json.loads((Path(__file__).with_name("onnx_expected.json")).read_text())
CASES = suite.all_cases()
LOW_INPUT_CASES = [c for c in CASES if suite.low_input(c) is not None]
BOUNDS = {"default": suite.FP16_BOUND, "force_low": suite.FORCED_BOUND, "low_input": suite.FP16_BOUND}


@pytest.fixture(autouse=True)
def _quiet():
    """Conversions warn per case (force_low on ops without a low kernel); the outcome is what is asserted."""
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


def _check(case: suite.Case, config: str) -> None:
    got = suite.outcome(case, suite.amppass_converter(config), BOUNDS[config], rounded=config == "low_input")
    entry = EXPECTED[config].get(case.name)
    if entry is None:
        assert got.kind == "correct", f"{config} {case.name}: {got.kind}: {got.detail}"
        return
    assert got.kind == entry["outcome"], (
        f"{config} {case.name}: expected {entry['outcome']} ({entry['reason']}), got {got.kind}: {got.detail}; "
        "update tests/conformance/onnx_expected.json if the change is right")
    if got.kind == "refused":
        assert entry["names"] in got.detail, f"the refusal does not name {entry['names']}: {got.detail}"


def test_the_suite_is_the_one_measured():
    """Guards the filter: the counts move only when onnx or onnxruntime change what they ship or run."""
    names = {c.name.split("/", 1)[0] for c in CASES}
    assert len(suite.node_cases()) > 1000 and names == {"node", *suite.FOLDERS}
    assert all(name in {c.name for c in CASES} for config in EXPECTED if config != "note"
               for name in EXPECTED[config]), "an expected entry names a case the suite no longer has"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_default(case):
    _check(case, "default")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_force_low(case):
    _check(case, "force_low")


@pytest.mark.parametrize("case", LOW_INPUT_CASES, ids=[c.name for c in LOW_INPUT_CASES])
def test_low_input(case):
    _check(case, "low_input")
