"""fp8 training: a linear product with e4m3 forward operands and e5m2 gradients, and its lowering in a train graph.

``amppass::fp8_train_linear(input, weight, bias, input_amax, grad_amax)`` computes ``linear(input, weight, bias)``
under autograd (a ``torch.library`` custom op with a registered backward, so it stays one node in an FX graph and
under torch.compile):

- **forward**: ``input`` and ``weight`` quantized to e4m3, each with a per-tensor scale, multiplied by
  ``torch._scaled_mm`` with fp32 accumulation; the output in ``input``'s dtype (bf16 in a train graph);
- **backward**: the output's gradient ``dY`` quantized to e5m2 (two more exponent bits than e4m3: gradients span
  more range than they need precision) with its own scale; ``dX = dY·W`` and ``dW = dYᵀ·X``, each a
  ``torch._scaled_mm`` of an e5m2 and an e4m3 operand (the combination CUDA's fp8 kernels take: e5m2×e5m2 is not
  one), fp32 accumulation; ``dX`` in ``input``'s dtype, ``dW`` in the weight's (fp32: the master weight), the
  bias's gradient summed in fp32 from the unquantized ``dY``.

**Scales.** The weight's scale comes from the current (master) weight on every call: one ``amax`` over the weight,
cheap next to the product. The input's and the gradient's come from their own largest magnitude on this call
(dynamic scaling), or, where ``input_amax``/``grad_amax`` hold a positive value, from that value (delayed scaling:
the largest magnitude of an amax history, as TransformerEngine's default recipe keeps; :class:`Fp8Linear` keeps one).
A value beyond a delayed scale's range is clamped to the format's largest finite value. Every scale is finite and
positive, computed by :meth:`amppass.dtypes.Fp8Format.scales_for` on tensors (no host sync): 1.0 for an
all-zero, infinite or NaN range, so zero and constant tensors quantize and multiply to finite values.

The backward quantizes ``input`` and ``weight`` again from the tensors autograd saved (deterministic: the same
scales and values as the forward's), so what backward keeps is the bf16 input, not an fp8 copy.

e5m2's range (up to 57344 times its scale, which follows the gradient's own amax) is why fp8 training needs no
loss scaling: a gradient is scaled into range by its own scale in every product, whatever the loss's size.

On the CPU (torch 2.13 runs ``torch._scaled_mm`` there from the fp8 values in fp32, for every combination of
formats) the same call runs, numerically what the GPU kernels compute; inner sizes are padded with zeros to a
multiple of 16 (the token count of ``dW``'s product), which adds nothing to the sums.
"""

from __future__ import annotations

import copy

import torch
from torch import fx, nn

from ...dtypes import E4M3, E5M2, Fp8Format
from ...errors import InputError
from .fp8 import FP8_ALIGNMENT, drop_unread, operands, quantize, weight_path

aten = torch.ops.aten
HISTORY = 16  # delayed scaling's amax history: TransformerEngine's default length
RECIPES = ("dynamic", "delayed")


def _amax(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)


def _quantized(x: torch.Tensor, fmt: Fp8Format, given: torch.Tensor | None = None) -> tuple[torch.Tensor,
                                                                                          torch.Tensor]:
    """``x`` in ``fmt`` with its scale: from ``given`` where it is positive (delayed), else from ``x`` itself."""
    amax = _amax(x)
    if given is not None:
        amax = torch.where(given > 0, given.float(), amax)
    scale = fmt.scales_for(amax)
    return quantize(x, scale, fmt), scale


def _product(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b)`` by ``torch._scaled_mm``: ``a`` row-major and ``b`` column-major (what its
    CUDA kernels take), the inner size padded with zeros to a multiple of 16."""
    pad = -a.shape[1] % FP8_ALIGNMENT
    if pad:
        a = torch.cat([a, a.new_zeros(a.shape[0], pad)], dim=1)
        b = torch.cat([b, b.new_zeros(pad, b.shape[1])], dim=0)
    return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=scale_a, scale_b=scale_b,
                            out_dtype=out_dtype)


@torch.library.custom_op("amppass::fp8_train_linear", mutates_args=())
def fp8_train_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     input_amax: torch.Tensor | None, grad_amax: torch.Tensor | None) -> torch.Tensor:
    """``linear(input, weight, bias)`` with ``input`` and ``weight`` in e4m3, fp32 accumulation, output in
    ``input``'s dtype; its backward reads the output's gradient in e5m2 (module docstring). ``input_amax`` and
    ``grad_amax``: the ranges of delayed scaling, or None (or 0) for the current call's own."""
    flat = input.reshape(-1, input.shape[-1])
    x_q, x_scale = _quantized(flat, E4M3, input_amax)
    w_q, w_scale = _quantized(weight, E4M3)
    out = _product(x_q, w_q.t(), x_scale, w_scale, torch.float32)
    if bias is not None:
        out = out + bias.float()
    return out.to(input.dtype).reshape(*input.shape[:-1], weight.shape[0])


@fp8_train_linear.register_fake
def _(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, input_amax: torch.Tensor | None,
      grad_amax: torch.Tensor | None) -> torch.Tensor:
    return input.new_empty((*input.shape[:-1], weight.shape[0]))


