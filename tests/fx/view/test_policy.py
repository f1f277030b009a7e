"""The ATen policy table: every op named exists, is named once, and every row has a reason."""

import operator

import pytest
import torch
import torch.nn.functional as F

import amppass
from amppass.analysis.plan import Category
from amppass.fx.view import policy


def test_every_op_is_real_and_named_once():
    names = [op for row in policy.POLICY for op in row.ops]
    assert len(names) == len(set(names)), "an op is listed in two rows"
    # ATen packets, torch.nn.functional spellings a symbolically traced module calls directly, and the
    # Python operators every graph has (operator.getitem)
    missing = [op for op in names if "." not in op and not any(hasattr(space, op) for space in (torch.ops.aten, F,
                                                                                               operator))]
    assert not missing, f"neither ATen ops, torch.nn.functional functions nor Python operators: {missing}"
    # another library's op, "<namespace>.<name>": registered once that library is imported
    pytest.importorskip("transformers")
    import transformers.integrations.moe  # noqa: F401 - registers torch.ops.transformers

    foreign = [op.split(".") for op in names if "." in op]
    assert foreign and all(hasattr(getattr(torch.ops, space), name) for space, name in foreign)


def test_transformers_grouped_matrix_multiply_runs_low():
    """A mixture of experts' grouped matrix multiply (DeepSeek-V3's experts) is a matrix multiply, not an op to
    follow its inputs; the namespaced name is found in every spelling."""
    for spelling in ("transformers.grouped_mm_fallback", "transformers.grouped_mm_fallback.default"):
        assert policy.lookup(spelling).category is Category.LOW
    assert policy.lookup("aten._grouped_mm.default").category is Category.LOW


def test_rows_have_reasons_and_categories():
    for row in policy.POLICY:
        assert isinstance(row.category, Category) and len(row.reason) > 20


def test_lookup_spellings():
    assert policy.lookup("aten.linear.default").category is Category.LOW
    assert policy.lookup("softmax").category is Category.FP32_ACCUM
    assert policy.lookup("layer_norm").category is Category.FP32
    assert policy.lookup("made_up_op") is None


def test_public_api():
    assert set(amppass.__all__) >= {
        "convert",
        "report",
        "LossScaler",
        "AmpPassError",
        "ScaleCollapseError",
        "save",
        "load",
    }
    for name in amppass.__all__:
        assert hasattr(amppass, name)
