"""Lowering chosen matrix products of a bf16-rewritten graph to fp8: e4m3 input and weight, per-tensor scales.

An fp8 plan is a bf16 plan with some products lowered further (:mod:`amppass.fx.runners.fp8` chooses which). A
chosen product of an activation and a stored 2-D weight (:func:`operands`: ``aten.linear``, ``addmm``/``mm``,
``x @ W``, ``bmm`` with the weight broadcast, a plain ``einsum``; the weight read in × out is transposed once, at
conversion) becomes a call of ``amppass::fp8_linear`` (the node keeps its name, its readers and its decision
record), which:

1. quantizes its (bf16) input: ``(x / input_scale)`` clamped to e4m3's largest finite value (e4m3fn has no
   infinity: an unclamped value beyond it would become NaN) and stored as ``torch.float8_e4m3fn``;
2. reads its weight stored once, at conversion, as e4m3 with its own per-tensor scale
   (:meth:`~amppass.dtypes.Fp8Format.scale_for` of the weight's largest magnitude);
3. runs ``torch._scaled_mm``: the products of the e4m3 values summed in fp32, times both scales, plus the bias,
   rounded once to bf16. The same call runs on CUDA (compute capability 8.9+, cuBLASLt's fp8 kernels) and on the
   CPU, where torch 2.13 computes it from the e4m3 values in fp32: numerically what the GPU kernel computes,
   at fp32 matmul speed or slower (the CPU has no fp8 arithmetic).

The input's scale is static (a buffer, from calibrated ranges) or, without calibration, dynamic: the input's
largest magnitude on every call. A scale is never zero, inf or NaN (``scale_for`` gives 1.0 for an all-zero or
non-finite range).

A product can instead have row-wise scales (``amppass::fp8_linear_rowwise``): one scale per output channel of the
weight, computed at conversion, and one per row (token) of the input, computed on every call from that row's
largest magnitude (:meth:`~amppass.dtypes.Fp8Format.scales_for`: 1.0 for an all-zero row, so a zero or constant row
stays finite). ``torch._scaled_mm`` takes them as ``scale_a`` of shape (M, 1) and ``scale_b`` of shape (1, N): on
CUDA its row-wise kernels (compute capability 8.9 and later) write bf16 only; on the CPU torch 2.13 computes the same
from the e4m3 values in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...analysis.record import META_KEY
from ...dtypes import E4M3, Fp8Format
from ..view.build import fetch_attr

aten = torch.ops.aten
# what torch._scaled_mm's CUDA kernels need of a product's inner and outer sizes; planned the same on every target
FP8_ALIGNMENT = 16


def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: Fp8Format = E4M3) -> torch.Tensor:
    """``x / scale`` in ``fmt``, clamped to its largest finite value (NaN stays NaN)."""
    return (x.float() / scale).clamp(-fmt.max, fmt.max).to(fmt.torch)


def dequantize(q: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """The fp32 values an fp8 tensor stored with ``scale`` stands for."""
    return q.float() * scale


def scale_tensor(amax: float, fmt: Fp8Format = E4M3, device: torch.device | None = None) -> torch.Tensor:
    """A per-tensor scale as ``torch._scaled_mm`` reads it: an fp32 scalar tensor, finite and positive."""
    return torch.tensor(fmt.scale_for(amax), dtype=torch.float32, device=device)


@torch.library.custom_op("amppass::fp8_linear", mutates_args=())
def fp8_linear(input: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear(input, weight, bias)`` with ``input`` quantized to e4m3 (``input_scale``, or its own amax where None)
    and ``weight`` stored e4m3 with ``weight_scale``; fp32 accumulation, output in ``input``'s dtype (bf16 in an
    fp8 plan)."""
    out_dtype = input.dtype
    flat = input.reshape(-1, input.shape[-1])
    if input_scale is None:  # dynamic: this call's own range
        amax = float(flat.abs().amax()) if flat.numel() else 0.0
        input_scale = scale_tensor(amax, device=input.device)
    out = torch._scaled_mm(quantize(flat, input_scale), weight.t(), scale_a=input_scale, scale_b=weight_scale,
                           bias=None if bias is None else bias.to(out_dtype), out_dtype=out_dtype)
    return out.reshape(*input.shape[:-1], weight.shape[0])


@fp8_linear.register_fake
def _(input: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
      bias: torch.Tensor | None) -> torch.Tensor:
    return input.new_empty((*input.shape[:-1], weight.shape[0]))


