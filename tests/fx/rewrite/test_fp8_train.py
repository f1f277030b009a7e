"""amppass::fp8_train_linear, its lowering and Fp8Linear: numerics against float64, scales, delayed scaling's state.

Tolerances come from the formats themselves: rounding to e4m3 (3 significand bits) moves a value by at most 2^-4 of
itself, to e5m2 (2 bits) by at most 2^-3, to bf16 (8 bits) by at most 2^-8. A product of two rounded operands is
off by at most the sum of their steps, in norm, for operands without cancellation (random normal values).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import operator

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd

from amppass.dtypes import E4M3, E5M2
from amppass.errors import InputError
from amppass.fx.rewrite import fp8_train
from amppass.fx.rewrite.fp8_train import HISTORY, Fp8Linear, fp8_train_linear, lower_train, swap_linears
from tests.helpers.ddp_harness import one_rank_group

E4M3_STEP, E5M2_STEP, BF16_STEP = 2.0 ** -4, 2.0 ** -3, 2.0 ** -8


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.detach().double() - ref.detach().double()).norm() / ref.detach().double().norm())


def _qdq(t: torch.Tensor, fmt) -> torch.Tensor:
    """``t`` stored in ``fmt`` with its per-tensor scale and read back, in float64."""
    scale = fmt.scale_for(float(t.detach().abs().amax()))
    return (t.float() / scale).clamp(-fmt.max, fmt.max).to(fmt.torch).double() * scale


def _leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


def test_forward_and_gradients_are_within_the_formats_steps_of_float64():
    torch.manual_seed(0)
    x, w, b = _leaves(torch.randn(3, 10, 64).bfloat16(), torch.randn(48, 64), torch.randn(48))
    y = fp8_train_linear(x, w, b, None, None)[0]
    grad = torch.randn(3, 10, 48)
    y.backward(grad.bfloat16())
    x64, w64, b64 = _leaves(x.double(), w.double(), b.double())
    y64 = F.linear(x64, w64, b64)
    y64.backward(grad.bfloat16().double())
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert _rel(y, y64) <= 2 * E4M3_STEP + BF16_STEP
    assert _rel(x.grad, x64.grad) <= E5M2_STEP + E4M3_STEP + BF16_STEP
    assert _rel(w.grad, w64.grad) <= E5M2_STEP + E4M3_STEP
    assert _rel(b.grad, b64.grad) <= 1e-6  # summed in fp32 from the unquantized gradient


def test_gradients_are_the_products_of_e5m2_and_e4m3_operands():
    """Not only close to float64: the backward multiplies the e5m2 gradient by the e4m3 weight and input (30 tokens:
    the inner size of dW's product is padded to 32, which adds nothing)."""
    torch.manual_seed(1)
    x, w = _leaves(torch.randn(30, 32).bfloat16(), torch.randn(16, 32))
    y = fp8_train_linear(x, w, None, None, None)[0]
    grad = torch.randn(30, 16).bfloat16()
    y.backward(grad)
    g8, x8, w8 = _qdq(grad, E5M2), _qdq(x, E4M3), _qdq(w, E4M3)
    assert _rel(y, x8 @ w8.t()) <= BF16_STEP
    assert _rel(x.grad, g8 @ w8) <= BF16_STEP
    assert _rel(w.grad, g8.t() @ x8) <= 1e-6


def test_zero_and_constant_tensors_give_finite_values_and_gradients():
    for fill in (0.0, 3.0):
        x, w, b = _leaves(torch.full((4, 32), fill).bfloat16(), torch.full((16, 32), fill), torch.zeros(16))
        y = fp8_train_linear(x, w, b, None, None)[0]
        y.backward(torch.zeros_like(y) if fill == 0 else torch.ones_like(y))
        for t in (y, x.grad, w.grad, b.grad):
            assert torch.isfinite(t).all()
        if fill:
            assert torch.allclose(y.float(), torch.full_like(y.float(), 9.0 * 32))
    for amax in (0.0, -1.0, float("inf"), float("nan")):
        assert float(E5M2.scales_for(torch.tensor(amax))) == 1.0
    for amax in (1e-30, 0.5, 448.0, 3e38):
        assert float(E4M3.scales_for(torch.tensor(amax))) == pytest.approx(E4M3.scale_for(amax), rel=1e-6)


def test_the_op_runs_under_torch_compile_with_its_backward():
    torch.manual_seed(2)
    x, w, b = _leaves(torch.randn(8, 32).bfloat16(), torch.randn(16, 32), torch.randn(16))
    eager = _leaves(x, w, b)
    compiled = torch.compile(lambda *a: fp8_train_linear(*a, None, None)[0], backend="aot_eager", fullgraph=True)
    compiled(x, w, b).float().square().sum().backward()
    fp8_train_linear(*eager, None, None)[0].float().square().sum().backward()
    for got, want in zip((x, w, b), eager, strict=True):
        assert torch.equal(got.grad, want.grad)


def test_delayed_scaling_keeps_an_amax_history_that_checkpoints_carry():
    torch.manual_seed(3)
    layer = Fp8Linear(nn.Linear(32, 16), recipe="delayed")
    dynamic = Fp8Linear(layer, recipe="dynamic")  # the same parameters
    x = torch.randn(8, 32)
    first = layer(x)
    assert torch.equal(first, dynamic(x))  # an empty history: the call's own range
    first.sum().backward()
    assert layer.amax_history.shape == (2, HISTORY)
    assert float(layer.amax_history[0, 0]) == float(x.abs().amax())
    assert float(layer.amax_history[1, 0]) == 1.0  # the gradient of a sum
    big = 4 * x
    clamped = layer(big)  # scaled by the history's range: values beyond it are clamped to e4m3's largest
    assert not torch.equal(clamped, dynamic(big)) and torch.isfinite(clamped).all()
    assert float(layer.amax_history[0, 0]) == float(big.abs().amax())
    restored = Fp8Linear(nn.Linear(32, 16), recipe="delayed")
    restored.load_state_dict(layer.state_dict())
    assert torch.equal(restored.amax_history, layer.amax_history)
    layer.eval()
    restored.eval()
    assert torch.equal(layer(x), restored(x))


def test_swap_linears_copies_the_model_and_refuses_an_unknown_recipe():
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 16))
    swapped = swap_linears(model, "delayed")
    assert [type(m).__name__ for m in swapped] == ["Fp8Linear", "ReLU", "Fp8Linear"]
    assert all(type(m) is not Fp8Linear for m in model)  # the caller's model is not changed
    with pytest.raises(InputError, match=r"recipe='tensorwise'.*'dynamic'.*'delayed'"):
        Fp8Linear(nn.Linear(32, 16), recipe="tensorwise")


