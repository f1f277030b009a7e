"""User overrides: keep ops or nodes in fp32, or force them to low precision.

A pattern matches a node when it names the node's op ("softmax", "aten.softmax", "Softmax" for ONNX,
case-insensitive) or when it matches the whole node name as a regular expression ("encoder\\.layer\\.0\\..*").
Keeping fp32 wins over forcing low when both match. Forcing low an op the target runtime has no
low-precision kernel for (``OpView.low_blocked``) keeps it fp32 with both facts in the reason and a
warning: the converted model must still run. Forcing low an op the policy keeps fp32 runs it low, and its
reason carries the policy's, so the report says what the user risks.

A pattern that matches no node is told apart by what it names. If it is an op name PyTorch or ONNX knows
(an ATen op or an ONNX operator, case-insensitive, with or without a namespace such as ``aten.``), the
model simply has no such op: a shared recipe like ``keep_fp32=["softmax"]`` meets models that compute
attention in one fused op. That is a warning listing the ops the model has, and the conversion goes on.
Any other pattern was meant for node names, and one that matches none is an :class:`InputError`: a
mistyped node name must not silently leave the node in low precision.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Iterable

import onnx
import torch

from ..dtypes import FP16, LowType
from ..errors import InputError
from .plan import Category, Decision, Precision, Source
from .view import GraphView, OpView

log = logging.getLogger(__name__)


def compile_patterns(patterns: Iterable[str], argument: str) -> list[tuple[str, re.Pattern[str]]]:
    """Each of ``patterns`` (one string is one pattern) with its compiled regular expression; InputError naming
    ``argument`` for anything that is not a string or not a valid expression."""
    if isinstance(patterns, str):
        patterns = [patterns]
    try:
        patterns = list(patterns)
    except TypeError as err:
        raise InputError(f"{argument}={patterns!r} is not a list of patterns; give op names or node-name "
                         f"regular expressions as strings, e.g. {argument}=['Softmax']") from err
    compiled = []
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise InputError(f"{argument}: {pattern!r} is a {type(pattern).__name__}, not a string; give op names "
                             f"or node-name regular expressions as strings, e.g. {argument}=['Softmax']")
        try:
            compiled.append((pattern, re.compile(pattern)))
        except re.error as err:
            raise InputError(f"{argument}: {pattern!r} is not a valid regular expression ({err}); "
                             "escape dots and brackets in node names, e.g. 'layer\\\\.0'") from err
    return compiled


def same_op(op: str, wanted: str) -> bool:
    """Whether ``wanted`` names ``op``: case-insensitive, with or without a namespace ("aten.softmax",
    "softmax"; "Add" and "add")."""
    op, wanted = op.lower(), wanted.lower()
    return op == wanted or op.split(".", 1)[-1] == wanted.split(".", 1)[-1]


def _matches(node: OpView, pattern: str, regex: re.Pattern[str]) -> bool:
    return same_op(node.op, pattern) or bool(regex.fullmatch(node.name))


def names_an_op(pattern: str) -> bool:
    """Whether ``pattern`` is the name of an ATen op or an ONNX operator (module docstring)."""
    found = re.fullmatch(r"(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*)", pattern)
    if found is None:
        return False
    name = found.group(1).lower()
    return name in _onnx_operators() or isinstance(getattr(torch.ops.aten, name, None), torch._ops.OpOverloadPacket)


@functools.cache
def _onnx_operators() -> frozenset[str]:
    return frozenset(schema.name.lower() for schema in onnx.defs.get_all_schemas_with_history())


def _no_match(argument: str, pattern: str, view: GraphView, target: str) -> None:
    """Warn about an op name the model does not have; raise for any other pattern (module docstring)."""
    ops = sorted({n.op for n in view.nodes if n.category is not Category.KEEP})
    shown = ", ".join(ops[:40]) + (f" and {len(ops) - 40} more" if len(ops) > 40 else "")
    if names_an_op(pattern):
        log.warning("%s=[%r]: this model has no %s op with floating-point work, so nothing is %s for it; "
                    "its ops: %s", argument, pattern, pattern, target, shown or "(none)")
        return
    example = next((n.name for n in view.nodes if n.category is not Category.KEEP), "")
    raise InputError(
        f"{argument}: {pattern!r} matches no node name and is not an op name; give one of the model's ops "
        f"({shown or 'none with floating-point work'}) or a regular expression over whole node names"
        + (f" such as {example!r}" if example else "") + " (amppass.report lists every node)"
    )


def resolve(
    view: GraphView, keep_fp32: Iterable[str] = (), force_low: Iterable[str] = (), low: LowType = FP16
) -> dict[str, Decision]:
    """Decisions for the nodes the user's patterns match; a pattern that matches nothing warns or raises
    (module docstring)."""
    decisions: dict[str, Decision] = {}
    for argument, patterns, precision in (("keep_fp32", keep_fp32, Precision.FP32),
                                          ("force_low", force_low, Precision.LOW)):
        target = "fp32" if precision is Precision.FP32 else low
        done = "kept in fp32" if precision is Precision.FP32 else f"forced to {target}"
        for pattern, regex in compile_patterns(patterns, argument):
            hits = [n for n in view.nodes if n.category is not Category.KEEP and _matches(n, pattern, regex)]
            if not hits:
                _no_match(argument, pattern, view, done)
            for node in hits:
                if node.name in decisions:
                    continue
                if precision is Precision.LOW and node.low_blocked:
                    log.warning("force_low=%r: node %r kept fp32: %s", pattern, node.name, node.low_blocked)
                    decisions[node.name] = Decision(
                        Precision.FP32, f"user asked for {target} ({argument}={pattern!r}), but {node.low_blocked}",
                        Source.OVERRIDE, {"pattern": pattern, "no_low_kernel": True}, rule="force-low-no-kernel",
                    )
                    continue
                decisions[node.name] = _forced(node, precision, target, argument, pattern)
    return decisions


def _forced(node: OpView, precision: Precision, target: str, argument: str, pattern: str) -> Decision:
    """The user's decision for ``node``; forcing low an op the policy keeps fp32 says what the policy knows,
    so the report shows the risk beside the choice."""
    reason, evidence = f"user asked for {target} ({argument}={pattern!r})", {"pattern": pattern}
    if precision is Precision.LOW and node.category in (Category.FP32, Category.FP32_ACCUM):
        reason += f" over the policy's fp32, so expect a larger error here: {node.reason}"
        evidence["policy_fp32"] = node.reason
    return Decision(precision, reason, Source.OVERRIDE, evidence, rule=argument.replace("_", "-"))
