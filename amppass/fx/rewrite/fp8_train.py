"""fp8 training: a linear product with e4m3 forward operands and e5m2 gradients, and its lowering in a train graph.

``amppass::fp8_train_linear(input, weight, bias, input_amax, grad_amax, grad_history)`` computes
``linear(input, weight, bias)`` (its output 0; outputs 1 and 2 are the e4m3 input and its scale, for its backward)
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

What backward keeps of the input is its e4m3 copy and its scale (1 byte an element, not bf16's 2): the forward's
own, which the op returns beside the product (callers read only the product) so that its autograd context can save
them, not the bf16 input; the input is quantized once a step. The weight saved is the fp32 master itself (a
parameter, held anyway), quantized again in the backward (:func:`fp8_train_linear` says why).

**Delayed scaling in a graph** (:func:`lower_train` with ``recipe="delayed"``): each lowered product gets two
buffers of :data:`HISTORY` amaxes, newest first, the input's and the output gradient's, held by the module that
holds its weight (``<module>.fp8_input_amax_history``, ``<module>.fp8_grad_amax_history``), so they are state of
the converted model and in its ``state_dict()``. The graph reads each history's largest value as the delayed amax
(0 while empty: the call's own range); a train graph then records the input's amax by
``amppass::fp8_record_amax`` (a custom op declaring the buffer it mutates, so export and ``torch.compile`` keep
the write), and the op's backward records the gradient's into ``grad_history``; an eval graph only reads. A
non-finite amax is not recorded (the newest finite one is repeated). The gradient's history is written in backward
without moving its version counter (:func:`fp8_record_grad_amax`), so two forward calls before one backward (two
views of a batch) stay valid, in eager mode and under ``torch.compile``. Under data parallelism (a default
process group of more than one rank) each amax is the largest over the ranks (``amppass::fp8_amax_across_ranks``,
one ``all_reduce(MAX)`` per record) before it is recorded, so every rank holds the same histories
(:class:`Fp8Linear`'s too).

e5m2's range (up to 57344 times its scale, which follows the gradient's own amax) is why fp8 training needs no
loss scaling: a gradient is scaled into range by its own scale in every product, whatever the loss's size.

On the CPU (torch 2.13 runs ``torch._scaled_mm`` there from the fp8 values in fp32, for every combination of
formats) the same call runs, numerically what the GPU kernels compute; inner sizes are padded with zeros to a
multiple of 16 (the token count of ``dW``'s product), which adds nothing to the sums.
"""

from __future__ import annotations

import contextlib
import copy
import operator
from typing import Iterator

import torch
from torch import distributed as dist
from torch import fx, nn

from ...analysis.options import FP8_RECIPES
from ...dtypes import E4M3, E5M2, Fp8Format
from ...errors import InputError
from ..view.build import fetch_attr
from .fp8 import FP8_ALIGNMENT, drop_unread, operands, quantize, weight_path

aten = torch.ops.aten
HISTORY = 16  # delayed scaling's amax history: TransformerEngine's default length
RECIPES = FP8_RECIPES
STATE_KEY = "amppass_fp8_state"  # gm.meta: the buffers a delayed lowering added (the converted model's state)
INPUT_HISTORY, GRAD_HISTORY = "fp8_input_amax_history", "fp8_grad_amax_history"


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
                     input_amax: torch.Tensor | None, grad_amax: torch.Tensor | None,
                     grad_history: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(linear(input, weight, bias), input in e4m3, its scale)``: the product with ``input`` and ``weight`` in
    e4m3, fp32 accumulation, in ``input``'s dtype; its backward reads the output's gradient in e5m2 (module
    docstring). Callers read element 0; the other two are the forward's e4m3 copy of ``input`` (its shape) and
    its scale, outputs so that the autograd context saves them for the backward instead of quantizing ``input``
    again (one amax and one pass over the input fewer a step). ``input_amax`` and ``grad_amax``: the ranges of
    delayed scaling, or None (or 0) for the current call's own; ``grad_history``: an amax history the backward
    records the gradient's range into (delayed scaling in a train graph), or None.

    The weight is quantized again in the backward rather than saved: its e4m3 copy would add a byte per weight
    element to what a step holds for backward, while the fp32 master it comes from is saved for free (a
    parameter, held anyway); one amax and one pass over the weight are cheap next to the two products."""
    flat = input.reshape(-1, input.shape[-1])
    x_q, x_scale = _quantized(flat, E4M3, input_amax)
    x_q = x_q.contiguous()  # what the product reads anyway, and the layout the fake outputs declare
    w_q, w_scale = _quantized(weight, E4M3)
    out = _product(x_q, w_q.t(), x_scale, w_scale, torch.float32)
    if bias is not None:
        out = out + bias.float()
    return out.to(input.dtype).reshape(*input.shape[:-1], weight.shape[0]), x_q.view(input.shape), x_scale


@fp8_train_linear.register_fake
def _(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, input_amax: torch.Tensor | None,
      grad_amax: torch.Tensor | None, grad_history: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                       torch.Tensor]:
    return _outputs_like(input, weight.shape[0])


def _outputs_like(input: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty tensors shaped as :func:`fp8_train_linear`'s outputs for ``input`` (fake ones for fake inputs)."""
    return (input.new_empty((*input.shape[:-1], out_features)), input.new_empty(input.shape, dtype=E4M3.torch),
            input.new_empty((), dtype=torch.float32))