def _setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
    input, weight, bias, input_amax, grad_amax = inputs
    ctx.save_for_backward(input, weight, input_amax, grad_amax)
    ctx.has_bias = bias is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _backward(ctx, grad: torch.Tensor) -> tuple:
    input, weight, input_amax, grad_amax = ctx.saved_tensors
    flat = input.reshape(-1, input.shape[-1])
    dy = grad.reshape(-1, grad.shape[-1])
    g_q, g_scale = _quantized(dy, E5M2, grad_amax)
    x_q, x_scale = _quantized(flat, E4M3, input_amax)
    w_q, w_scale = _quantized(weight, E4M3)
    grad_input = grad_weight = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_input = _product(g_q, w_q, g_scale, w_scale, torch.float32).to(input.dtype).reshape(input.shape)
    if ctx.needs_input_grad[1]:
        grad_weight = _product(g_q.t(), x_q, g_scale, x_scale, torch.float32).to(weight.dtype)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = dy.float().sum(0).to(ctx.bias_dtype)
    return grad_input, grad_weight, grad_bias, None, None


fp8_train_linear.register_autograd(_backward, setup_context=_setup_context)


class Fp8Linear(nn.Module):
    """An ``nn.Linear`` whose product is :func:`fp8_train_linear`, sharing the linear's parameters (fp32 masters).

    ``recipe="dynamic"`` scales the input and the output's gradient by their own range on every call (what a
    converted graph does). ``recipe="delayed"`` scales them by the largest value of an amax history of the last
    :data:`HISTORY` calls in training (TransformerEngine's default recipe), falling back to the call's own range
    while the history is empty, and records the call's ranges after it (the gradient's by a hook on the output):
    the buffer ``amax_history`` (row 0 the input's, row 1 the gradient's) is in ``state_dict()``, so a checkpoint
    resumes with the scales it left. An eval-mode call reads the history without recording.
    """

    def __init__(self, linear: nn.Linear, recipe: str = "dynamic"):
        super().__init__()
        if recipe not in RECIPES:
            raise InputError(f"Fp8Linear(recipe={recipe!r}): the recipes are {RECIPES}; pass 'dynamic' (each "
                             "call's own range) or 'delayed' (an amax history)")
        self.in_features, self.out_features, self.recipe = linear.in_features, linear.out_features, recipe
        self.weight, self.bias = linear.weight, linear.bias
        if recipe == "delayed":
            self.register_buffer("amax_history", torch.zeros(2, HISTORY, device=linear.weight.device))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``linear(input)`` in fp8 (class docstring)."""
        if self.recipe == "dynamic":
            return fp8_train_linear(input, self.weight, self.bias, None, None)
        history = self.amax_history
        out = fp8_train_linear(input, self.weight, self.bias, history[0].amax(), history[1].amax())
        if self.training:
            _record(history[0], input)
            if out.requires_grad:
                out.register_hook(lambda grad: _record(history[1], grad))
        return out

    def extra_repr(self) -> str:
        """The sizes and the scaling recipe, as ``print(model)`` shows them."""
        return f"in_features={self.in_features}, out_features={self.out_features}, recipe={self.recipe}"


def _record(row: torch.Tensor, value: torch.Tensor) -> None:
    """Push ``value``'s largest magnitude onto an amax history (newest first; a non-finite one is not kept)."""
    with torch.no_grad():
        amax = _amax(value.detach())
        row.copy_(torch.cat([torch.where(torch.isfinite(amax), amax, row[0]).reshape(1), row[:-1]]))


def swap_linears(model: nn.Module, recipe: str = "dynamic") -> nn.Module:
    """A copy of ``model`` with every ``nn.Linear`` an :class:`Fp8Linear` of ``recipe`` (the all-Linear swap, as
    torchao's ``convert_to_float8_training`` makes it); ``model`` itself is not changed."""
    swapped = copy.deepcopy(model)
    for module in list(swapped.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, child_name, Fp8Linear(child, recipe))
    return swapped


def lower_train(gm: fx.GraphModule, names: set[str]) -> None:
    """Rewrite each product of ``gm`` (a bf16-rewritten train graph) named in ``names`` as
    ``amppass::fp8_train_linear`` in place, with dynamic scales. It reads the fp32 master weight itself (the scale
    and the e4m3 values come from fp32, and the weight's gradient comes back fp32), transposed where the product
    stores it in × out; the weight's bf16 cast (and any transpose or broadcast on its way) is dropped where nothing
    else reads it. Each node keeps its name, readers and decision record."""
    for node in list(gm.graph.nodes):
        found = operands(node) if node.name in names else None
        if found is None or found[1] is None:
            continue
        x, weight, bias, transposed = found
        path = weight_path(node)
        if transposed:
            with gm.graph.inserting_before(node):
                weight = gm.graph.call_function(aten.t.default, (weight,))
            if "val" in weight.args[0].meta:
                weight.meta["val"] = weight.args[0].meta["val"].t()
        node.target = torch.ops.amppass.fp8_train_linear.default
        node.args, node.kwargs = (x, weight, bias, None, None), {}
        drop_unread(gm, path)
    gm.recompile()
