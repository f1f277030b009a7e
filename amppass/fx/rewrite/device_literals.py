"""A captured graph's device literals, moved with its tensors.

torch.export writes the device a tensor is created on into the graph (``aten.arange(n, device=cpu)``,
``aten.full(..., device=cpu)``, ``aten._to_copy(x, device=cpu)``): the device the model's code asked for while
it was captured, usually its inputs' (``torch.ones(..., device=input_ids.device)``). Moving a converted module
with ``.to("cuda")`` moves its parameters and buffers but not those literals, and its first call would mix
devices (``Expected all tensors to be on the same device``). torch.export's own answer for a program is
``move_to_device_pass``; this is its counterpart for the graphs a converted module runs: every device literal
equal to a device the move took tensors from becomes the device it took them to.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import fx


def module_device(module: torch.nn.Module | None) -> torch.device | None:
    """The device of a module's first parameter or buffer (None for no module, or one with neither)."""
    if module is None:
        return None
    tensor = next(module.parameters(), None)
    if tensor is None:
        tensor = next(module.buffers(), None)
    return None if tensor is None else tensor.device


def retarget(gm: fx.GraphModule, moves: Mapping[torch.device, torch.device]) -> int:
    """Rewrite ``gm``'s device literals by ``moves`` (device before -> device after) and regenerate its code
    when any changed; the number of nodes changed."""
    changed = retarget_graph(gm.graph, moves)
    if changed:
        gm.recompile()
    return changed


def retarget_graph(graph: fx.Graph, moves: Mapping[torch.device, torch.device]) -> int:
    """Rewrite the device literals of ``graph``'s nodes by ``moves``; the number of nodes changed (the code of a
    module over the graph is then stale: :func:`retarget` regenerates it)."""
    moves = {_normal(a): b for a, b in moves.items() if _normal(a) != _normal(b)}
    if not moves:
        return 0
    changed = 0

    def moved(value: Any) -> Any:
        if isinstance(value, torch.device):
            return moves.get(_normal(value), value)
        if isinstance(value, str) and _device_string(value):
            found = moves.get(_normal(torch.device(value)))
            return str(found) if found is not None else value
        return value

    for node in graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        kwargs = dict(node.kwargs)
        if "device" in kwargs:
            kwargs["device"] = moved(kwargs["device"])
        args = tuple(moved(a) if isinstance(a, torch.device) else a for a in node.args)
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs = args, kwargs
            changed += 1
    return changed


def _device_string(value: str) -> bool:
    try:
        torch.device(value)
    except (RuntimeError, TypeError):
        return False
    return True


def _normal(device: torch.device) -> tuple[str, int | None]:
    """A device as a comparable key: ``cuda`` is ``cuda:<current device>``."""
    if device.type in ("cpu", "meta"):
        return device.type, None
    index = device.index
    if index is None and device.type == "cuda" and torch.cuda.is_available():
        index = torch.cuda.current_device()
    return device.type, index if index is not None else 0

