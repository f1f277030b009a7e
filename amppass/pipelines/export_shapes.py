"""Which input dimensions of :func:`amppass.export_onnx`'s file stay dynamic: the ones asked for (batch, sequence,
image sizes), checked by running the float32 export at other sizes in onnxruntime, and fixed one by one where the
file does not run grown."""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Collection, Mapping

import numpy as np
import onnx
import torch
from torch.export import Dim
from torch.utils import _pytree as pytree

from ..errors import first_line

log = logging.getLogger(__name__)

Dims = set[tuple[str, int]]  # (input name, dimension index) pairs


def input_names(model: torch.nn.Module, args: tuple) -> list[str]:
    """forward()'s names for the positional example inputs (``input_<i>`` past them or for ``*args``)."""
    try:
        parameters = [p for p in inspect.signature(model.forward).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        parameters = []
    return [parameters[i].name if i < len(parameters) else f"input_{i}" for i in range(len(args))]


TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")  # transformers' names


def batch_and_sequence(names: list[str], args: tuple) -> dict[str, Any] | None:
    """Dim.AUTO on dim 0 of every tensor input, on dim 1 of sequences (integer inputs of rank 2: token ids,
    masks; inputs of rank 3: a rank-2 float input's dim 1 is its features), and on every dimension but the
    channels (dim 1) of inputs of rank 4 and more: channels-first images and volumes, whose spatial sizes a
    convolutional model takes at any size. The dynamo exporter keeps a Dim.AUTO dimension symbolic in the ONNX
    model even where the model fixes it (channels read by a convolution): naming channels would promise a
    size the model cannot take.

    Dimensions that are one size for the model's caller share a named Dim (:func:`_shared`): Dim.AUTO gives each
    its own symbol unless the model's code ties them, and a mask only broadcast against the ids does not."""
    shapes: dict[str, Any] = {}
    for name, value in zip(names, args, strict=False):
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            shapes[name] = None
            continue
        if value.dim() >= 4:
            dynamic = [0, *range(2, value.dim())]
        else:
            dynamic = [0, 1] if value.dim() == 3 or (value.dim() == 2 and not value.is_floating_point()) else [0]
        shapes[name] = {dim: Dim.AUTO for dim in dynamic}
    if not any(shapes.values()):
        return None
    return _shared(shapes, dict(zip(names, args, strict=False)))


def _shared(shapes: dict[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """``shapes`` with one named Dim for each group of two or more dimensions that are the same size in the example
    and mean the same: ``batch`` for dim 0 of the inputs whose dim 0 is the first tensor input's; ``sequence`` for
    dim 1 of the token inputs (:data:`TOKEN_INPUTS`) of the same length. A lone dimension keeps Dim.AUTO."""
    dynamic = {name: spec for name, spec in shapes.items() if spec}
    if not dynamic:
        return shapes
    batch = values[next(iter(dynamic))].shape[0]
    groups = {
        "batch": [(name, 0) for name, spec in dynamic.items() if 0 in spec and values[name].shape[0] == batch],
        "sequence": [(name, 1) for name, spec in dynamic.items() if name in TOKEN_INPUTS and 1 in spec],
    }
    if groups["sequence"]:
        length = values[groups["sequence"][0][0]].shape[1]
        groups["sequence"] = [(name, 1) for name, _ in groups["sequence"] if values[name].shape[1] == length]
    shared = {name: dict(spec) if spec else spec for name, spec in shapes.items()}
    for symbol, members in groups.items():
        if len(members) > 1:
            dim = Dim(symbol)
            for name, index in members:
                shared[name][index] = dim
    return shared


def unshared(shapes: Any) -> Any:
    """``shapes`` with every named Dim back to Dim.AUTO: for a model whose export refuses to tie them."""
    if not isinstance(shapes, dict):
        return shapes
    return {name: {d: Dim.AUTO for d in spec} if isinstance(spec, dict) else spec for name, spec in shapes.items()}


def _dynamic(shapes: Any) -> dict[str, list[int]]:
    """The dimensions ``shapes`` makes dynamic, by input name."""
    if not isinstance(shapes, dict):
        return {}
    return {name: sorted(spec) for name, spec in shapes.items() if isinstance(spec, dict) and spec}


def _keeping(shapes: Any, keep: Callable[[str, int], bool]) -> Any:
    """``shapes`` with the dynamic dimensions ``keep(input name, dim)`` refuses fixed (None where none is left)."""
    if not isinstance(shapes, dict):
        return shapes
    kept = {name: {d: v for d, v in spec.items() if keep(name, d)} if isinstance(spec, dict) else spec
            for name, spec in shapes.items()}
    return kept if any(kept.values()) else None


def without(shapes: Any, fixed: Collection[tuple[str, int]]) -> Any:
    """``shapes`` with the dimensions in ``fixed`` fixed, every other one as it was (None where none is left)."""
    return _keeping(shapes, lambda name, dim: (name, dim) not in fixed)


def attempts(shapes: Any) -> list[Any]:
    """Dynamic shapes with fewer kinds of dimension, for a file that does not run at other sizes even with the
    dimensions :func:`cannot_vary` names fixed: every dimension :func:`batch_and_sequence` names; without the
    spatial ones (dims 2 and up); the batch alone; none."""
    found: list[Any] = []
    for attempt in (shapes, _keeping(shapes, lambda name, d: d < 2), _keeping(shapes, lambda name, d: d == 0), None):
        if attempt not in found:
            found.append(attempt)
    return found


def fixed_dims(names: list[str], args: tuple, wanted: Any, model: onnx.ModelProto) -> list[str]:
    """The dimensions asked dynamic in ``wanted`` that the exported ``model`` declares at a fixed size (the
    exporter specialised them, or :func:`cannot_vary` found them): "input_values dim 1 (16000)"."""
    declared = {i.name: list(i.type.tensor_type.shape.dim) for i in model.graph.input}
    values = dict(zip(names, args, strict=False))
    return [f"{name} dim {dim} ({values[name].shape[dim]})" for name, dims in _dynamic(wanted).items() for dim in dims
            if isinstance(values.get(name), torch.Tensor) and dim < len(declared.get(name, ()))
            and not declared[name][dim].dim_param]


def cannot_vary(session: Any, names: list[str], args: tuple, shapes: Any) -> Dims:
    """The dimensions asked dynamic in ``shapes`` that the exported float32 model (an onnxruntime ``session``)
    declares dynamic but does not run at another size on: none where it runs with every one of them grown
    (:func:`_runs`); otherwise the file's dimension symbols are grown one at a time (batch first) beside those
    already found to run, and those that fail are the answer. One symbol is one size for the caller (the batch of
    the ids and of the mask), so its dimensions grow together. The dynamo exporter defers the model's own size
    checks to run time, so a net whose Linear reads a flattened feature map exports with free image sizes it
    cannot take, a reshape the model computes from the example's batch (LeViT, SD3, Flux) exports a dynamic batch
    that only runs at the example's, and a graph net's ``edge_index`` exports a leading dimension that is always 2:
    each is fixed alone, the others stay dynamic.

    onnxruntime's inputs are fed by name (:func:`named_leaves`): the exporters drop None arguments and the
    dynamo exporter bakes Python numbers in, so position in ``args`` is not position in the model's inputs. An
    input the example cannot name leaves nothing to try: every dimension asked is returned."""
    dynamic = _dynamic(shapes)
    asked = {(name, dim) for name, dims in dynamic.items() for dim in dims}
    if not asked:
        return set()
    leaves = named_leaves(names, args)
    unknown = [info.name for info in session.get_inputs() if info.name not in leaves]
    if unknown:
        log.info("the exported model's inputs %s are none of the example's arguments %s, so its dynamic "
                 "dimensions cannot be tried at another size; they are fixed", unknown, list(leaves))
        return asked
    symbols: dict[str, set[tuple[str, int]]] = {}
    for info in session.get_inputs():
        for dim in dynamic.get(info.name, ()):
            if dim < len(info.shape) and isinstance(info.shape[dim], str):
                symbols.setdefault(info.shape[dim], set()).add((info.name, dim))
    groups = sorted(symbols.values(), key=lambda group: min(dim for _, dim in group))
    declared = set().union(*groups)
    if _runs(session, leaves, declared):
        return set()
    kept: Dims = set()
    for group in groups:
        if _runs(session, leaves, kept | group):
            kept |= group
    return declared - kept


def _runs(session: Any, leaves: Mapping[str, torch.Tensor], grown_dims: Dims) -> bool:
    """Whether the ``session`` runs the example with ``grown_dims`` grown by :func:`grown`, all together and by
    kind (:func:`_growths`)."""
    for which in _growths({dim for _, dim in grown_dims}):
        feeds = {}
        for info in session.get_inputs():
            array = leaves[info.name].detach().cpu().numpy()
            sizes = [grown(n) if (info.name, d) in grown_dims and which(d) else n for d, n in enumerate(array.shape)]
            feeds[info.name] = np.resize(array, sizes) if sizes != list(array.shape) else array
        try:
            session.run(None, feeds)
        except Exception as err:  # noqa: BLE001 - onnxruntime's own types: the size is not one the model takes
            log.info("the exported model does not run with %s grown (%s)", sorted(grown_dims), first_line(err))
            return False
    return True


def _growths(dims: Collection[int]) -> list[Callable[[int], bool]]:
    """Which of the dynamic dimension indices ``dims`` each run grows: all of them; then, where the batch and
    others are dynamic, the batch alone and the others alone. A size the export baked in from the example can hide
    behind growing every dimension at once: timm's Swin ran at batch 4 and 192x192 from an example of 2x128x128,
    but not at batch 2 and 192x192."""
    runs: list[Callable[[int], bool]] = [lambda d: True]
    if 0 in dims and len(set(dims)) > 1:
        runs += [lambda d: d == 0, lambda d: d != 0]
    return runs


def grown(size: int) -> int:
    """A size other than ``size`` that a model takes if it takes sizes other than the example's.

    ``size`` plus its largest power-of-two divisor, kept within [1, 64] and at least 32 past 16: the sum keeps
    every power-of-two divisor of ``size`` up to 64, so an encoder-decoder that needs sizes divisible by its total
    stride (32 for five stride-2 stages: ResNet, U-Net, ConvNeXt; 64 for six) runs, and at least 32 more pixels
    change the final feature map of a net with stride up to 32 even where the stages round down, so a Linear
    head reading it fails as it should. A batch or a short sequence (16 or less) grows by its largest
    power-of-two divisor: a batch of 1 becomes 2, of 2 becomes 4. Doubling does all of this too, but costs four
    times the example's pixels (eight for a volume); this costs at most 1.3x an image of 224 or more."""
    step = size & -size if size else 1
    return size + (min(step, 64) if size <= 16 else min(max(step, 32), 64))


def named_leaves(names: list[str], args: tuple) -> dict[str, torch.Tensor]:
    """The example's tensors as the exported model names them: a tensor argument by its forward() name, the
    tensors of a list/tuple argument as ``<name>_<i>`` (the dynamo exporter's names). Neither exporter makes
    None an input; the dynamo exporter bakes Python numbers in as constants (the TorchScript exporter may make
    them inputs, which then match no name here)."""
    named: dict[str, torch.Tensor] = {}
    for name, value in zip(names, args, strict=False):
        if isinstance(value, torch.Tensor):
            named[name] = value
        else:
            tensors = [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]
            named.update((f"{name}_{i}", tensor) for i, tensor in enumerate(tensors))
    return named


def axes(names: list[str], shapes: Any) -> dict[str, dict[int, str]] | None:
    """The TorchScript exporter's dynamic_axes for the same dimensions: a shared Dim's name (``batch``), or
    ``<input>_<dim>``."""
    if not isinstance(shapes, dict):
        return None
    return {name: {dim: getattr(spec[dim], "__name__", None) or f"{name}_{dim}" for dim in spec}
            for name, spec in shapes.items() if name in names and isinstance(spec, dict) and spec}
