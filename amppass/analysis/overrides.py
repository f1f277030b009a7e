"""User overrides: keep ops or nodes in fp32, or force them to low precision.

A pattern matches a node when it names the node's op ("softmax", "aten.softmax", "Softmax" for ONNX,
case-insensitive) or when it matches the whole node name as a regular expression ("encoder\\.layer\\.0\\..*").
Keeping fp32 wins over forcing low when both match. Forcing low an op the target runtime has no
low-precision kernel for (``OpView.low_blocked``) keeps it fp32 with both facts in the reason and a
warning: the converted model must still run.
"""

from __future__ import annotations

import logging
import re
from typing import Iterable

from ..errors import InputError
from .plan import Category, Decision, Precision, Source
from .view import GraphView, OpView

log = logging.getLogger(__name__)


def _compile(patterns: Iterable[str], argument: str) -> list[tuple[str, re.Pattern[str]]]:
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


def _matches(node: OpView, pattern: str, regex: re.Pattern[str]) -> bool:
    op = node.op.lower()
    wanted = pattern.lower()
    return op == wanted or op.split(".", 1)[-1] == wanted.split(".", 1)[-1] or bool(regex.fullmatch(node.name))


def resolve(
    view: GraphView, keep_fp32: Iterable[str] = (), force_low: Iterable[str] = (), low_name: str = "fp16"
) -> dict[str, Decision]:
    """Decisions for the nodes the user's patterns match; a pattern that matches nothing is an error."""
    decisions: dict[str, Decision] = {}
    for argument, patterns, precision in (("keep_fp32", keep_fp32, Precision.FP32),
                                          ("force_low", force_low, Precision.LOW)):
        for pattern, regex in _compile(patterns, argument):
            hits = [n for n in view.nodes if n.category is not Category.KEEP and _matches(n, pattern, regex)]
            if not hits:
                raise InputError(
                    f"{argument}: {pattern!r} matches no node with floating-point work; give an op name "
                    "(e.g. 'softmax') or a regular expression over node names (see amppass.report for names)"
                )
            for node in hits:
                if node.name in decisions:
                    continue
                target = "fp32" if precision is Precision.FP32 else low_name
                if precision is Precision.LOW and node.low_blocked:
                    log.warning("force_low=%r: node %r kept fp32: %s", pattern, node.name, node.low_blocked)
                    decisions[node.name] = Decision(
                        Precision.FP32, f"user asked for {target} ({argument}={pattern!r}), but {node.low_blocked}",
                        Source.OVERRIDE, {"pattern": pattern, "no_low_kernel": True},
                    )
                    continue
                decisions[node.name] = Decision(
                    precision, f"user asked for {target} ({argument}={pattern!r})", Source.OVERRIDE,
                    {"pattern": pattern},
                )
    return decisions
