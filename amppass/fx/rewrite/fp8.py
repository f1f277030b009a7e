"""Lowering chosen matrix products of a bf16-rewritten graph to fp8: e4m3 input and weight, per-tensor scales.

An fp8 plan is a bf16 plan with some products lowered further (:mod:`amppass.fx.runners.fp8` chooses which). A
chosen ``aten.linear`` node becomes a call of ``amppass::fp8_linear`` (the node keeps its name, its readers and its
decision record), which:

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
from typing import Mapping

import torch
from torch import fx

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


def master(value: object) -> fx.Node | None:
    """The stored tensor a product's weight operand reads: a ``get_attr`` node, directly or through the one cast the
    train rewrite puts in front of it; None for a computed value."""
    if isinstance(value, fx.Node) and value.op == "call_function" and value.target is aten._to_copy.default:
        value = value.args[0]
    return value if isinstance(value, fx.Node) and value.op == "get_attr" else None


def operands(node: fx.Node) -> tuple[object, fx.Node | None, object, bool] | None:
    """``(input, stored weight, bias, transposed)`` of a product with a weight: ``aten.linear(x, W, b)`` (W stored
    out × in) or ``aten.addmm(b, x, W)`` / ``aten.mm(x, W)`` (W stored in × out, as transformers' ``Conv1D``
    multiplies); None for another node, or an ``addmm`` with ``beta``/``alpha``."""
    if node.op != "call_function":
        return None
    if node.target is aten.linear.default:
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        return node.args[0], master(node.args[1]), bias, False
    if node.target is aten.addmm.default and len(node.args) == 3 and not node.kwargs:
        return node.args[1], master(node.args[2]), node.args[0], True
    if node.target is aten.mm.default:
        return node.args[0], master(node.args[1]), None, True
    return None


def linear_weights(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """Each product with a stored weight (:func:`operands`) by node name: its fp32 weight, out × in as a linear
    layer stores it (a ``Conv1D``'s in × out weight transposed), read from ``gm`` before the bf16 rewrite converts it
    (an fp8 weight is quantized from fp32 values, not from their bf16 rounding)."""
    found = {}
    for node in gm.graph.nodes:
        parts = operands(node)
        if parts is not None and parts[1] is not None:
            weight = fetch_attr(gm, str(parts[1].target))
            found[node.name] = weight.t() if parts[3] else weight
    return found


def lower(gm: fx.GraphModule, products: Mapping[str, Fp8Product]) -> None:
    """Rewrite each chosen product of ``gm`` (bf16-rewritten; ``aten.linear``, or ``addmm``/``mm`` with a stored
    weight) as ``amppass::fp8_linear`` in place (or
    ``amppass::fp8_linear_rowwise`` for a product with row-wise scales): its weight stored e4m3 with its scale(s),
    its input's static scale where calibrated; weights no node reads any more are dropped. The decision records
    stay on the nodes (the caller states the fp8 reason)."""
    dropped: set[fx.Node] = set()
    for node in list(gm.graph.nodes):
        product = products.get(node.name)
        parts = operands(node) if product is not None else None
        if parts is None:
            continue
        x, _, bias, _ = parts
        weight = node.args[1] if node.target is aten.linear.default else node.args[-1]
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
        dropped.add(weight)
    for weight in dropped:
        if not weight.users:
            target = str(weight.target)
            gm.graph.erase_node(weight)
            if not any(n.op == "get_attr" and n.target == target for n in gm.graph.nodes):
                owner, _, leaf = target.rpartition(".")
                delattr(gm.get_submodule(owner) if owner else gm, leaf)
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
