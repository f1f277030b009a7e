"""A call's inputs: a batch or the conversion's example as one call's ``(args, kwargs)``, and those inputs as a captured
graph's placeholders take them, for every runner of the graph (calibration, the
finite check, the fidelity check, train mode's saved-bytes count).

A graph torch.export captured flattens ``(args, kwargs)`` by the pytree spec it recorded; keywords in another order,
or a positional input passed by name, are laid out again through the graph's guards. A symbolically traced graph
binds them to its ``forward`` signature. A call of another structure is a :class:`~amppass.errors.CalibrationError`
naming the batch and how to lay batches out.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import fx
from torch.utils import _pytree as pytree

from ...errors import CalibrationError
from .guards import GUARDS_KEY

BATCH_FIX = (
    "pass batches the model takes, laid out like its calls: a tuple of positional inputs, or a dict of keyword "
    'inputs, e.g. calibration=[(x,) for x in batches] or calibration=[tokenizer(text, return_tensors="pt") '
    "...]"
)


def flatten_inputs(gm: fx.GraphModule, args: tuple, kwargs: dict, index: int) -> list:
    """The graph's placeholder values for one batch of ``args``/``kwargs``; CalibrationError naming batch ``index``
    when its structure is not the captured one."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    codegen = gm.graph._codegen
    spec = getattr(getattr(codegen, "pytree_info", None), "in_spec", None)
    if spec is not None:
        flat, got = pytree.tree_flatten((args, kwargs))
        guards = gm.meta.get(GUARDS_KEY)
        if got != spec and guards is not None:  # keywords in another order, a positional input by name
            flat = guards.flatten(args, kwargs)
            got = spec if flat is not None else got
        if got != spec:
            raise CalibrationError(
                f"calibration batch {index}: it holds {len(args)} positional and {sorted(kwargs)} keyword inputs "
                f"({got.num_leaves} values), but the model was captured with {spec.num_leaves} input values in "
                f"another structure; {BATCH_FIX}"
            )
        return flat
    try:
        bound = inspect.signature(gm.forward).bind(*args, **kwargs)
    except TypeError as err:
        raise CalibrationError(f"calibration batch {index}: {err} (the model takes "
                               f"{[p.name for p in placeholders]}); {BATCH_FIX}") from err
    return [bound.arguments[str(p.target)] for p in placeholders if str(p.target) in bound.arguments]


def split_batch(batch: Any) -> tuple[tuple, dict]:
    """One calibration batch (a dict of keyword inputs, a tuple or list of positional ones, or one input) as
    ``(args, kwargs)``."""
    if isinstance(batch, dict):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def example_call(example: tuple[Any, dict]) -> tuple[tuple, dict]:
    """The conversion's example as ``(args, kwargs)`` of one call."""
    args, kwargs = example
    return (split_batch(args)[0] if args is not None else ()), dict(kwargs or {})