def row_scales(x: torch.Tensor, fmt: Fp8Format = E4M3) -> torch.Tensor:
    """One scale per row of the 2-D ``x`` (shape (M, 1), fp32): each row's largest magnitude mapped to ``fmt``'s
    largest finite value; 1.0 for an all-zero or non-finite row."""
    amax = x.detach().abs().amax(dim=1, keepdim=True) if x.shape[1] else x.new_zeros((x.shape[0], 1))
    return fmt.scales_for(amax)


@torch.library.custom_op("amppass::fp8_linear_rowwise", mutates_args=())
def fp8_linear_rowwise(input: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """``linear(input, weight, bias)`` with row-wise scales: ``weight`` stored e4m3 with one scale per output channel
    (``weight_scale``, shape (N, 1)), each row of ``input`` quantized to e4m3 with its own scale, computed on this
    call (:func:`row_scales`); fp32 accumulation, output in ``input``'s dtype (bf16: the only output torch's CUDA
    row-wise kernels write)."""
    out_dtype = input.dtype
    flat = input.reshape(-1, input.shape[-1])
    input_scale = row_scales(flat)
    out = torch._scaled_mm(quantize(flat, input_scale), weight.t(), scale_a=input_scale,
                           scale_b=weight_scale.reshape(1, -1), bias=None if bias is None else bias.to(out_dtype),
                           out_dtype=out_dtype)
    return out.reshape(*input.shape[:-1], weight.shape[0])


@fp8_linear_rowwise.register_fake
def _(input: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
      bias: torch.Tensor | None) -> torch.Tensor:
    return input.new_empty((*input.shape[:-1], weight.shape[0]))


TENSOR, ROW = "tensor", "row"  # scale granularities: one scale per tensor; per weight channel and per input row


@dataclass(frozen=True)
class Fp8Product:
    """A product chosen for fp8: its node, its fp32 weight, its input's calibrated range (None: dynamic) and its
    scales' granularity (:data:`TENSOR`, or :data:`ROW`: per output channel of the weight and per row of the input,
    the input's always dynamic)."""

    node: str
    weight: torch.Tensor  # fp32, as captured
    input_amax: float | None
    granularity: str = TENSOR

    @property
    def weight_scale(self) -> float:
        """The weight's per-tensor scale, computed once, at conversion."""
        return E4M3.scale_for(float(self.weight.detach().abs().amax()) if self.weight.numel() else 0.0)

    @property
    def weight_scales(self) -> torch.Tensor:
        """The weight's scales as the product reads them: an fp32 scalar, or one per output channel (N, 1)."""
        if self.granularity == ROW:
            return row_scales(self.weight.detach().float())
        return torch.tensor(self.weight_scale, dtype=torch.float32, device=self.weight.device)

    @property
    def input_scale(self) -> float | None:
        """The input's static scale from calibration, or None where it is computed per call (always for rows)."""
        return None if self.input_amax is None or self.granularity == ROW else E4M3.scale_for(self.input_amax)

    def stored_weight(self) -> torch.Tensor:
        """The weight in e4m3 with :attr:`weight_scales`."""
        return quantize(self.weight.detach(), self.weight_scales)

    def read_weight(self) -> torch.Tensor:
        """The fp32 values the stored weight stands for."""
        return dequantize(self.stored_weight(), self.weight_scales)

    def read_input(self, x: torch.Tensor) -> torch.Tensor:
        """The fp32 values ``x`` (2-D) stands for once quantized as this product quantizes its input."""
        if self.granularity == ROW:
            scale: torch.Tensor | float = row_scales(x)
        elif self.input_scale is None:
            scale = E4M3.scale_for(float(x.detach().abs().amax()) if x.numel() else 0.0)
        else:
            scale = self.input_scale
        return dequantize(quantize(x, scale), scale)


@dataclass(frozen=True)
class Stored:
    """A stored tensor as a product reads it: its ``get_attr`` node, the nodes from the operand the product reads
    down to it (``path``: the operand first, ``attr`` last; casts, transposes and broadcasts over leading batch
    dimensions), whether they swap its two dimensions, and its number of dimensions (None where the graph does not
    record it)."""

    attr: fx.Node
    path: tuple[fx.Node, ...]
    flipped: bool
    dims: int | None


NOT_LINEAR = "not a linear layer's product"  # the start of every reason for a form of product fp8_linear cannot run
TWO_ACTIVATIONS = ("a product of two activations (attention scores, an attention-weighted sum): neither operand is "
                   "stored, so no scale can be computed at conversion")
_TRANSPOSES = {aten.t.default, aten.numpy_T.default, aten.mT.default, aten.transpose.int, aten.permute.default}
_BROADCASTS = {aten.expand.default, aten.unsqueeze.default}


def _shape(value: object) -> tuple | None:
    """The shape the graph records for ``value`` (a cast's from what it casts: the rewrites record none), or None."""
    while isinstance(value, fx.Node) and "val" not in value.meta and value.target is aten._to_copy.default:
        value = value.args[0]
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _swaps(node: fx.Node) -> bool:
    """Whether a transposing op (one of ``_TRANSPOSES``) applied to a matrix swaps its two dimensions."""
    if node.target is aten.transpose.int:
        return node.args[1] % 2 != node.args[2] % 2
    if node.target is aten.permute.default:
        return [d % 2 for d in node.args[1]] == [1, 0]
    return True


def stored(value: object) -> Stored | None:
    """The stored tensor ``value`` reads (:class:`Stored`), through casts, transposes of a matrix and broadcasts that
    add leading batch dimensions (``W.unsqueeze(0).expand(b, -1, -1)`` for a ``bmm``); None for a computed value."""
    path: list[fx.Node] = []
    flipped = False
    while isinstance(value, fx.Node) and value.op == "call_function" and value.args:
        source = value.args[0]
        shape = _shape(source)
        if value.target in _TRANSPOSES and shape is not None and len(shape) == 2:
            flipped ^= _swaps(value)
        elif value.target is aten.unsqueeze.default and value.args[1] != 0:
            return None
        elif value.target not in _BROADCASTS and value.target is not aten._to_copy.default:
            return None
        path.append(value)
        value = source
    if not isinstance(value, fx.Node) or value.op != "get_attr":
        return None
    shape = _shape(value)
    return Stored(value, (*path, value), flipped, None if shape is None else len(shape))


def _same(a: tuple, b: tuple) -> bool:
    """Whether two shapes (of ints or symbolic sizes) are known equal, without adding a guard."""
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b, strict=True))