def test_delayed_amaxes_give_gradients_within_the_formats_steps_and_record_the_gradients_range():
    """Given delayed ranges (twice this call's own, as a history whose older steps were larger leaves them), the
    forward and gradients stay within the same steps of float64 as dynamic ones, and the backward pushes this call's
    gradient range onto the history it is given, newest first."""
    torch.manual_seed(4)
    x, w, b = _leaves(torch.randn(3, 10, 64).bfloat16(), torch.randn(48, 64), torch.randn(48))
    grad = torch.randn(3, 10, 48).bfloat16()
    history = torch.zeros(HISTORY)
    history[0] = 0.5
    y = fp8_train_linear(x, w, b, 2 * x.detach().abs().amax().float(), 2 * grad.abs().amax().float(), history)[0]
    y.backward(grad)
    x64, w64, b64 = _leaves(x.double(), w.double(), b.double())
    y64 = F.linear(x64, w64, b64)
    y64.backward(grad.double())
    assert _rel(y, y64) <= 2 * E4M3_STEP + BF16_STEP
    assert _rel(x.grad, x64.grad) <= E5M2_STEP + E4M3_STEP + BF16_STEP
    assert _rel(w.grad, w64.grad) <= E5M2_STEP + E4M3_STEP
    assert history[:3].tolist() == [float(grad.abs().amax()), 0.5, 0.0]


