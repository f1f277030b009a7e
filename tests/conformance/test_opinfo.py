"""PyTorch's op database as amppass's regression suite: every float32 OpInfo entry's first two
samples and every entry of autocast's CPU test lists, converted to bf16 and fp16 with ``plan_for="coverage"``
(every op numerics allow runs low), fed fp32 inputs and low-precision ones (``opinfo_harness``).

Each outcome is asserted: correct within the dtype's bound (``opinfo_expected.json``: ``bounds``), or what its
entry in ``expected`` says with its reason (a clean refusal naming the op, an fp32 op that fails on its own sample,
random values, a sample no bound holds for). A converted model that crashes is always a failure.

The whole suite is slow (``python -m pytest tests/conformance/test_opinfo.py -m slow``, 3 minutes of CPU time on
2 cores); the default run converts a representative subset: the ops whose defects this suite found, one op of
each expected outcome, and a few plain ones.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import pytest

pytest.importorskip("expecttest")  # torch.testing._internal imports it

from tests.conformance import opinfo_harness as harness  # after the skip: the harness imports torch.testing._internal

DATA = json.loads((Path(__file__).with_name("opinfo_expected.json")).read_text(encoding="utf-8"))
BOUNDS = {dtype: float(bound) for dtype, bound in DATA["bounds"].items() if dtype in ("bf16", "fp16")}

# one case each of what the suite found and of every expected outcome, and plain ops for contrast
FAST = ("fft.fft", "linalg.qr", "linalg.inv", "nn.functional.avg_pool3d", "special.zeta", "quantile", "stft",
        "complex", "view_as_complex", "einsum", "linalg.multi_dot", "grid_sampler_3d",
        "nn.functional.adaptive_avg_pool3d", "item", "linalg.lstsq", "randn", "matrix_exp", "matmul", "softmax",
        "add", "nn.functional.layer_norm", "_native_multi_head_attention", "avg_pool3d")


def expectation(case: harness.Case, dtype: str, feed: str) -> dict | None:
    """The first entry of ``expected`` that names ``case``'s op (and its dtype, feed and sample, where the
    entry restricts them); None: the case must be correct within the bound."""
    sample = int(case.key.rsplit("#", 1)[1]) if "#" in case.key else 0
    for entry in DATA["expected"]:
        if entry["op"] != case.op:
            continue
        if dtype in entry.get("dtypes", [dtype]) and feed in entry.get("feeds", [feed]) \
                and sample in entry.get("samples", [sample]):
            return entry
    return None


def verdict(case: harness.Case, dtype: str, feed: str, found: harness.Outcome) -> str:
    """Why ``found`` is not the outcome expected ("" when it is)."""
    entry = expectation(case, dtype, feed)
    where = f"{case.key} {dtype} {feed}-fed: {found.outcome}"
    if found.outcome in ("crash", "convert-crash"):
        return f"{where}: {found.detail}"
    if entry is None:
        autocast = "" if found.autocast_error is None else f"; torch.autocast's: {found.autocast_error:.3g}"
        return (
            ""
            if found.outcome == "correct"
            else f"{where} (error {found.error:.3g} > {BOUNDS[dtype]:.3g}{autocast})"
            + (f": {found.detail}" if found.detail else "")
        )
    wanted = entry["outcome"]
    if wanted == "refused":
        if found.outcome != "refused":
            return f"{where}, expected a refusal ({entry['reason']})"
        named = f"Op_{''.join(c if c.isalnum() else '_' for c in case.op)}"
        return "" if named in found.detail else f"{where}: the refusal does not name the model {named}: {found.detail}"
    if wanted == "skipped":
        return "" if found.outcome == "skipped" else f"{where}, expected the fp32 op itself to fail ({entry['reason']})"
    if found.outcome not in ("correct", "wrong"):
        return f"{where}: {found.detail}"
    if wanted in ("random", "unbounded"):
        return "" if found.same_structure else f"{where}: outputs of other types, shapes or dtypes than fp32's"
    return f"{where}: unknown expected outcome {wanted!r} in opinfo_expected.json"


def _run(cases: list[harness.Case], dtype: str, feed: str) -> list[str]:
    logging.disable(logging.WARNING)  # the conversions' notes on fixed dimensions: hundreds of them
    try:
        return [v for v in (verdict(c, dtype, feed, harness.run_case(c, dtype, feed, BOUNDS[dtype])) for c in cases)
                if v]
    finally:
        logging.disable(logging.NOTSET)


def test_expected_entries_name_real_cases_and_give_reasons():
    names = harness.case_names()
    kinds = {"refused", "skipped", "random", "unbounded"}
    for entry in DATA["expected"]:
        assert entry["op"] in names, f"{entry['op']} is neither an OpInfo entry nor an autocast-list op"
        assert entry["outcome"] in kinds and len(entry["reason"]) > 20, entry


@functools.lru_cache(maxsize=None)
def _representative() -> tuple[harness.Case, ...]:
    """The first sample of each op of :data:`FAST` (built once: the four runs below share them)."""
    return tuple(c for c in harness.all_cases(set(FAST)) if c.key.endswith("#0") or c.key.startswith("autocast:"))


@functools.lru_cache(maxsize=None)
def _every() -> tuple[harness.Case, ...]:
    return tuple(harness.all_cases())


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("feed", harness.FEEDS)
def test_representative_ops(dtype, feed):
    cases = list(_representative())
    assert {c.op for c in cases} == set(FAST)
    failures = _run(cases, dtype, feed)
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("feed", harness.FEEDS)
def test_every_opinfo_sample(dtype, feed):
    failures = _run(list(_every()), dtype, feed)
    assert not failures, f"{len(failures)} unexpected outcomes:\n" + "\n".join(failures)