def _einsum(node: fx.Node) -> tuple[object, object, bool] | str:
    """``(input, weight operand, weight read in x out)`` of an ``aten.einsum`` that is a plain product of an
    activation and a 2-D stored weight (the input's last index contracted with one of the weight's two, the output
    the input's other indices in order followed by the weight's other one: what ``linear`` computes); why not
    otherwise."""
    equation, values = str(node.args[0]), list(node.args[1])
    prefix = f"{NOT_LINEAR}: einsum {equation!r}"
    if len(values) != 2:
        return f"{prefix} has {len(values)} operands, not an activation and a weight"
    found = [stored(v) is not None for v in values]
    if found == [False, False]:
        return TWO_ACTIVATIONS
    if found == [True, True]:
        return f"{prefix} multiplies two stored tensors (a constant), not an activation and a weight"
    specs, _, out = equation.replace(" ", "").partition("->")
    x_spec, w_spec = specs.split(",")[::1 if found[1] else -1]
    x, w = values[::1 if found[1] else -1]
    if "->" not in equation:  # implicit output: the indices seen once, sorted, broadcast ones first
        letters = specs.replace(",", "").replace(".", "")
        out = ("..." if "..." in specs else "") + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    if len(w_spec) != 2 or w_spec[0] == w_spec[1]:
        return f"{prefix}: its stored operand's subscripts {w_spec!r} are not a matrix's two distinct indices"
    body = x_spec.removeprefix("...")
    if not body or "." in body or len(set(body)) != len(body):
        return f"{prefix}: the activation's subscripts {x_spec!r} are not distinct indices"
    inner = body[-1]
    if inner not in w_spec or set(body[:-1]) & set(w_spec):
        return (f"{prefix}: the activation's last index {inner!r} must be the only one it shares with the weight "
                f"{w_spec!r} (the contracted one)")
    outer = w_spec.replace(inner, "")
    if out != x_spec[:-1] + outer:
        return (f"{prefix}: its output {out!r} is not the activation's other indices in order followed by the "
                f"weight's {outer!r} ({x_spec[:-1] + outer!r})")
    return x, w, w_spec == inner + outer