def test_the_backward_reads_the_saved_e4m3_input_not_the_bf16_one():
    """What autograd saves of the input is its e4m3 copy and scale (1 byte an element, bf16's is 2), and the
    weight's gradient is the product with exactly the forward's e4m3 values, also where a delayed range clamped
    them."""
    torch.manual_seed(5)
    x, w = _leaves(torch.randn(32, 64).bfloat16(), torch.randn(16, 64))
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    amax = 0.5 * x.detach().abs().amax().float()  # a delayed range below this call's: the largest values clamp
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = fp8_train_linear(x, w, None, amax, None)[0]
    assert not any(t.dtype == torch.bfloat16 and t.shape == x.shape for t in saved)
    stored = [t for t in saved if t.dtype == E4M3.torch]
    assert [t.shape for t in stored] == [x.shape]
    grad = torch.randn(32, 16).bfloat16()
    y.backward(grad)
    scale = E4M3.scale_for(float(amax))
    x8 = (x.detach().float() / scale).clamp(-E4M3.max, E4M3.max).to(E4M3.torch).double() * scale
    assert torch.equal(stored[0].double() * scale, x8)
    assert _rel(w.grad, _qdq(grad, E5M2).t() @ x8) <= 1e-6


def test_a_forward_and_backward_quantize_the_input_once(monkeypatch):
    """The backward multiplies the forward's own e4m3 copy of the input (the op's outputs 1 and 2, saved), so one
    training call quantizes the input once (one amax, one pass over it); the weight twice (its e4m3 copy is not
    saved: the op's docstring) and the output's gradient once."""
    calls: collections.Counter = collections.Counter()
    quantized = fp8_train._quantized

    def counted(x, fmt, given=None):
        calls[fmt.name, tuple(x.shape)] += 1
        return quantized(x, fmt, given)

    monkeypatch.setattr(fp8_train, "_quantized", counted)
    torch.manual_seed(7)
    x, w, b = _leaves(torch.randn(4, 8, 64).bfloat16(), torch.randn(16, 64), torch.randn(16))
    fp8_train_linear(x, w, b, None, None)[0].float().square().sum().backward()
    assert calls == {(E4M3.name, (32, 64)): 1, (E4M3.name, (16, 64)): 2, (E5M2.name, (32, 16)): 1}


