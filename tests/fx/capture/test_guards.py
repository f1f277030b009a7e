"""amppass.fx.capture.guards: what a captured graph accepts and why a call does not fit (read from a capture, and
on hand-made guards where the reason is the point), casting a call's floating inputs to the plan's dtypes, call
layouts shown by shape, the fp32 decisions carried to another capture, and an example the model itself refuses,
named in the model's terms. The symbol ranges torch.export picks are left to the capture's own tests."""

from __future__ import annotations

import math

import pytest
import sympy
import torch
from torch import fx, nn
from torch.utils._sympy.numbers import int_oo

from amppass.analysis.plan import Decision, Precision, Source
from amppass.analysis.record import META_KEY
from amppass.fx.capture.export import capture
from amppass.fx.capture.guards import (
    GUARDS_KEY,
    InputSpec,
    Mismatch,
    ShapeGuards,
    call_layout,
    carried_decisions,
    carried_into,
    example_refusal,
    guard_conditions,
    input_spec,
    plain_inputs,
    range_bound,
    specialised_dims,
)


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, mask):
        return self.fc(x) * mask.unsqueeze(-1)


X, MASK = torch.randn(2, 5, 16), torch.ones(2, 5)


@pytest.fixture(scope="module")
def guards() -> ShapeGuards:
    return capture(Masked(), (X, MASK), note_fixed_dims=False).meta[GUARDS_KEY]


def test_guards_read_from_a_capture(guards):
    assert [(s.name, s.dtype, len(s.dims)) for s in guards.inputs] == [("x", torch.float32, 3),
                                                                         ("mask", torch.float32, 2)]
    x, mask = guards.inputs
    assert x.dims[2] == 16  # the feature width the weight fixes
    assert x.dims[:2] == mask.dims and all(isinstance(d, str) for d in mask.dims)  # one symbol per shared size
    described = guards.describe()  # the symbols' bounds, where shown, are export's choice
    assert described.startswith(f"x: [{x.dims[0]}") and described.endswith("] float32")
    assert ", 16] float32; mask: [" in described
    assert guards.key() == f"x[{x.dims[0]},{x.dims[1]},16], mask[{mask.dims[0]},{mask.dims[1]}]"
    conditions = guard_conditions(guards.guard_fn)
    assert "x.size()[2] == 16" in conditions and "mask.size()[0] == x.size()[0]" in conditions


def test_calls_the_plan_takes(guards):
    assert guards.mismatch((X, MASK), {}) is None
    assert guards.mismatch((torch.randn(3, 7, 16), torch.ones(3, 7)), {}) is None  # other sizes of its symbols
    assert guards.mismatch((X,), {"mask": MASK}) is None  # spelled by keyword: arranged as forward() binds it


@pytest.mark.parametrize("args, kwargs, why", [
    ((X.half(), MASK), {}, "input x is float16, the plan takes float32"),
    ((torch.randn(2, 5), MASK), {}, "input x is 2-dimensional (2, 5), the plan takes 3 dimensions"),
    ((torch.randn(2, 5, 8), MASK), {}, "input x dim 2 is 8, the plan takes 16 only"),
    ((torch.randn(3, 5, 16), MASK), {}, "input mask dim 0 is 2, the plan takes the same size as another input's (3)"),
    ((X, 1.0), {}, "input mask is float, the plan takes a tensor"),
    ((X,), {}, "the call passes ([2, 5, 16] float32), the plan was captured for (x, mask)"),
    ((X, MASK, 1), {}, "the call passes ([2, 5, 16] float32, [2, 5] float32, 1), the plan was captured for (x, mask)"),
])
def test_why_a_call_does_not_fit(guards, args, kwargs, why):
    assert str(guards.mismatch(args, kwargs)) == why


def test_conform_casts_floating_inputs_to_the_plans_dtypes(guards):
    args, kwargs, cast = guards.conform((X.half(), MASK), {})
    assert cast == ["x: float16"] and kwargs == {}
    assert args[0].dtype is torch.float32 and torch.equal(args[0], X.half().float()) and args[1] is MASK
    assert guards.conform((X, MASK), {}) == ((X, MASK), {}, [])
    same = ((X.long(), MASK), {})  # not floating: left for mismatch() to name
    assert guards.conform(*same)[2] == []


