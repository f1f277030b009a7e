"""amppass.fx.rewrite.apply on a captured graph and hand-made plans: casts on edges (one per value and dtype),
weights converted once or copied, fp32 accumulation by ``dtype=``, a model's cast retargeted, an attention mask
saturated, outputs back in fp32, containers never cast, fp32 constants created low; the graph valid and its
outputs close to fp32."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amppass.analysis.options import RewriteOptions
from amppass.analysis.plan import Category, Decision, Precision, PrecisionPlan, Source
from amppass.analysis.record import META_KEY
from amppass.dtypes import BF16, FP16, LowType
from amppass.fx.capture.export import capture
from amppass.fx.rewrite.apply import input_dtype, rewrite
from amppass.fx.view.build import build_view
from amppass.targets import torch_target
from tests.helpers.numerics import rel_error

aten = torch.ops.aten
MIN = torch.finfo(torch.float32).min


class Model(nn.Module):
    """Two weights read by three linears, a model's ``.float()``, an fp32 constant, a split, a sum and an
    attention with an additive mask."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(8, 8, generator=generator) * 0.3)
        self.w2 = nn.Parameter(torch.randn(8, 8, generator=generator) * 0.3)

    def forward(self, x, mask):
        a, b = F.linear(x, self.w1), F.linear(x, self.w2)
        c = (a + b).float()
        d = torch.zeros(x.shape[0], 8, dtype=torch.float32) + c
        p, q = torch.split(d, 4, dim=-1)
        att = F.scaled_dot_product_attention(a[None], b[None], c[None], attn_mask=mask)
        return p * q, d.sum(-1), F.linear(a, self.w1), att


def _inputs(seed=1):
    mask = torch.zeros(4, 4)
    mask[:, -1] = MIN  # a masked key, as transformers fill it
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)), mask


@pytest.fixture(scope="module")
def captured():
    return capture(Model(), _inputs(), note_fixed_dims=False)


_DEFAULT = {Category.LOW: Precision.LOW, Category.FOLLOW: Precision.LOW, Category.FP32: Precision.FP32,
            Category.FP32_ACCUM: Precision.FP32_ACCUM, Category.KEEP: Precision.KEEP}


def _rewritten(captured, low: LowType = BF16, changed=None, **options):
    """A private copy of ``captured`` rewritten with each node at its category's precision but ``changed``."""
    gm = copy.deepcopy(captured)
    view, _ = build_view(gm, torch_target("cpu", low.torch))
    plan = PrecisionPlan()
    for node in view.nodes:
        precision = (changed or {}).get(node.name, _DEFAULT[node.category])
        plan[node.name] = Decision(precision, f"{precision.value} in the test", Source.OVERRIDE, rule="force-low")
    stats = rewrite(gm, plan, low, RewriteOptions(**options))
    return gm, stats


def _nodes(gm):
    return {n.name: n for n in gm.graph.nodes}


def _casts(gm):
    return [n for n in gm.graph.nodes if n.meta.get(META_KEY, {}).get("cast")]


def test_input_dtype():
    assert input_dtype(Precision.LOW, torch.float16) is torch.float16
    assert input_dtype(Precision.FP32, torch.float16) is torch.float32
    assert input_dtype(Precision.KEEP, torch.float16) is None
    assert input_dtype(Precision.FP32_ACCUM, torch.bfloat16) is None


def test_one_cast_per_value_and_dtype(captured):
    gm, stats = _rewritten(captured)
    gm.graph.lint()
    nodes = _nodes(gm)
    x_casts = [c for c in _casts(gm) if c.meta[META_KEY]["of"] == "x"]
    assert len(x_casts) == 1 and x_casts[0].kwargs == {"dtype": torch.bfloat16}
    assert x_casts[0].target is aten._to_copy.default  # a typed graph casts with an aten op
    assert nodes["linear"].args[0] is x_casts[0] and nodes["linear_1"].args[0] is x_casts[0]
    assert stats.casts == len(_casts(gm))


def test_weights_read_low_only_are_converted_in_place(captured):
    gm, stats = _rewritten(captured)
    assert gm.w1.dtype is torch.bfloat16 and gm.w2.dtype is torch.bfloat16
    assert isinstance(gm.w1, nn.Parameter) and not gm.w1.requires_grad
    assert stats.weights_converted == 2 and stats.weight_copies == 0
    assert torch.equal(gm.w1, captured.w1.detach().to(torch.bfloat16))
    assert captured.w1.dtype is torch.float32  # the graph it was copied from is untouched


def test_a_weight_read_in_both_dtypes_keeps_fp32_and_gains_a_copy(captured):
    gm, stats = _rewritten(captured, changed={"linear_2": Precision.FP32})
    assert gm.w1.dtype is torch.float32 and gm.get_parameter("w1__bf16").dtype is torch.bfloat16
    assert stats.weight_copies == 1 and stats.weights_converted == 1  # w2 is read low only
    nodes = _nodes(gm)
    assert nodes["linear"].args[1].target == "w1__bf16" and nodes["linear_2"].args[1].target == "w1"