def test_under_torch_compile_the_backward_reads_the_ops_own_e4m3_input_and_scale():
    """The forward graph AOT autograd traces is the op alone: no quantization of the input beside it, and what it
    keeps for the backward is the op's outputs 1 and 2 (the e4m3 input and its scale), not the bf16 input."""
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch.manual_seed(8)
    x, w = _leaves(torch.randn(4, 8, 64).bfloat16(), torch.randn(16, 64))
    compiled = torch.compile(lambda *a: fp8_train_linear(*a, None, None)[0], fullgraph=True,
                             backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    compiled(x, w, None).float().sum().backward()
    forward = graphs[0].graph
    op = fp8_train_linear._opoverload
    assert {n.target for n in forward.nodes if n.op == "call_function"} == {op, operator.getitem}
    saved = forward.output_node().args[0][1:]  # after the product: what the backward reads
    assert sorted((n.args[1], n.meta["val"].dtype) for n in saved if n.target is operator.getitem) == [
        (1, E4M3.torch), (2, torch.float32)]
    assert not any(n.op == "placeholder" and n.meta["val"].dtype == torch.bfloat16 for n in saved)


def test_the_ops_fake_outputs_match_its_real_ones():
    """torch.library's own checks of the three-output op (schema, autograd registration, the fake outputs' shapes,
    dtypes and strides against the real ones), also for a transposed input whose flattened view is not contiguous:
    the e4m3 copy comes out contiguous, as the fake declares. Not opcheck's AOT checks: they sum every output,
    which no fp8 tensor can."""
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    x, w, b = _leaves(torch.randn(3, 10, 32).bfloat16(), torch.randn(16, 32), torch.randn(16))
    transposed = torch.randn(32, 30).bfloat16().t().requires_grad_()
    for args in ((x, w, b, None, None), (transposed, w, None, torch.tensor(2.0), torch.tensor(1.0), torch.zeros(16))):
        assert set(torch.library.opcheck(fp8_train_linear, args, test_utils=checks).values()) == {"SUCCESS"}


class _IgnoresItsFirstInput(torch.autograd.Function):
    """``a.sum() + b.sum()`` whose backward gives ``a`` no gradient (None: undefined, not zeros)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.b_shape = b.shape
        return a.float().sum() + b.sum()

    @staticmethod
    def backward(ctx, grad):
        return None, grad.expand(ctx.b_shape)


def test_an_undefined_gradient_of_the_product_gives_zero_gradients():
    """The op asks autograd for no zero gradients of its two outputs nothing differentiates; an undefined gradient
    of the product itself still gives zeros, as it did when autograd made them (and records a zero range)."""
    x, w, b = _leaves(torch.randn(2, 32).bfloat16(), torch.randn(16, 32), torch.randn(16))
    history = torch.full((HISTORY,), 0.5)
    y = fp8_train_linear(x, w, b, None, None, history)[0]
    _IgnoresItsFirstInput.apply(y, torch.ones(4, requires_grad=True)).backward()
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(w.grad, torch.zeros_like(w))
    assert torch.equal(b.grad, torch.zeros_like(b)) and history[:2].tolist() == [0.0, 0.5]


class _SecondQuantization(torch.autograd.Function):
    """The formulation before the op returned its e4m3 input: the same product, with the input quantized a
    second time after the forward (from the saved bf16 input, the same range) for the backward to read."""

    @staticmethod
    def forward(ctx, x, w, b, input_amax, grad_amax):
        x_q, x_scale = fp8_train._quantized(x.reshape(-1, x.shape[-1]), E4M3, input_amax)
        w_q, w_scale = fp8_train._quantized(w, E4M3)
        out = fp8_train._product(x_q, w_q.t(), x_scale, w_scale, torch.float32) + b.float()
        ctx.save_for_backward(x, w, input_amax, grad_amax)
        return out.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, w, input_amax, grad_amax = ctx.saved_tensors
        x_q, x_scale = fp8_train._quantized(x.reshape(-1, x.shape[-1]), E4M3, input_amax)
        dy = grad.reshape(-1, grad.shape[-1])
        g_q, g_scale = fp8_train._quantized(dy, E5M2, grad_amax)
        w_q, w_scale = fp8_train._quantized(w, E4M3)
        dx = fp8_train._product(g_q, w_q, g_scale, w_scale, torch.float32).to(x.dtype).reshape(x.shape)
        dw = fp8_train._product(g_q.t(), x_q, g_scale, x_scale, torch.float32)
        return dx, dw, dy.float().sum(0), None, None


@pytest.mark.parametrize("recipe", ["dynamic", "delayed"])
def test_outputs_and_gradients_are_bit_equal_to_quantizing_the_input_again(recipe):
    """Saving the forward's e4m3 input changes no number: the product and the three gradients equal, bit for bit,
    those of the formulation that quantized the input a second time for the backward (30 tokens: the padded inner
    size of dW's product; delayed ranges below the call's own, so the largest values clamp)."""
    torch.manual_seed(9)
    x, w, b = _leaves(torch.randn(3, 10, 64).bfloat16(), torch.randn(48, 64), torch.randn(48))
    grad = torch.randn(3, 10, 48).bfloat16()
    delayed = recipe == "delayed"
    amaxes = (0.5 * x.detach().abs().amax().float(), 0.5 * grad.abs().amax().float()) if delayed else (None, None)
    y = fp8_train_linear(x, w, b, *amaxes)[0]
    y.backward(grad)
    ref = _leaves(x, w, b)
    y_ref = _SecondQuantization.apply(*ref, *amaxes)
    y_ref.backward(grad)
    assert torch.equal(y, y_ref)
    for got, want in zip((x, w, b), ref, strict=True):
        assert got.grad.dtype == want.grad.dtype and torch.equal(got.grad, want.grad)


def _lowered(recipe: str, record: bool = True):
    """A two-layer model captured by torch.export in train mode, its second product lowered with ``recipe``."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    gm = torch.export.export(model, (torch.randn(8, 32),)).module()
    products = [n.name for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    added = lower_train(gm, {products[1]}, recipe, record)
    gm.graph.lint()
    return gm, added


def test_a_lowered_product_keeps_its_name_and_its_readers_read_the_ops_element_0():
    """The op node keeps the product's name (its decision record's key) and holds the op's three outputs as its
    value; the product's readers read element 0 through one ``getitem``, which takes over the product's value."""
    gm, _ = _lowered("delayed")
    (node,) = [n for n in gm.graph.nodes if n.target is fp8_train_linear._opoverload]
    assert node.name == "linear_1"
    (product,) = node.users
    assert product.target is operator.getitem and product.args == (node, 0)
    assert [n.op for n in product.users] == ["output"]
    out, x_q, scale = node.meta["val"]
    assert out.shape == product.meta["val"].shape == (8, 16) and out.dtype == product.meta["val"].dtype
    assert x_q.shape == (8, 64) and x_q.dtype == E4M3.torch and scale.shape == () and scale.dtype == torch.float32
    assert product.meta["nn_module_stack"] == node.meta["nn_module_stack"]  # outlined into the product's module


def test_a_delayed_lowering_holds_its_histories_as_buffers_and_compiles_without_graph_breaks():
    gm, added = _lowered("delayed")
    assert added == ["2.fp8_input_amax_history", "2.fp8_grad_amax_history"]
    assert all(gm.get_buffer(name).shape == (HISTORY,) for name in added)
    eager = copy.deepcopy(gm)
    assert all(eager.get_buffer(name) is not gm.get_buffer(name) for name in added)  # a deepcopy owns its own
    compiled = torch.compile(gm, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break would raise
    for step in range(3):
        x = torch.randn(8, 32) * (step + 1)
        compiled(x).square().sum().backward()
        eager(x).square().sum().backward()
    for name in added:
        assert torch.equal(gm.get_buffer(name), eager.get_buffer(name))
        assert (gm.get_buffer(name)[:3] > 0).all() and (gm.get_buffer(name)[3:] == 0).all()
    assert gm.get_buffer(added[0])[0] > gm.get_buffer(added[0])[1] > gm.get_buffer(added[0])[2]  # newest first
    for got, want in zip(gm.parameters(), eager.parameters(), strict=True):
        assert torch.equal(got.grad, want.grad)


def test_an_eval_lowering_reads_the_histories_without_recording_and_dynamic_adds_no_state():
    gm, added = _lowered("delayed", record=False)
    assert torch.ops.amppass.fp8_record_amax.default not in {n.target for n in gm.graph.nodes}
    gm(torch.randn(8, 32)).sum().backward()
    assert all(not gm.get_buffer(name).any() for name in added)
    dynamic, none = _lowered("dynamic")
    assert none == [] and not list(dynamic.buffers())


def test_two_calls_before_one_backward_record_both_gradient_ranges():
    """Two views of a batch through one model, then one backward: the gradient history is written without a new
    version, so the first call's backward still reads what it saved."""
    gm, added = _lowered("delayed")
    first, second = gm(torch.randn(8, 32)), gm(torch.randn(8, 32))
    (first.sum() + 3 * second.sum()).backward()
    assert gm.get_buffer(added[1])[:2].tolist() == [1.0, 3.0]  # the second call's backward runs first


def _close(got: torch.Tensor, want: torch.Tensor, exact: bool) -> bool:
    """Bit-equal, or (``exact`` False: inductor fuses the graph and orders its sums its own way) within 2^-12 of
    ``want`` in norm: far below one step of e5m2 (2^-3) or e4m3 (2^-4), which a wrong scale moves values by."""
    return torch.equal(got, want) if exact else bool((got - want).float().norm() <= 2 ** -12 * want.float().norm())


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_two_calls_before_one_backward_under_torch_compile_equal_eager(backend):
    """Two views of a batch through one compiled model (``fullgraph=True``), one loss over both, one backward, three
    steps: outputs, gradients and both histories are eager mode's, bit for bit under aot_eager. The second view's
    range is larger, so it enters the histories between the first call's forward and its backward, which must
    still scale by the range its forward read; the gradient's record keeps the history's version, so autograd lets
    the first call's backward unpack it (a graph-level copy_ of the history refused it: saved-version check)."""
    gm, added = _lowered("delayed")
    eager = copy.deepcopy(gm)
    compiled = torch.compile(gm, backend=backend, fullgraph=True)
    exact = backend == "aot_eager"
    for step in range(3):
        x = torch.randn(8, 32) * (step + 1)
        views = (x + 0.1 * torch.randn(8, 32), 4 * x)
        outputs = {}
        for name, model in (("compiled", compiled), ("eager", eager)):
            first, second = model(views[0]), model(views[1])
            (first.square().sum() + 3 * (first * second).sum()).backward()
            outputs[name] = (first, second)
        assert all(_close(got, want, exact) for got, want in zip(*outputs.values(), strict=True))
        for name in added:
            assert _close(gm.get_buffer(name), eager.get_buffer(name), exact), name
        for got, want in zip(gm.parameters(), eager.parameters(), strict=True):
            assert _close(got.grad, want.grad, exact)
    grad_history = gm.get_buffer(added[1])
    assert (grad_history[:6] > 0).all() and not grad_history[6:].any()  # two records a step, three steps


def test_a_non_finite_range_is_not_recorded_and_the_output_stays_finite():
    """An inf in the input: the history repeats its newest finite range instead, and the delayed scale (from that
    history) clamps the inf to e4m3's largest finite value, so the output is finite."""
    gm, added = _lowered("delayed")
    gm(torch.randn(8, 32))
    x = torch.randn(8, 32)
    x[0, 0] = float("inf")
    hidden = torch.relu(F.linear(x, gm.get_parameter("0.weight"), gm.get_parameter("0.bias")))
    assert torch.isinf(hidden).any()  # the lowered product's input holds an inf too
    out = gm(x)
    history = gm.get_buffer(added[0])
    assert torch.isfinite(history).all() and history[0] == history[1] > 0
    assert torch.isfinite(out).all()


def test_one_process_records_without_a_collective_even_in_a_one_rank_group(monkeypatch):
    """Ranks' amaxes are reduced only where a process group has more than one rank: one process, in a one-rank
    group or none, records exactly what it did before, with no collective (the two-rank reduction is tested in
    tests/serving/test_tree_fsdp_fp8.py)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a collective in a one-process run")

    monkeypatch.setattr(torch.distributed, "all_reduce", refuse)
    runs = []
    for group in (contextlib.nullcontext, one_rank_group):
        torch.manual_seed(7)
        layer, (gm, added) = Fp8Linear(nn.Linear(32, 16), recipe="delayed"), _lowered("delayed")
        with group():
            for step in range(3):
                x = torch.randn(8, 32) * (step + 1)
                layer(x).float().square().sum().backward()
                gm(x).square().sum().backward()
        runs.append([layer.amax_history.clone()] + [gm.get_buffer(name).clone() for name in added])
    assert (runs[0][0][:, :3] > 0).all() and all((history[:3] > 0).all() for history in runs[0][1:])
    assert all(torch.equal(alone, grouped) for alone, grouped in zip(*runs, strict=True))
