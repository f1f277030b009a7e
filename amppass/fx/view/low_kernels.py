"""Kernel facts for the FX plan: whether the target's torch runs a node's op in the low dtype at all.

An op with no low-precision kernel on the target device (torch.fft and the LAPACK-backed linear algebra on
CPU in bf16/fp16, avg_pool3d on CPU) must not be painted low: the converted model would raise on its first
call. :func:`low_blocked` says why a node cannot run low, from three sources, the most specific first:

1. The packaged table's notes (:mod:`amppass.targets.torch_kernel_facts`): facts a test call here cannot
   decide, such as cuFFT taking half precision only for power-of-two sizes.
2. The probe, where this machine has the target's device and the graph carries example values: the node's
   ATen overload called once on small real tensors made from its ``meta["val"]``, first with the float32
   inputs as they are, then with them in the low dtype as the rewrite would pass them. A low call that
   raises where the fp32 call runs is a missing kernel; the reason quotes torch's error.
3. The packaged table: per device and low dtype, the ops PyTorch's op database lists without a low kernel.

Probe inputs have the sizes of the node's example values (up to :data:`REAL_ELEMENTS` elements in all):
sizes a kernel relates implicitly (an RNN's weights and its hidden size) must stay consistent, or a kernel
that trusts them reads out of bounds; cut-down sizes crashed torch's GRU. Float values are 0.5 plus an
identity on square trailing dimensions: inside every elementwise function's domain, symmetric positive
definite and well conditioned for the factorizations. Integer tensors are zeros (a valid index), booleans
False. A low call that runs on an empty tensor proves nothing (kernels may return before dispatching on
dtype), nor does one the fp32 call fails too, nor a call too large: then the probe has no verdict and the
table answers.
Verdicts are cached per process by overload, device, low dtype, the dtypes and ranks of the tensor arguments
and the values of the other non-numeric arguments (a ``reduce="prod"`` can lack a kernel where ``"sum"`` has
one).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ...dtypes import LowType
from ...errors import first_line
from ...targets.target import Target
from ...targets.torch_kernel_facts import torch_facts
from . import ops, policy

log = logging.getLogger(__name__)

REAL_ELEMENTS = 1 << 22  # the most tensor elements (of all its arguments) a probe allocates
_verdicts: dict[tuple, str | None] = {}  # per process: cache key -> reason ("" has a kernel) or None


def low_blocked(node: fx.Node, gm: fx.GraphModule, target: Target) -> str:
    """Why ``target``'s torch cannot run ``node`` in its low dtype ("" when it can, or when nothing says it
    cannot); the sentence ends in "kept fp32"."""
    name = ops.op_name(node, gm)
    facts = torch_facts()
    if facts.noted(target.name, target.low, name):
        return facts.missing(target.name, target.low, name)
    if target.judge == "runtime":  # this machine has the target's device: ask its torch
        found = probe(node, gm, target.low, torch.device(target.name))
        if found is not None:
            return found
    return facts.missing(target.name, target.low, name)


def autocast_reason(name: str, target: Target) -> str:
    """The reason for an op the policy table does not list but torch.autocast keeps fp32 on the target's
    device ("" when autocast does not)."""
    if not torch_facts().autocast_keeps_fp32(target.name, name):
        return ""
    return (f"{name}: not in the policy table, and torch.autocast runs it in fp32 on {target.name} (its fp32 cast "
            "list); kept fp32")


@dataclass(frozen=True)
class _Tensor:
    """A tensor argument of the probed call: its real sizes, dtype, and whether the plan lowers it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    lowered: bool


