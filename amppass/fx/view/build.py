"""Build the neutral :class:`GraphView` of an FX graph: categories from the ATen policy, float edges from meta.

With torch.export, every node carries ``meta["val"]`` and the dtypes are known. A symbolically traced
graph has no dtypes: its values are taken to be floating unless the op says otherwise, and the rewrite
casts them with a run-time check (:func:`amppass.fx.rewrite.graph_calls.cast_floating`).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from ...analysis.plan import Category
from ...analysis.policy import for_target
from ...analysis.view import AliasGroup, GraphView, OpView
from ...targets.target import Target
from ..prepare.aliasing import alias_groups
from . import low_kernels, ops, policy

# whole exponents that a wide-range low dtype (bf16) computes as safely as a product: x**2, x**3 (GELU's tanh form)
SMALL_POWERS = frozenset({2, 3})
_METADATA_METHODS = frozenset({"size", "dim", "numel", "stride", "is_contiguous", "__len__", "len", "device",
                               "shape", "getattr", "sym_size", "sym_numel", "sym_stride"})


def is_fp32(value: Any) -> bool:
    """True for an fp32 tensor, or a tuple/list holding one (a node's ``meta["val"]``)."""
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.float32
    if isinstance(value, (tuple, list)):
        return any(is_fp32(v) for v in value)
    return False


def has_dtypes(gm: fx.GraphModule) -> bool:
    """Whether the graph's nodes carry ``meta["val"]`` (torch.export) rather than nothing (symbolic_trace)."""
    return any("val" in n.meta for n in gm.graph.nodes if n.op == "placeholder") or all(
        n.op != "placeholder" for n in gm.graph.nodes
    )


def carries_fp32(node: fx.Node, gm: fx.GraphModule, typed: bool) -> bool:
    """Whether ``node`` produces an fp32 value the plan may convert."""
    if node.op == "get_attr":
        attr = fetch_attr(gm, str(node.target))
        return isinstance(attr, torch.Tensor) and attr.dtype == torch.float32
    if typed:
        return is_fp32(node.meta.get("val"))
    if node.op == "placeholder":
        return True
    return (
        node.op in ("call_function", "call_method", "call_module")
        and _category(node, gm, typed)[0] is not Category.KEEP
    )


def cast_target(node: fx.Node) -> torch.dtype | None:
    """The dtype an explicit cast node in the model converts to, or None if it is not a cast."""
    name = ops.op_name(node)
    if name not in ops.CAST_OPS:
        return None
    if node.op == "call_method" and node.target in ("float", "half", "bfloat16", "double"):
        return {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16,
                "double": torch.float64}[node.target]
    for arg in list(node.args[1:]) + list(node.kwargs.values()):
        if isinstance(arg, torch.dtype):
            return arg
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def build_view(gm: fx.GraphModule, target: Target,
               avoid_slow_backward: bool = False) -> tuple[GraphView, dict[str, fx.Node]]:
    """The neutral view of ``gm`` for ``target`` (its low dtype and the ops it has no fast low-precision
    kernel for; with ``avoid_slow_backward``, a train-mode plan for speed, also those whose low backward is slow)
    and a map from view names back to FX nodes.

    Each fp32 weight's absmax is measured where the low dtype's range needs the check (fp16).
    """
    low = target.low
    measure_weights = not low.wide_range
    typed = has_dtypes(gm)
    fp32 = {n: carries_fp32(n, gm, typed) for n in gm.graph.nodes}
    view = GraphView(nodes=[])
    nodes: dict[str, fx.Node] = {}
    held: dict[str, torch.Tensor] = {}
    view.weight_values = held.__getitem__
    for node in gm.graph.nodes:
        nodes[node.name] = node
        if node.op == "get_attr" and fp32[node]:
            tensor = fetch_attr(gm, str(node.target))
            view.weights[node.name] = _absmax(tensor) if measure_weights else 0.0
            held[node.name] = tensor
        elif node.op == "output":
            view.outputs = [a.name for a in node.all_input_nodes if fp32[a]]
        elif node.op in ("call_function", "call_method", "call_module"):
            category, reason, unknown = _category(node, gm, typed, wide_range=low.wide_range)
            reason = for_target(reason, target.name, low.name)
            name = ops.op_name(node, gm)
            if category is Category.LOW and name in target.slow_low:
                category, reason = Category.FP32, (
                    f"{name}: torch on {target.name} runs it in {low} only through an unfused "
                    "reference path, slower and less accurate than fp32 (only LSTM has a fused low-precision "
                    "kernel there); kept fp32")
            elif category is Category.LOW and avoid_slow_backward and name in target.slow_backward:
                category, reason = Category.FP32, (
                    f"{name}: torch on {target.name} computes its {low} backward with a reference "
                    "loop, tens of times slower than fp32 (bf16 has a fast kernel there); kept fp32 in training")
            kept, kept_state = policy.kept_arguments(node, gm)  # fed as they are: not the plan's to convert
            inputs = [a.name for a in node.all_input_nodes if fp32[a] and a not in kept]
            for state_name, tensor in module_state(gm, node):
                if state_name.rsplit(".", 1)[-1] in kept_state:
                    continue
                view.weights[state_name] = _absmax(tensor) if measure_weights else 0.0
                held[state_name] = tensor
                inputs.append(state_name)
            blocked = ""
            if category is not Category.KEEP and not inputs:
                category, unknown, reason = Category.KEEP, False, (
                    "creates fp32 values at run time; kept as they are" if fp32[node] else "no fp32 tensors in or out"
                )
            elif category is not Category.KEEP:
                category, reason, blocked = _kernel_facts(node, gm, target, category, reason, unknown)
            view.nodes.append(OpView(
                name=node.name,
                op=ops.display_name(node, gm),
                category=category,
                reason=reason,
                inputs=inputs,
                outputs=[node.name] if fp32[node] else [],
                unknown=unknown,
                low_blocked=blocked,
                scalars=[float(a) for a in _flat_args(node) if type(a) is float],
                facts=_facts(node, gm) if category is not Category.KEEP else frozenset(),
            ))
    view.alias_groups = _alias_groups(gm, fp32)
    return view, nodes


def _alias_groups(gm: fx.GraphModule, fp32: dict[fx.Node, bool]) -> list[AliasGroup]:
    """The view's aliasing groups that hold fp32 values (:mod:`amppass.fx.prepare.aliasing`)."""
    found = alias_groups(gm)
    result = []
    for members in found.members:
        if not any(fp32[n] for n in members):
            continue
        stored = next((n.name for n in members if n.op in ("placeholder", "get_attr") and fp32[n]), "")
        calls = [n for n in members if n.op not in ("placeholder", "get_attr")]
        result.append(AliasGroup([n.name for n in calls], [n.name for n in calls if n in found.writes], stored))
    return result


def _kernel_facts(node: fx.Node, gm: fx.GraphModule, target: Target, category: Category, reason: str,
                  unknown: bool) -> tuple[Category, str, str]:
    """(category, reason, why the node cannot run low) once the target's kernels are known
    (:mod:`amppass.fx.view.low_kernels`): an op that would run low without a low kernel there runs fp32, and so
    does an op the policy table does not list but torch.autocast keeps fp32 on that device."""
    blocked = low_kernels.low_blocked(node, gm, target)
    if blocked and category in (Category.LOW, Category.FOLLOW):
        return Category.FP32, blocked, blocked
    autocast = low_kernels.autocast_reason(ops.op_name(node, gm), target) if unknown else ""
    if autocast:
        return Category.FP32, autocast, blocked
    return category, reason, blocked


def _category(node: fx.Node, gm: fx.GraphModule, typed: bool, wide_range: bool = False) -> tuple[Category, str, bool]:
    """(category, reason, unknown) for a call node from the policy table and the node's own form.

    ``wide_range`` is True when the low dtype has fp32's exponent range (bf16).
    """
    name = ops.op_name(node, gm)
    if name in _METADATA_METHODS or name == "getattr":
        return Category.KEEP, "reads tensor metadata only", False
    if typed and not node.users and not is_fp32(node.meta.get("val")):
        return Category.KEEP, "no fp32 tensors in or out", False
    if isinstance(node.target, torch._ops.HigherOrderOperator):
        return Category.FP32, (
            f"{name} region (e.g. torch.autocast(enabled=False), torch.cond): its body runs as the model "
            "wrote it, in fp32"
        ), False
    target = cast_target(node)
    if name in ops.CAST_OPS and target is not None:
        if target == torch.float32:
            return (
                Category.FP32,
                (
                    "explicit cast to fp32 in the model: what reads it runs in fp32, as under "
                    "torch.autocast (a router's scores after .float(), statistics after x.float())"
                ),
                False,
            )
        return Category.KEEP, f"explicit cast to {target} in the model; kept", False
    training = policy.in_training(node, gm)
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        row = policy.lookup(name, training)
        if row is None:
            if any(p.is_floating_point() for p in module.parameters()):
                return Category.FP32, (
                    f"module {type(module).__name__} is not in the policy table and has fp32 parameters; "
                    "kept fp32 (override it to force low precision)"
                ), True
            return Category.FOLLOW, policy.UNKNOWN_REASON, True
        return row.category, row.reason, False
    row = policy.lookup(name, training)
    if row is None:
        return Category.FOLLOW, policy.UNKNOWN_REASON, True
    if name == "einsum" and node.args and isinstance(node.args[0], str):
        form = policy.einsum_form(node.args[0])
        if form == "sum":
            return Category.FP32, policy.EINSUM_SUM_REASON, False
        if form == "elementwise":
            return Category.FOLLOW, policy.EINSUM_FOLLOW_REASON, False
    if name == "linalg_matrix_power" and len(node.args) > 1 and type(node.args[1]) is int and node.args[1] < 0:
        return Category.FP32, policy.INVERSE_POWER_REASON, False
    exponent = node.args[1] if name == "pow" and len(node.args) > 1 else None
    if wide_range and type(exponent) in (int, float) and exponent in SMALL_POWERS:
        return Category.FOLLOW, (
            f"x ** {exponent:g} in a low dtype with fp32's range (bf16) overflows no sooner than a product "
            "does: follows its inputs"), False
    if row.category is Category.LOW and _asks_fp32(node):
        return Category.FP32, EXPLICIT_FP32_REASON, False
    return row.category, row.reason, False


EXPLICIT_FP32_REASON = (
    "the model casts every operand of this product to fp32 itself (a mixture-of-experts router, as DeepSeek-V3 "
    "writes it): it asks for fp32 whatever its weights' dtype, and the experts its scores pick flip on near-ties "
    "when they are rounded; kept fp32")


def _asks_fp32(node: fx.Node) -> bool:
    """Whether every floating tensor operand of ``node`` is the model's own cast to fp32 (``x.float()``)."""
    operands = [a for a in node.all_input_nodes if not isinstance(a.meta.get("val"), torch.Tensor)
                or a.meta["val"].is_floating_point()]
    return len(operands) >= 2 and all(cast_target(a) == torch.float32 for a in operands)


def _facts(node: fx.Node, gm: fx.GraphModule) -> frozenset[str]:
    """What the node's op computes, from its policy row (division, reduction, ...)."""
    row = policy.lookup(ops.op_name(node, gm), policy.in_training(node, gm))
    return row.facts if row is not None else frozenset()


def module_state(gm: fx.GraphModule, node: fx.Node) -> list[tuple[str, torch.Tensor]]:
    """The fp32 parameters and buffers a ``call_module`` node reads, by qualified name; [] for other nodes."""
    if node.op != "call_module":
        return []
    module = gm.get_submodule(str(node.target))
    state = list(module.named_parameters()) + list(module.named_buffers())
    return [(f"{node.target}.{name}", t) for name, t in state if t.dtype == torch.float32]


def _absmax(tensor: torch.Tensor) -> float:
    return float(tensor.detach().abs().max()) if tensor.numel() else 0.0


def _flat_args(node: fx.Node) -> list[Any]:
    flat, _ = torch.utils._pytree.tree_flatten((node.args, node.kwargs))
    return flat


def fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    """The object at dotted ``target`` under ``gm`` (a get_attr node's value)."""
    return operator.attrgetter(target)(gm)