def _product(node: fx.Node) -> tuple[object, object, object, bool] | str | None:
    """``(input, weight operand, bias, weight read in x out)`` of a product that can read a weight: ``aten.linear``
    (out x in), ``addmm``/``mm``/``matmul``/``bmm`` (the weight second, in x out) and a plain ``einsum``
    (:func:`_einsum`); why not for one whose form cannot be a linear layer's product; None for another node."""
    if node.op != "call_function":
        return None
    if node.target is aten.linear.default:
        return node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs.get("bias"), False
    if node.target is aten.einsum.default:
        found = _einsum(node)
        if isinstance(found, str):
            return found
        parts: tuple[object, object, object, bool] = (found[0], found[1], None, found[2])
    elif node.target is aten.addmm.default and len(node.args) == 3 and not node.kwargs:
        parts = node.args[1], node.args[2], node.args[0], True
    elif node.target in (aten.mm.default, aten.matmul.default, aten.bmm.default):
        parts = node.args[0], node.args[1], None, True
    else:
        return None
    weight = stored(parts[1])
    if weight is None and stored(parts[0]) is not None and node.target is not aten.einsum.default:
        return (f"{NOT_LINEAR}: its stored operand is the first (weight @ activation), which mixes the activation's "
                "rows; fp8_linear reads the weight as the second operand")
    if weight is None or node.target in (aten.addmm.default, aten.mm.default):
        return parts
    if weight.dims != 2:
        return (f"{NOT_LINEAR}: its stored operand is {weight.dims}-D (a matrix per batch), not one 2-D weight"
                if weight.dims else f"{NOT_LINEAR}: its stored operand's dimensions are not recorded in the graph")
    out, x = _shape(node), _shape(parts[0])
    if out is None or x is None or not _same(out[:-1], x[:-1]):
        return f"{NOT_LINEAR}: its stored operand broadcasts the activation's batch dimensions"
    return parts


def operands(node: fx.Node) -> tuple[object, fx.Node | None, object, bool] | None:
    """``(input, stored weight, bias, transposed)`` of a product with a weight: ``aten.linear(x, W, b)`` (W stored
    out × in), ``aten.addmm(b, x, W)`` / ``aten.mm(x, W)`` (W read in × out, as transformers' ``Conv1D``
    multiplies), ``aten.matmul``/``aten.bmm(x, W)`` (W read second, in × out, once or broadcast over a batch) or a
    plain ``aten.einsum`` of an activation and a 2-D weight in either orientation (``"...i,oi->...o"``,
    ``"bsi,io->bso"``). The weight is read through casts and transposes: ``transposed`` says whether the stored
    tensor is in × out. None for another node, an ``addmm`` with ``beta``/``alpha``, or a form
    :func:`not_lowered` explains."""
    parts = _product(node)
    if not isinstance(parts, tuple):
        return None
    x, value, bias, in_out = parts
    weight = stored(value)
    return x, None if weight is None else weight.attr, bias, in_out != (weight is not None and weight.flipped)


def weight_path(node: fx.Node) -> tuple[fx.Node, ...]:
    """The nodes from the weight operand a product (:func:`operands`) reads down to its stored tensor; empty where it
    has none."""
    parts = _product(node)
    weight = stored(parts[1]) if isinstance(parts, tuple) else None
    return () if weight is None else weight.path


def not_lowered(node: fx.Node) -> str:
    """Why a matrix product has no stored weight :func:`operands` can lower, in a few words ("" where it has one)."""
    parts = _product(node)
    if isinstance(parts, str):
        return parts
    if parts is None or stored(parts[1]) is not None:
        return ""
    if node.target is aten.linear.default:
        return "its weight is computed in the graph, not stored, so no scale is computed at conversion"
    return TWO_ACTIVATIONS


def drop_unread(gm: fx.GraphModule, nodes: Iterable[fx.Node]) -> None:
    """Erase those of ``nodes`` (weight paths, :func:`weight_path`) that nothing reads any more, readers first, and
    the attributes of stored tensors no node reads."""
    unread = set(nodes)
    for node in reversed(list(gm.graph.nodes)):
        if node not in unread or node.users:
            continue
        unread.update(n for n in node.all_input_nodes if n.target is aten.sym_size.int)  # a broadcast's batch size
        gm.graph.erase_node(node)
        target = str(node.target)
        if node.op == "get_attr" and not any(n.op == "get_attr" and n.target == target for n in gm.graph.nodes):
            owner, _, leaf = target.rpartition(".")
            delattr(gm.get_submodule(owner) if owner else gm, leaf)