def probe(node: fx.Node, gm: fx.GraphModule, low: LowType, device: torch.device) -> str | None:
    """The probe's verdict for ``node`` (module docstring): a reason ending in "kept fp32" when the low call
    fails where fp32 runs, "" when it runs, None when the probe cannot tell."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    kept = policy.kept_arguments(node, gm)[0]
    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    values = []
    for leaf in leaves:
        if not isinstance(leaf, fx.Node):
            values.append(leaf)
            continue
        value = _described(leaf.meta.get("val"), lowered=leaf not in kept)
        if value is None:
            return None
        values.append(value)
    if not any(isinstance(v, _Tensor) and v.lowered for v in values):
        return ""  # nothing the plan converts: the op runs as it did
    key = (target, device.type, low.torch, str(spec), tuple(_key(v) for v in values))
    if key not in _verdicts:
        if sum(_numel(v.shape) for v in values if isinstance(v, _Tensor)) > REAL_ELEMENTS:
            return None  # too large to call here; a smaller node of the same form may decide it later
        _verdicts[key] = _ask(target, spec, values, low, device, ops.display_name(node, gm))
        log.debug("kernel probe %s in %s on %s: %r", target, low, device.type, _verdicts[key])
    return _verdicts[key]


def _described(val: Any, lowered: bool) -> Any:
    """A node's example value as the probe rebuilds it: a :class:`_Tensor`, a number, or None (unknown)."""
    if isinstance(val, torch.Tensor):
        shape = tuple(_hint(d) for d in val.shape)
        if val.is_quantized or val.layout != torch.strided or None in shape:
            return None
        return _Tensor(shape, val.dtype, lowered and val.dtype == torch.float32)
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _hint(val)
    if isinstance(val, (int, float, bool)):
        return val
    return None


def _hint(value: Any) -> Any:
    """A concrete number for a possibly symbolic one (its example value); None for a data-dependent one."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value.node.hint
    return value


def _key(value: Any) -> Any:
    if isinstance(value, _Tensor):
        return ("tensor", value.dtype, len(value.shape), value.lowered)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return type(value).__name__  # sizes, dims, scales: kernels are chosen by dtype, not by these
    try:
        hash(value)
    except TypeError:
        return type(value).__name__
    return value


def _ask(target: torch._ops.OpOverload, spec: Any, values: list, low: LowType, device: torch.device,
         name: str) -> str | None:
    fp32 = _arguments(spec, values, None, device)
    try:
        _call(target, fp32)
    except Exception:  # noqa: BLE001 - values this op rejects (its real ones are not known here): no verdict
        return None
    try:
        _call(target, _arguments(spec, values, low.torch, device))
    except Exception as err:  # noqa: BLE001 - any failure of the low call where fp32 runs is the verdict
        first = first_line(err, 200)
        return (f"torch {torch.__version__.split('+')[0]} on {device.type} has no {low} kernel for {name} "
                f"(a test call raised: {first}); kept fp32")
    return None if _empty(fp32) else ""


def _call(target: torch._ops.OpOverload, arguments: tuple) -> None:
    args, kwargs = arguments
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        target(*args, **kwargs)


def _arguments(spec: Any, values: list, low: torch.dtype | None, device: torch.device) -> tuple:
    """(args, kwargs) of a probe call: tensors of the real sizes, lowered ones in ``low`` (if given)."""
    leaves = [_make(v, low, device) if isinstance(v, _Tensor) else v for v in values]
    return pytree.tree_unflatten(leaves, spec)


def _make(value: _Tensor, low: torch.dtype | None, device: torch.device) -> torch.Tensor:
    shape = list(value.shape)
    dtype = low if low is not None and value.lowered else value.dtype
    if value.dtype == torch.bool:
        return torch.zeros(shape, dtype=torch.bool, device=device)
    if not (value.dtype.is_floating_point or value.dtype.is_complex):
        return torch.zeros(shape, dtype=value.dtype, device=device)
    tensor = torch.full(shape, 0.5, dtype=value.dtype, device=device)
    if len(shape) >= 2 and shape[-1] == shape[-2] and shape[-1] > 0:
        tensor = tensor + torch.eye(shape[-1], dtype=value.dtype, device=device)
    return tensor.to(dtype)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count


def _empty(arguments: tuple) -> bool:
    return any(isinstance(t, torch.Tensor) and t.numel() == 0 for t in pytree.tree_leaves(arguments))