def _hand_made(ranges, fixed=None):
    inputs = [InputSpec("x", torch.float32, ("s0", 8)), InputSpec("flag", None, value=True)]
    return ShapeGuards(None, inputs, ranges, None, None, fixed)


@pytest.mark.parametrize("size, ranges, why", [
    (1, {"s0": (2, math.inf)}, "input x dim 0 is 1, the plan takes >= 2"),
    (9, {"s0": (2, 8)}, "input x dim 0 is 9, the plan takes 2..8"),
])
def test_a_size_outside_its_symbols_range_is_refused(size, ranges, why):
    guards = _hand_made(ranges)
    assert guards.mismatch((torch.ones(4, 8), True), {}) is None
    assert str(guards.mismatch((torch.ones(size, 8), True), {})) == why


def test_non_tensor_inputs_and_fixed_keywords():
    guards = _hand_made({"s0": (2, 8)}, fixed={"return_dict": True})
    assert guards.describe() == "x: [s0 in [2, 8], 8] float32; flag = True; return_dict = True"
    assert guards.key() == "x[s0,8], flag=True, return_dict=True"
    call = ((torch.ones(4, 8), True), {"return_dict": True})
    assert guards.mismatch(*call) is None
    assert guards.runnable(*call) == (call[0], {})
    assert str(guards.mismatch((torch.ones(4, 8), False), {"return_dict": True})) == \
        "input flag is False, the plan takes True"
    assert str(guards.mismatch(call[0], {})) == "input return_dict is absent, the plan takes True"
    assert guards.flatten(call[0], {"return_dict": 1}) is None  # 1 == True, but not the value it fixed


def test_describe_spells_ranges():
    spec = InputSpec("x", torch.float16, ("s0", "s1", 3))
    assert spec.describe({"s0": (2, math.inf), "s1": (1, 64)}) == "x: [s0>=2, s1 in [1, 64], 3] float16"
    assert spec.describe({}) == "x: [s0, s1, 3] float16"
    assert InputSpec("n", None, value=4).describe({}) == "n = 4"


def test_mismatch_words():
    assert str(Mismatch("x", "7", "8 only", 1)) == "input x dim 1 is 7, the plan takes 8 only"
    assert str(Mismatch("x", "float16", "float32")) == "input x is float16, the plan takes float32"
    assert str(Mismatch("arguments", "(a)", "(b)")) == "the call passes (a), the plan was captured for (b)"


def test_input_spec_and_range_bound():
    assert input_spec("x", torch.ones(2, 3)) == InputSpec("x", torch.float32, (2, 3))
    assert input_spec("n", 3) == InputSpec("n", None, value=3)
    assert input_spec("obj", object()).value is None  # only plain values are compared
    assert range_bound(int_oo) == math.inf and range_bound(-int_oo) == -math.inf
    assert range_bound(sympy.oo) == math.inf and range_bound(sympy.Integer(5)) == 5 and range_bound(2) == 2


def test_call_layout_shows_shapes_never_values():
    layout = call_layout((torch.ones(2, 3), [torch.zeros(1, dtype=torch.int64)], (4,)),
                         {"mask": torch.ones(2, dtype=torch.bool), "features": {"ids": torch.ones(2, 9).long()},
                          "name": "x" * 100})
    assert layout == ("([2, 3] float32, [[1] int64], (4,), mask=[2] bool, features={'ids': [2, 9] int64}, "
                      "name=<str>)")


def test_plain_inputs_rebuild_containers_and_make_mappings_dicts():
    class Encoding(dict):
        """A dict subclass torch's pytree does not know, as transformers' BatchEncoding."""

    tensor = torch.ones(2)
    given = (Encoding(ids=tensor), [tensor, {"a": tensor}])
    plain = plain_inputs(given)
    assert type(plain[0]) is dict and plain[0]["ids"] is tensor
    assert plain == given and plain[1] is not given[1] and plain[1][1] is not given[1][1]
    assert plain_inputs(tensor) is tensor and plain_inputs(None) is None