def linear_weights(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """Each product with a stored weight (:func:`operands`) by node name: its fp32 weight, out × in as a linear
    layer stores it (one read in × out, as a ``Conv1D``'s or ``x @ W``'s, transposed), read from ``gm`` before the
    bf16 rewrite converts it (an fp8 weight is quantized from fp32 values, not from their bf16 rounding)."""
    found = {}
    for node in gm.graph.nodes:
        parts = operands(node)
        if parts is not None and parts[1] is not None:
            weight = fetch_attr(gm, str(parts[1].target))
            if weight.dim() == 2:
                found[node.name] = weight.t() if parts[3] else weight
    return found


def lower(gm: fx.GraphModule, products: Mapping[str, Fp8Product]) -> None:
    """Rewrite each chosen product of ``gm`` (bf16-rewritten; a product with a stored weight, :func:`operands`) as
    ``amppass::fp8_linear`` in place (or
    ``amppass::fp8_linear_rowwise`` for a product with row-wise scales): its weight stored e4m3 with its scale(s),
    its input's static scale where calibrated; weights no node reads any more are dropped, with the casts and
    transposes that read them. The decision records stay on the nodes (the caller states the fp8 reason)."""
    dropped: list[fx.Node] = []
    for node in list(gm.graph.nodes):
        product = products.get(node.name)
        parts = operands(node) if product is not None else None
        if parts is None:
            continue
        x, _, bias, _ = parts
        dropped.extend(weight_path(node))
        stem = f"_fp8_{node.name}"
        device = product.weight.device
        gm.register_buffer(f"{stem}_weight", product.stored_weight())
        gm.register_buffer(f"{stem}_weight_scale", product.weight_scales)
        with gm.graph.inserting_before(node):
            attrs = [gm.graph.get_attr(f"{stem}_weight"), gm.graph.get_attr(f"{stem}_weight_scale")]
            if product.input_scale is not None:
                gm.register_buffer(f"{stem}_input_scale", torch.tensor(product.input_scale, dtype=torch.float32,
                                                                 device=device))
                attrs.append(gm.graph.get_attr(f"{stem}_input_scale"))
            elif product.granularity == TENSOR:
                attrs.append(None)
        for attr in attrs:
            if attr is not None:
                attr.meta["val"] = fetch_attr(gm, str(attr.target))
        if product.granularity == ROW:
            node.target = torch.ops.amppass.fp8_linear_rowwise.default
            node.args, node.kwargs = (x, attrs[0], attrs[1], bias), {}
        else:
            node.target = torch.ops.amppass.fp8_linear.default
            node.args, node.kwargs = (x, attrs[0], attrs[1], attrs[2], bias), {}
    drop_unread(gm, dropped)
    gm.recompile()


def fp8_evidence(product: Fp8Product) -> dict[str, object]:
    """What an fp8 row of the report shows: the format, the scales' granularity and how each is computed, the
    weight's scale (per tensor) or a summary of its per-channel scales, the input's scale (a number where static)
    and the headroom: the powers of two between the largest magnitude a scale maps and e4m3's largest value."""
    found: dict[str, object] = {"format": E4M3.name, "granularity": product.granularity, "headroom": 0,
                                "output": "bf16", "kernel": "torch._scaled_mm", "input_amax": product.input_amax}
    if product.granularity == ROW:
        scales = product.weight_scales
        found.update(scales="weight: one per output channel, at conversion; input: one per row, from that row's "
                            "largest magnitude on every call",
                     weight_scale="per channel", input_scale="dynamic, per row",
                     weight_scales={"channels": int(scales.numel()), "min": float(scales.min()),
                                    "max": float(scales.max())})
    else:
        found.update(scales="weight: one per tensor, at conversion; input: one per tensor, " + (
                         "from calibration" if product.input_scale is not None else "from its largest magnitude on "
                         "every call"),
                     weight_scale=product.weight_scale,
                     input_scale="dynamic" if product.input_scale is None else product.input_scale)
    return found


def mark(gm: fx.GraphModule, node_name: str, fp8: Mapping[str, object], reason: str) -> None:
    """Record a product's fp8 outcome on its node: ``fp8`` in its evidence, ``reason`` put before its bf16 reason."""
    for node in gm.graph.nodes:
        meta = node.meta.get(META_KEY)
        if node.name == node_name and meta and not meta.get("cast"):
            meta["evidence"] = {**meta.get("evidence", {}), "fp8": dict(fp8)}
            meta["reason"] = f"{reason} ({meta['reason']})" if meta.get("reason") else reason
            return