def test_training_keeps_fp32_master_weights_and_casts_them_in_the_graph(captured):
    gm, stats = _rewritten(captured, precast_weights=False)
    assert gm.w1.dtype is torch.float32 and gm.w2.dtype is torch.float32
    assert stats.weights_converted == stats.weight_copies == 0
    assert {c.meta[META_KEY]["of"] for c in _casts(gm)} >= {"w1", "w2"}


def test_fp32_accumulation_takes_the_low_input_as_it_is(captured):
    gm, _ = _rewritten(captured)
    total = _nodes(gm)["sum_1"]
    assert total.kwargs["dtype"] is torch.float32 and total.args[0].name == "add_1"  # no cast of its input


def test_a_models_cast_to_fp32_run_low_casts_to_the_low_dtype(captured):
    gm, _ = _rewritten(captured, changed={"to": Precision.LOW})
    assert _nodes(gm)["to"].args[1] is torch.bfloat16
    kept, _ = _rewritten(captured)
    assert _nodes(kept)["to"].args[1] is torch.float32


def test_an_attention_mask_is_saturated_before_its_cast(captured):
    gm, stats = _rewritten(captured, FP16)
    attention = _nodes(gm)["scaled_dot_product_attention"]
    mask = attention.args[3]
    assert mask.target is aten._to_copy.default and mask.kwargs["dtype"] is torch.float16
    clamp = mask.args[0]
    assert clamp.target is aten.clamp.default and clamp.args[1:] == (-65504.0, 65504.0)
    assert stats.saturated == ["mask"]
    assert torch.isfinite(gm(*_inputs())[3]).all()


def test_containers_are_not_cast_and_their_elements_follow_them(captured):
    gm, _ = _rewritten(captured)
    nodes = _nodes(gm)
    assert nodes["split"].args[0].name == "add_1"
    assert nodes["getitem"].args[0] is nodes["split"] and nodes["mul"].args == (nodes["getitem"], nodes["getitem_1"])
    assert not any(c.meta[META_KEY]["of"] in ("split", "getitem", "getitem_1") for c in _casts(gm))


def test_an_fp32_constant_read_low_only_is_created_low(captured):
    gm, _ = _rewritten(captured)
    assert _nodes(gm)["zeros"].kwargs["dtype"] is torch.bfloat16
    fp32_reader, _ = _rewritten(captured, changed={"add_1": Precision.FP32})
    assert _nodes(fp32_reader)["zeros"].kwargs["dtype"] is torch.float32


@pytest.mark.parametrize("keep_io_types, dtypes", [
    (True, [torch.float32] * 4), (False, [torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16])])
def test_outputs_return_to_fp32_with_keep_io_types(captured, keep_io_types, dtypes):
    gm, _ = _rewritten(captured, keep_io_types=keep_io_types)
    assert [o.dtype for o in gm(*_inputs())] == dtypes
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert [n.name for n in placeholders] == ["x", "mask"]  # inputs are never changed


def test_decisions_and_casts_are_recorded_on_their_nodes(captured):
    gm, _ = _rewritten(captured)
    nodes = _nodes(gm)
    record = nodes["linear"].meta[META_KEY]
    assert record["precision"] == "low" and record["reason"] == "low in the test" and record["source"] == "override"
    assert record["rule"] == "force-low" and record["op"] == "aten.linear" and record["casts_in"] == ["x_to_bf16"]
    assert nodes["x_to_bf16"].meta[META_KEY] == {"cast": True, "of": "x", "to": "bf16"}


@pytest.mark.parametrize("low, bound", [(BF16, 3e-2), (FP16, 5e-3)])
def test_the_rewritten_graph_runs_close_to_fp32(captured, low, bound):
    gm, _ = _rewritten(captured, low)
    gm.graph.lint()
    for seed in (1, 2):
        want, got = captured(*_inputs(seed)), gm(*_inputs(seed))
        for index, (w, g) in enumerate(zip(want, got, strict=False)):
            assert torch.isfinite(g).all() and rel_error(g, w) < bound, (low, index, rel_error(g, w))


def test_an_all_fp32_plan_adds_no_cast_between_nodes(captured):
    gm, stats = _rewritten(captured, changed={name: Precision.FP32 for name in (
        "linear", "linear_1", "add", "add_1", "split", "getitem", "getitem_1", "unsqueeze", "unsqueeze_1",
        "unsqueeze_2", "scaled_dot_product_attention", "mul", "linear_2")})
    assert stats.casts == 0 and stats.weights_converted == 0 and gm.w1.dtype is torch.float32
    for w, g in zip(captured(*_inputs()), gm(*_inputs()), strict=False):
        assert torch.equal(w, g)