def _with_decisions() -> fx.GraphModule:
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))
    records = {
        "_0": Decision(Precision.FP32, "overflows", Source.CALIBRATION, {"absmax": 1e5}, rule="overflow"),
        "_1": Decision(Precision.FP32, "moved", Source.TOLERANCE, rule="tolerance"),
        "_2": Decision(Precision.FP32, "table", Source.POLICY, rule="policy"),
    }
    for node in gm.graph.nodes:
        if node.name in records:
            node.meta[META_KEY] = records[node.name].to_meta()
    return gm


def test_fp32_decisions_of_calibration_and_tolerance_are_carried():
    gm = _with_decisions()
    carried = carried_decisions(gm)
    assert sorted(carried) == ["_0", "_1"]  # not the policy's: the new capture's policy decides those again
    target, decision = carried["_0"]
    assert target == "0" and decision.rule == "overflow" and decision.evidence["absmax"] == 1e5
    assert decision.evidence["carried_over"] == "decided on the calibration batches for the example's shapes"


def test_matching_keeps_the_carried_decisions_of_nodes_with_the_same_op():
    carried = carried_decisions(_with_decisions())
    other = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))  # no _2
    assert sorted(carried_into(other, carried)) == ["_0", "_1"]
    next(n for n in other.graph.nodes if n.name == "_1").target = "another"  # _1 is another op here
    assert sorted(carried_into(other, carried)) == ["_0"]
    assert carried_into(other, {"gone": ("0", carried["_0"][1])}) == {}


def test_specialised_dims_leave_out_sizes_the_weights_fix(guards):
    gm = capture(Masked(), (X, MASK), note_fixed_dims=False)
    assert specialised_dims(gm, Masked()) == []  # dim 2 is fc's width: the model needs it anyway
    gm.meta[GUARDS_KEY] = ShapeGuards(None, [InputSpec("x", torch.float32, ("s0", 7, 16))], {}, None, None)
    assert specialised_dims(gm, Masked()) == ["x dim 1 is fixed at 7 (torch.export fixed it)"]
    assert specialised_dims(fx.symbolic_trace(Masked()), Masked()) == []  # a trace has no guards


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        self.embed, self.ln = nn.Embedding(10, 4), nn.LayerNorm(4)

    def forward(self, image, ids):
        return self.norm(self.conv(image)).mean() + self.ln(self.embed(ids)).sum()


@pytest.mark.parametrize("image, ids, line", [
    (torch.ones(1, 2, 8, 8), torch.zeros(2, dtype=torch.long),
     "input 'image' of shape [1, 2, 8, 8] does not fit Net: conv2d (conv) takes [N, 3, H, W]"),
    (torch.ones(1, 3, 8, 8), torch.tensor([3, 12]),
     "input 'ids' of shape [2] does not fit Net: embedding (embed) takes integer indices in [0, 10), got values 3..12"),
    (torch.ones(1, 3, 8, 8), torch.ones(2),
     "input 'ids' of shape [2] does not fit Net: embedding (embed) takes integer indices in [0, 10), got float32"),
])
def test_an_example_the_model_refuses_is_named_in_its_terms(image, ids, line):
    refused = example_refusal(Net(), (image, ids), {})
    assert refused is not None and refused[0] == line and isinstance(refused[1], Exception)


def test_an_error_that_is_not_a_shape_is_quoted_with_its_module():
    class Picky(nn.Module):
        def forward(self, x):
            raise ValueError("needs a mask")

    refused = example_refusal(Picky(), (torch.ones(2),), {})
    assert refused[0] == ("Picky does not run on its example (x: [2] float32): its forward raised ValueError: "
                          "needs a mask; pass example_inputs (and example_kwargs) exactly as forward() takes them")


def test_an_example_that_runs_is_not_refused_and_changes_nothing():
    net = Net().train()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    image, ids = torch.randn(2, 3, 8, 8), torch.tensor([1, 2])
    kept = (image.clone(), ids.clone())
    assert example_refusal(net, (image, ids), {}) is None
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())  # running statistics put back
    assert torch.equal(image, kept[0]) and torch.equal(ids, kept[1])
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in net.modules())  # hooks removed
