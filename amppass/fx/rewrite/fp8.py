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


@dataclass(frozen=True)
class Fp8Product:
    """A product chosen for fp8: its node, its fp32 weight, and its input's calibrated range (None: dynamic)."""

    node: str
    weight: torch.Tensor  # fp32, as captured
    input_amax: float | None

    @property
    def weight_scale(self) -> float:
        """The weight's per-tensor scale, computed once, at conversion."""
        return E4M3.scale_for(float(self.weight.detach().abs().amax()) if self.weight.numel() else 0.0)

    @property
    def input_scale(self) -> float | None:
        """The input's static scale from calibration, or None where it is computed per call."""
        return None if self.input_amax is None else E4M3.scale_for(self.input_amax)


def linear_weights(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """Each ``aten.linear`` node's weight tensor, by node name, read from ``gm`` before the bf16 rewrite converts it
    (an fp8 weight is quantized from fp32 values, not from their bf16 rounding)."""
    found = {}
    for node in gm.graph.nodes:
        if node.target is aten.linear.default and isinstance(node.args[1], fx.Node) and node.args[1].op == "get_attr":
            found[node.name] = fetch_attr(gm, str(node.args[1].target))
    return found


def lower(gm: fx.GraphModule, products: Mapping[str, Fp8Product]) -> None:
    """Rewrite each chosen ``aten.linear`` node of ``gm`` (bf16-rewritten) as ``amppass::fp8_linear`` in place: its
    weight stored e4m3 with its scale, its input's static scale where calibrated; weights no node reads any more
    are dropped. The decision records stay on the nodes (the caller states the fp8 reason)."""
    dropped: set[fx.Node] = set()
    for node in list(gm.graph.nodes):
        product = products.get(node.name)
        if product is None or node.target is not aten.linear.default:
            continue
        x, weight = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        stem = f"_fp8_{node.name}"
        device = product.weight.device
        w_scale = product.weight_scale
        gm.register_buffer(f"{stem}_weight", quantize(product.weight.detach(), w_scale))
        gm.register_buffer(f"{stem}_weight_scale", torch.tensor(w_scale, dtype=torch.float32, device=device))
        with gm.graph.inserting_before(node):
            attrs = [gm.graph.get_attr(f"{stem}_weight"), gm.graph.get_attr(f"{stem}_weight_scale")]
            if product.input_scale is not None:
                gm.register_buffer(f"{stem}_input_scale", torch.tensor(product.input_scale, dtype=torch.float32,
                                                                 device=device))
                attrs.append(gm.graph.get_attr(f"{stem}_input_scale"))
            else:
                attrs.append(None)
        for attr in attrs:
            if attr is not None:
                attr.meta["val"] = fetch_attr(gm, str(attr.target))
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
    """What an fp8 row of the report shows: the format and both scales (or how the input's is computed)."""
    return {"format": E4M3.name, "weight_scale": product.weight_scale,
            "input_scale": "dynamic" if product.input_scale is None else product.input_scale,
            "input_amax": product.input_amax, "output": "bf16", "kernel": "torch._scaled_mm"}


def mark(gm: fx.GraphModule, node_name: str, fp8: Mapping[str, object], reason: str) -> None:
    """Record a product's fp8 outcome on its node: ``fp8`` in its evidence, ``reason`` put before its bf16 reason."""
    for node in gm.graph.nodes:
        meta = node.meta.get(META_KEY)
        if node.name == node_name and meta and not meta.get("cast"):
            meta["evidence"] = {**meta.get("evidence", {}), "fp8": dict(fp8)}
            meta["reason"] = f"{reason} ({meta['reason']})" if meta.get("reason") else reason
            return
