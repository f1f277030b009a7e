"""GELU's tanh approximation written out as element-wise ops becomes one ``aten.gelu(approximate="tanh")``.

GPT-2 (and models copied from it: ``gelu_new``) computes ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 *
x**3)))`` op by op. Planned op by op, ``pow`` must run fp32 (``x**3`` leaves fp16's range at ``|x| > 40``), so
the whole chain runs fp32 and training saves four fp32 copies of the widest activation of the MLP for the
backward pass. ``aten.gelu`` with ``approximate="tanh"`` computes exactly this formula (PyTorch's kernel uses
the same constants) in fp32 inside the kernel for fp16/bf16 inputs, and saves only its input: the chain becomes
one low-precision op that cannot overflow and saves one low-precision tensor.

Rules:

1. A match starts at a ``tanh`` whose argument is ``c2 * (x + c1 * x**3)`` and whose only reader is
   ``1 + tanh(...)``, read only by ``(x * 0.5) * (1 + tanh(...))`` or ``(x * (1 + tanh(...))) * 0.5``; the
   constants are sqrt(2/pi) and 0.044715 to 1e-6 relative, the operands of ``+`` and ``*`` in either order,
   the cube as ``pow(x, 3)`` or ``x * x * x``.
2. Every intermediate value of the chain is read only inside it (else the chain is left as it is).
3. The last node of the chain is replaced by the ``gelu``, which takes over its metadata; the rest of the
   chain is dead and removed. The ``gelu`` node records what it replaced (``meta["amppass_fused"]``).
"""

from __future__ import annotations

import logging
import math
import operator
from typing import Any

import torch
from torch import fx

log = logging.getLogger(__name__)

aten = torch.ops.aten
FUSED_KEY = "amppass_fused"
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_KAPPA = 0.044715
_MUL = (aten.mul.Tensor, aten.mul.Scalar, operator.mul, torch.mul)
_ADD = (aten.add.Tensor, aten.add.Scalar, operator.add, torch.add)
_POW = (aten.pow.Tensor_Scalar, operator.pow, torch.pow)
_TANH = (aten.tanh.default, torch.tanh)


def fuse_tanh_gelu(gm: fx.GraphModule) -> int:
    """Replace every written-out tanh-GELU of ``gm`` by ``aten.gelu(x, approximate="tanh")``; return how many."""
    fused = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _TANH:
            continue
        match = _match(node)
        if match is None:
            continue
        x, last, chain = match
        with gm.graph.inserting_before(last):
            gelu = gm.graph.call_function(aten.gelu.default, (x,), {"approximate": "tanh"})
        gelu.meta = dict(last.meta)
        gelu.meta[FUSED_KEY] = (f"GELU's tanh approximation written out as {len(chain)} ops "
                                f"({', '.join(n.name for n in chain)}) runs as one aten.gelu(approximate='tanh'): "
                                "the same formula, computed in fp32 inside the kernel, saving only its input for "
                                "backward")
        last.replace_all_uses_with(gelu)
        for dead in reversed(chain):
            gm.graph.erase_node(dead)
        fused += 1
    if fused:
        gm.recompile()
        log.info("fused %d written-out tanh-GELU(s) into aten.gelu(approximate='tanh')", fused)
    return fused


def _match(tanh: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """Rule 1: (x, the chain's last node, the chain in graph order) or None."""
    argument = tanh.args[0]
    inner = _scaled(argument, _SQRT_2_OVER_PI)
    if not _is(inner, _ADD):
        return None
    for x, term in _pairs(inner):
        cube = _scaled(term, _KAPPA)
        if isinstance(x, fx.Node) and cube is not None and _is_cube(cube, x):
            break
    else:
        return None
    plus_one = _only_user(tanh)
    if not _is(plus_one, _ADD) or _other(plus_one, tanh) != 1:
        return None
    user = _only_user(plus_one)
    if not _is(user, _MUL):
        return None
    other = _other(user, plus_one)
    if _scaled(other, 0.5) is x:  # (x * 0.5) * (1 + tanh(...))
        half, last = other, user
    elif other is x and _scaled(_only_user(user), 0.5) is user:  # (x * (1 + tanh(...))) * 0.5
        half, last = user, _only_user(user)
    else:
        return None
    square = [a for a in cube.args[:2] if a is not x] if _is(cube, _MUL) else []
    chain = [argument, inner, term, cube, *square, tanh, plus_one, half, last]
    if any(set(n.users) - set(chain) for n in chain if n is not last):
        return None  # rule 2
    order = {n: i for i, n in enumerate(tanh.graph.nodes)}
    return x, last, sorted(set(chain), key=order.__getitem__)


def _is(node: Any, targets: tuple) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets and not node.kwargs


def _pairs(node: fx.Node) -> list[tuple[Any, Any]]:
    a, b = node.args[:2]
    return [(a, b), (b, a)]


def _other(node: fx.Node, one: fx.Node) -> Any:
    a, b = node.args[:2]
    return b if a is one else a


def _scaled(node: Any, constant: float) -> fx.Node | None:
    """``y`` if ``node`` is ``y * constant`` (either order, constant to 1e-6 relative), else None."""
    if not _is(node, _MUL) or len(node.args) != 2:
        return None
    for value, factor in _pairs(node):
        if (
            isinstance(value, fx.Node)
            and isinstance(factor, (int, float))
            and math.isclose(factor, constant, rel_tol=1e-6)
        ):
            return value
    return None


def _is_cube(node: fx.Node, x: fx.Node) -> bool:
    """``pow(x, 3)`` or ``x * x * x`` in any grouping."""
    if _is(node, _POW):
        return node.args[0] is x and node.args[1] in (3, 3.0)
    if not _is(node, _MUL):
        return False
    a, b = node.args[:2]
    square = b if a is x else a if b is x else None
    return _is(square, _MUL) and list(square.args[:2]) == [x, x]


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None