def _setup_context(ctx, inputs: tuple, output: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """Save the forward's e4m3 copy of the input and its scale (outputs 1 and 2, not differentiable), not the
    input itself."""
    _, weight, bias, _, grad_amax, grad_history = inputs
    _, x_q, x_scale = output
    ctx.mark_non_differentiable(x_q, x_scale)
    ctx.set_materialize_grads(False)  # no zero gradients made for the two outputs nothing differentiates
    ctx.output_shape = output[0].shape
    ctx.save_for_backward(x_q, x_scale, weight, grad_amax, grad_history)
    ctx.input_dtype = inputs[0].dtype
    ctx.has_bias = bias is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _backward(ctx, grad: torch.Tensor | None, _x_q_grad: None, _x_scale_grad: None) -> tuple:
    x_q, x_scale, weight, grad_amax, grad_history = ctx.saved_tensors
    if grad is None:  # an undefined gradient of the product: zeros, as autograd makes them for an op that asks
        grad = x_q.new_zeros(ctx.output_shape, dtype=ctx.input_dtype)
    dy = grad.reshape(-1, grad.shape[-1])
    g_q, g_scale = _quantized(dy, E5M2, grad_amax)
    w_q, w_scale = _quantized(weight, E4M3)
    grad_input = grad_weight = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_input = _product(g_q, w_q, g_scale, w_scale, torch.float32).to(ctx.input_dtype).reshape(x_q.shape)
    if ctx.needs_input_grad[1]:
        grad_weight = _product(g_q.t(), x_q.reshape(-1, x_q.shape[-1]), g_scale, x_scale, torch.float32).to(
            weight.dtype)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = dy.float().sum(0).to(ctx.bias_dtype)
    if grad_history is not None:
        fp8_record_grad_amax(grad_history, _amax(dy.detach()))
    return grad_input, grad_weight, grad_bias, None, None, None


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
            return fp8_train_linear(input, self.weight, self.bias, None, None)[0]
        history = self.amax_history
        out = fp8_train_linear(input, self.weight, self.bias, history[0].amax(), history[1].amax())[0]
        if self.training:
            _record(history[0], input)
            if out.requires_grad:
                out.register_hook(lambda grad: _record(history[1], grad))
        return out

    def extra_repr(self) -> str:
        """The sizes and the scaling recipe, as ``print(model)`` shows them."""
        return f"in_features={self.in_features}, out_features={self.out_features}, recipe={self.recipe}"


def _record(row: torch.Tensor, value: torch.Tensor) -> None:
    """Push ``value``'s largest magnitude onto an amax history (:func:`_push`)."""
    _push(row, _amax(value.detach()))


def _push(row: torch.Tensor, amax: torch.Tensor) -> None:
    """Push the range ``amax`` (0-d, fp32) onto an amax history (newest first; a non-finite one is not kept). Under
    data parallelism (:func:`_data_parallel`) the largest over every rank's (:func:`fp8_amax_across_ranks`), so the
    ranks' histories, and the delayed scales they give, stay equal."""
    with torch.no_grad():
        if _data_parallel():
            amax = fp8_amax_across_ranks(amax)
        row.copy_(torch.cat([torch.where(torch.isfinite(amax), amax, row[0]).reshape(1), row[:-1]]))


_PROBING = [False]  # within local_amaxes(): records stay this process's own


@contextlib.contextmanager
def local_amaxes() -> Iterator[None]:
    """Within this block, amaxes are recorded without reducing them across ranks: for the runs a conversion makes
    to measure or check a converted model (their buffers restored after), which one rank may make alone, where a
    collective would wait for ranks that never join it."""
    before, _PROBING[0] = _PROBING[0], True
    try:
        yield
    finally:
        _PROBING[0] = before


def _data_parallel() -> bool:
    """Whether ``torch.distributed`` runs a default process group of more than one rank (one process records alone,
    with no collective), outside :func:`local_amaxes`."""
    return not _PROBING[0] and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@torch.library.custom_op("amppass::fp8_amax_across_ranks", mutates_args=())
def fp8_amax_across_ranks(amax: torch.Tensor) -> torch.Tensor:
    """The largest of every rank's ``amax`` (a 0-d fp32 tensor): one ``all_reduce(op=MAX)`` over the default process
    group, as TransformerEngine reduces its amaxes before recording them. A non-finite ``amax`` enters as inf, so
    the result is inf on every rank and no rank records it (a NaN's order against finite values is the backend's).
    A custom op, so that a compiled forward's record holds one opaque node (the backward's runs within
    :func:`fp8_record_grad_amax`)."""
    reduced = torch.where(torch.isfinite(amax), amax, torch.full_like(amax, float("inf")))
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
    return reduced


@fp8_amax_across_ranks.register_fake
def _(amax: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(amax)


@torch.library.custom_op("amppass::fp8_record_amax", mutates_args=("history",))
def fp8_record_amax(history: torch.Tensor, value: torch.Tensor) -> None:
    """Push ``value``'s largest magnitude onto the amax history ``history`` in place (:func:`_record`): a train
    graph's record of a product's input range under delayed scaling."""
    _record(history, value)


@fp8_record_amax.register_fake
def _(history: torch.Tensor, value: torch.Tensor) -> None:
    return None


@torch.library.custom_op("amppass::fp8_record_grad_amax", mutates_args=())
def fp8_record_grad_amax(history: torch.Tensor, amax: torch.Tensor) -> None:
    """Push a gradient's range ``amax`` onto the amax history ``history`` in place (:func:`_push`) without a new
    autograd version: the record :func:`fp8_train_linear`'s backward makes under delayed scaling.

    Every forward call saves ``history`` for its backward (the tensor that backward writes into), and autograd
    checks a saved tensor's version when a backward unpacks it: where a model is called twice before one backward
    (two views of a batch), the second call's backward runs first and writes the history, and a new version would
    make the first call's backward refuse it. No backward reads what its forward read of the history (the delayed
    range is read in the forward and saved; the record reads the history as it is when it writes), so keeping its
    version is safe. The op is opaque and declares no mutation so that ``torch.compile`` keeps this write as it
    is: traced, the write would become a graph-level ``copy_`` that moves the version (``backend="aot_eager"``
    then refuses two forwards before one backward). It has an ordered effect (``torch.library``'s effect tokens),
    so no compiler drops it for having no output."""
    with torch.autograd._unsafe_preserve_version_counter(history):
        _push(history, amax)


@fp8_record_grad_amax.register_fake
def _(history: torch.Tensor, amax: torch.Tensor) -> None:
    return None


fp8_record_grad_amax.register_effect(torch.library.EffectType.ORDERED)


def swap_linears(model: nn.Module, recipe: str = "dynamic") -> nn.Module:
    """A copy of ``model`` with every ``nn.Linear`` an :class:`Fp8Linear` of ``recipe`` (the all-Linear swap, as
    torchao's ``convert_to_float8_training`` makes it); ``model`` itself is not changed."""
    swapped = copy.deepcopy(model)
    for module in list(swapped.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, child_name, Fp8Linear(child, recipe))
    return swapped


def lower_train(gm: fx.GraphModule, names: set[str], recipe: str = "dynamic", record: bool = True) -> list[str]:
    """Rewrite each product of ``gm`` (a bf16-rewritten train or eval graph) named in ``names`` as
    ``amppass::fp8_train_linear`` in place. It reads the fp32 master weight itself (the scale and the e4m3 values
    come from fp32, and the weight's gradient comes back fp32), transposed where the product stores it in × out;
    the weight's bf16 cast (and any transpose or broadcast on its way) is dropped where nothing else reads it.
    Each node keeps its name and decision record; its readers read the product, the op's element 0, through a
    ``getitem`` after it.

    ``recipe="dynamic"`` scales from each call's own ranges. ``recipe="delayed"`` gives each product its two amax
    histories (module docstring) as buffers of ``gm`` and reads them; with ``record`` (a train graph) the input's
    range is recorded after the product and the gradient's by its backward. Returns the buffers added (also in
    ``gm.meta[STATE_KEY]``)."""
    added: list[str] = []
    for node in list(gm.graph.nodes):
        found = operands(node) if node.name in names else None
        if found is None or found[1] is None:
            continue
        x, weight, bias, transposed = found
        path = weight_path(node)
        with gm.graph.inserting_before(node):
            if transposed:
                weight = gm.graph.call_function(aten.t.default, (weight,))
                if "val" in weight.args[0].meta:
                    weight.meta["val"] = weight.args[0].meta["val"].t()
            histories = [_in_module(gm.graph.get_attr(_history(gm, str(found[1].target), leaf, added)), node)
                         for leaf in (INPUT_HISTORY, GRAD_HISTORY)] if recipe == "delayed" else []
            amaxes = [_in_module(gm.graph.call_function(aten.amax.default, (h,)), node) for h in histories]
        node.target = torch.ops.amppass.fp8_train_linear.default
        recorded = histories[1] if histories and record else None
        node.args, node.kwargs = (x, weight, bias, *(amaxes or (None, None)), recorded), {}
        product = _read_product(gm, node)
        if histories and record:
            with gm.graph.inserting_after(product):
                _in_module(gm.graph.call_function(torch.ops.amppass.fp8_record_amax.default, (histories[0], x)), node)
        drop_unread(gm, path)
    gm.meta[STATE_KEY] = added
    gm.recompile()
    return added


def _read_product(gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    """A ``getitem`` of element 0 (the product) of ``node``, now an :func:`fp8_train_linear`, that every reader of
    ``node`` reads instead; it takes over the product's ``meta["val"]`` (and ``tensor_meta``), and ``node`` (its
    name and decision record unchanged) gets the op's three outputs as its value."""
    with gm.graph.inserting_after(node):
        product = _in_module(gm.graph.call_function(operator.getitem, (node, 0)), node)
    node.replace_all_uses_with(product, delete_user_cb=lambda user: user is not product)
    product.meta.update({key: node.meta.pop(key) for key in ("val", "tensor_meta") if key in node.meta})
    x, val = node.args[0], product.meta.get("val")
    if isinstance(val, torch.Tensor) and isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor):
        node.meta["val"] = _outputs_like(x.meta["val"], val.shape[-1])
    return product


def _in_module(new: fx.Node, product: fx.Node) -> fx.Node:
    """``new``, a node the lowering added, placed in the module stack of the product it serves (so the
    model's module tree runs it inside that module)."""
    if "nn_module_stack" in product.meta:
        new.meta["nn_module_stack"] = product.meta["nn_module_stack"]
    return new


def _history(gm: fx.GraphModule, weight: str, leaf: str, added: list[str]) -> str:
    """Register an empty amax history of :data:`HISTORY` values in ``gm``, held by the module that holds
    ``weight`` (``leaf``, numbered after the first where that module's weight feeds several products); its name."""
    owner_name, _, _ = weight.rpartition(".")
    owner = gm.get_submodule(owner_name) if owner_name else gm
    count = sum(name.startswith(leaf) for name in owner._buffers)
    own = leaf if not count else f"{leaf}_{count}"
    device = fetch_attr(gm, weight).device
    owner.register_buffer(own, torch.zeros(HISTORY, dtype=torch.float32, device=device))
    added.append(f"{owner_name}.{own}" if owner_name else own)
    return added[-1]
