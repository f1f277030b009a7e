"""The ATen policy table: every op named exists, is named once, and every row has a reason."""

import operator

import torch
import torch.nn.functional as F

import amppass
from amppass.analysis.plan import Category
from amppass.fx import policy


def test_every_op_is_real_and_named_once():
    names = [op for row in policy.POLICY for op in row.ops]
    assert len(names) == len(set(names)), "an op is listed in two rows"
    # ATen packets, torch.nn.functional spellings a symbolically traced module calls directly, and the
    # Python operators every graph has (operator.getitem)
    missing = [op for op in names if not any(hasattr(space, op) for space in (torch.ops.aten, F, operator))]
    assert not missing, f"neither ATen ops, torch.nn.functional functions nor Python operators: {missing}"


def test_rows_have_reasons_and_categories():
    for row in policy.POLICY:
        assert isinstance(row.category, Category) and len(row.reason) > 20


def test_lookup_spellings():
    assert policy.lookup("aten.linear.default").category is Category.LOW
    assert policy.lookup("softmax").category is Category.FP32_ACCUM
    assert policy.lookup("layer_norm").category is Category.FP32
    assert policy.lookup("made_up_op") is None


def test_public_api():
    assert set(amppass.__all__) >= {"convert", "report", "LossScaler", "AmpPassError", "ScaleCollapseError", "save", "load"}
    for name in amppass.__all__:
        assert hasattr(amppass, name)
