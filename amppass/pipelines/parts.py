"""Converting a model torch.export cannot take whole: its largest submodules that it can, the rest as the
model's own Python.

torch.autocast works on every model that runs eagerly; a graph capture needs the whole model in one graph.
Detectors choose boxes with sizes that depend on the data (proposal selection, NMS), a layer loop that
draws random numbers in training (LayerDrop) cannot be one graph, a custom ``torch.autograd.Function``'s own
backward is lost to a capture. Their submodules (a backbone, a feature pyramid, heads, each encoder layer)
capture. So, as torch.compile's graph breaks do at the bytecode level, the module tree is the unit of
fallback.

Rules:

1. **The whole model first.** Only where its capture fails (a :class:`~amppass.errors.CaptureError`: the
   capture itself, its fidelity check, a Function's own backward in train mode) is it converted by parts.
2. **What each module is called with.** One eager call of a private copy of the model on the example records
   the first call of every submodule (its arguments, cloned) and counts the multiply-adds of the whole call;
   in train mode a second call in eval mode records the modules a random draw skipped (LayerDrop).
3. **Largest first.** Each child that holds weights and was called is converted on its recorded call with the
   conversion's own options (train mode too); where that fails, its own children are tried in turn, and so are
   those of a module never called itself (an ``nn.ModuleList``). A module that holds no weights, or of which
   nothing was called on the example, runs as the model's code. A module reached
   by several paths is converted once. A part whose plan runs nothing in low precision, or that profitability
   keeps in fp32, runs as the original.
4. **The copy is the result.** The returned model is that private copy, an instance of the model's class
   with its methods and attributes, each converted part in its original's place; in inference it shares the
   caller's tensors and never writes them, in train mode it owns copies of them (training never reaches the
   caller's model), tied where the model's are (a parameter two parts share is one parameter). The code between
   parts runs as the model's own Python, in fp32.
5. **fp32 between parts.** Each part's floating outputs are cast back to the dtype the model's code gave it
   (``keep_io_types``), so boxes, scores and indices that the code between parts computes stay fp32 (a box
   coordinate of 1000 px has a 0.5 px step in fp16).
6. **Calibration per part.** Calibration batches are the model's; each part calibrates on what it was called
   with on each batch, and a ``tolerance`` holds for each part's own outputs.
7. **Told.** :class:`~amppass.serving.parts.PartsRecord` names each part and, for each module that runs as
   the model's code, why: ``amppass.report`` shows it, and the share of the model's multiply-adds that runs
   low, counted on one call of the converted model. Whether a part is better left fp32 is read from its own
   record (:meth:`~amppass.serving.artifact.Artifact.fp32_because`). The conversion logs one warning in all:
   what amppass warns while one part converts goes into the record's ``notes`` and is logged at info level,
   by a handler on amppass's own logger that acts only in the context of that part's conversion (no filter on
   any logger; other threads' records pass as they are).
8. **Saved as the original.** The result is an instance of :class:`~amppass.serving.parts.ByParts`'s subclass of
   the model's class, a converted artifact as a kept original is: its class's own ``save_pretrained`` and ``save``
   (the savers every converted model's class shares) write what the original's would, its keys and fp32 weights;
   a train-mode model's parts hold the original's keys already.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import inspect
import logging
import threading
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import AmpPassError, CaptureError, first_line
from ..fx.capture.copies import shared_copy
from ..fx.capture.inputs import example_call
from ..fx.capture.modes import module_mode
from ..fx.view.macs import measured_macs
from ..serving.artifact import record_of
from ..serving.parts import PartsRecord, by_parts

log = logging.getLogger(__name__)

Call = tuple[tuple, dict]  # one call's positional and keyword arguments
ConvertOne = Callable[[nn.Module, Call, "list[Call] | None"], nn.Module]


def convert_by_parts(model: nn.Module, example: tuple[Any, dict], why: CaptureError, train: bool, dtype: str,
                     convert_one: ConvertOne, calibration: list[Any] | None = None) -> nn.Module:
    """``model`` converted by parts (module docstring); ``convert_one(module, call, calibration_calls)`` converts
    one submodule whole or raises. Raises ``why`` again, with what was tried, where no submodule captures; where
    every part that captures is better left fp32 (rule 3), the copy runs as the original, and says so."""
    args, kwargs = example_call(example)
    tree = copy.deepcopy(model) if train else shared_copy(model)  # rule 4: the caller's model is never touched
    try:
        calls, counted = _record(tree, args, kwargs, train)
    except Exception:  # noqa: BLE001 - the model does not run on the example: the capture's error says why
        raise why from None
    if train:  # a layer a random draw skipped in training (LayerDrop) is called in eval mode
        calls = {**_record(tree, args, kwargs, False)[0], **calls}
    batches = [_record(tree, *_as_call(batch), train)[0] for batch in calibration] if calibration else None
    record = PartsRecord(converted=[], eager={}, macs=counted, dtype=dtype, mode="train" if train else "inference",
                         why_whole=_reason(why))
    tied = _tied(tree) if train else []
    _descend(tree, "", calls, batches, record, convert_one, {})
    _retie(tree, tied)
    if not record.converted and not record.kept_fp32:
        raise CaptureError(f"{why} No submodule of {type(model).__name__} converts on its own either "
                           f"({_tried(record)}); the model runs as it is in fp32") from why
    tree.train(train)
    if by_parts(tree, record) is None:
        raise CaptureError(f"{why} Its parts convert, but {type(model).__name__}'s class cannot take another base "
                           "to hold them; the model runs as it is in fp32") from why
    total, low = measured_macs(lambda: _call(tree, args, kwargs, train))
    record.info = {"macs_total": total, "macs_low": low}
    if record.converted:
        log.warning("%s does not capture whole (%s); converted by parts: %s; the code between them runs as the "
                    "model's own Python, in fp32", type(model).__name__, record.why_whole, ", ".join(record.converted))
    else:
        log.warning("%s does not capture whole (%s), and no part of it that captures runs faster in low precision "
                    "here: it runs as the original, in fp32 (amppass.report says why for each part)",
                    type(model).__name__, record.why_whole)
    return tree


def _record(tree: nn.Module, args: tuple, kwargs: dict, train: bool) -> tuple[dict[int, Call], int | None]:
    """Rule 2: the first call of every module of ``tree`` (by identity), and the whole call's multiply-adds."""
    calls: dict[int, Call] = {}

    def keep(module: nn.Module, module_args: tuple, module_kwargs: dict) -> None:
        if id(module) not in calls:
            calls[id(module)] = pytree.tree_map_only(torch.Tensor, _private, (module_args, module_kwargs))

    handles = [m.register_forward_pre_hook(keep, with_kwargs=True) for m in tree.modules()]
    try:
        total, _ = measured_macs(lambda: _call(tree, args, kwargs, train))
    finally:
        for handle in handles:
            handle.remove()
    return calls, total or None


def _call(tree: nn.Module, args: tuple, kwargs: dict, train: bool) -> Any:
    """One call of ``tree`` on private copies of the inputs: the model's code may write into them (a cache)."""
    args, kwargs = copy.deepcopy((args, kwargs))
    with torch.no_grad(), module_mode(tree, train):
        return tree(*args, **kwargs)


def _private(tensor: torch.Tensor) -> torch.Tensor:
    """A recorded argument that later in-place writes of the model's code cannot change."""
    return tensor.detach().clone()


def _as_call(batch: Any) -> Call:
    """A calibration batch as one call: a tuple of positional inputs, or a dict of keyword inputs."""
    if isinstance(batch, dict):
        return (), dict(batch)
    return (batch if isinstance(batch, tuple) else (batch,)), {}


def _descend(module: nn.Module, prefix: str, calls: dict[int, Call], batches: list[dict[int, Call]] | None,
             record: PartsRecord, convert_one: ConvertOne, done: dict[int, nn.Module]) -> None:
    """Rule 3 for the children of ``module`` (at ``prefix``), replacing each converted child in place."""
    for name, child in list(module.named_children()):
        path = f"{prefix}.{name}" if prefix else name
        if id(child) in done:
            module._modules[name] = done[id(child)]
            record.converted.append(path)
            if record.mode == "inference":
                record.originals[path] = child
            continue
        if not _holds_weights(child):
            continue
        call = calls.get(id(child))
        if call is None:  # a container (nn.ModuleList) is never called itself: its children may be
            if any(id(m) in calls for m in child.modules()):
                _descend(child, path, calls, batches, record, convert_one, done)
            else:
                record.eager[path] = "not called on the example"
            continue
        own = [_as_batch(child, b[id(child)]) for b in batches if id(child) in b] if batches is not None else None
        try:
            with _notes_of(record, path):
                converted = convert_one(child, call, own)
        except CaptureError as err:
            record.eager[path] = _reason(err)
            _descend(child, path, calls, batches, record, convert_one, done)
            continue
        except (AmpPassError, RuntimeError, TypeError, ValueError) as err:  # a part that does not convert runs eagerly
            log.warning("%s (%s) runs as the model's code: amppass could not convert it (%s: %s)", path,
                        type(child).__name__, type(err).__name__, first_line(err, 200))
            record.eager[path] = f"not converted ({type(err).__name__}: {first_line(err, 200)})"
            _descend(child, path, calls, batches, record, convert_one, done)
            continue
        kept = record_of(converted).fp32_because()  # a part is converted whole: it holds its own record
        if kept is not None:
            record.eager[path] = kept
            record.kept_fp32.append(path)
            continue
        module._modules[name] = done[id(child)] = converted
        record.converted.append(path)
        if record.mode == "inference":
            record.originals[path] = child


_NOTES: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("amppass_part_notes", default=None)
_PACKAGE = logging.getLogger("amppass")


class _PartNotes(logging.Handler):
    """First on amppass's own logger while parts convert (:func:`_notes_of`), which then propagates through it
    alone: in the context of one part's conversion, an amppass warning is noted in the parts record and passed on at
    info level; every other record (another thread's, another level) is passed on as it is, to the handlers above
    amppass's logger, as propagating would have (where it propagated before)."""

    def __init__(self) -> None:
        super().__init__()
        self.users = 0  # conversions of a part under way, in any thread
        self.propagated = True  # whether amppass's logger propagated before the first of them

    def emit(self, record: logging.LogRecord) -> None:
        notes = _NOTES.get()
        if notes is not None and record.levelno == logging.WARNING:
            notes.append(record.getMessage())
            record.levelno, record.levelname = logging.INFO, "INFO"
            if not logging.getLogger(record.name).isEnabledFor(logging.INFO):
                return
        if self.propagated and _PACKAGE.parent is not None:
            _PACKAGE.parent.callHandlers(record)


_HANDLER = _PartNotes()
_HANDLING = threading.Lock()


@contextlib.contextmanager
def _notes_of(record: PartsRecord, path: str) -> Iterator[None]:
    """Rule 7 while the part at ``path`` converts: amppass's warnings in this context go to ``record.notes[path]``,
    logged at info level (:class:`_PartNotes`); amppass's logger is as it was once no part converts."""
    notes: list[str] = []
    with _HANDLING:
        if not _HANDLER.users:
            _HANDLER.propagated = _PACKAGE.propagate
            _PACKAGE.handlers.insert(0, _HANDLER)
            _PACKAGE.propagate = False
        _HANDLER.users += 1
    token = _NOTES.set(notes)
    try:
        yield
    finally:
        _NOTES.reset(token)
        with _HANDLING:
            _HANDLER.users -= 1
            if not _HANDLER.users:
                _PACKAGE.removeHandler(_HANDLER)
                _PACKAGE.propagate = _HANDLER.propagated
        if notes:
            record.notes[path] = notes


def _as_batch(module: nn.Module, call: Call) -> Any:
    """A recorded call as a calibration batch: its positional inputs, its keyword inputs, or (both given) every
    input by the name ``forward`` gives it."""
    args, kwargs = call
    if not kwargs or not args:
        return dict(kwargs) if kwargs else tuple(args)
    try:
        return dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return tuple(args)


def _tied(tree: nn.Module) -> list[list[str]]:
    """The names of each parameter reachable under several names (a masked LM's decoder tied to its embeddings)."""
    names: dict[int, list[str]] = {}
    for name, parameter in tree.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _retie(tree: nn.Module, tied: list[list[str]]) -> None:
    """Rule 4 in train mode: each train-mode part owns copies of its tensors, so a parameter two parts (or a part
    and the code between parts) share would train as two; every name of it is pointed at the first one's again."""
    for names in tied:
        found = [(name, _parameter(tree, name)) for name in names]
        found = [(name, parameter) for name, parameter in found if parameter is not None]
        for name, parameter in found[1:]:
            if parameter is not found[0][1]:
                owner, _, attribute = name.rpartition(".")
                setattr(tree.get_submodule(owner), attribute, found[0][1])


def _parameter(tree: nn.Module, name: str) -> nn.Parameter | None:
    try:
        return tree.get_parameter(name)
    except AttributeError:
        return None


def _holds_weights(module: nn.Module) -> bool:
    return any(p.is_floating_point() for p in module.parameters())


def _reason(err: BaseException) -> str:
    """The capture's own words, without the advice for converting a whole model (which parts follow)."""
    return first_line(err, 400).split(" Try:")[0].strip()[:240]


def _tried(record: PartsRecord) -> str:
    if not record.eager:
        return "it holds no submodule with weights"
    shown = [f"{path}: {why}" for path, why in list(record.eager.items())[:3]]
    return "; ".join(shown) + ("; ..." if len(record.eager) > 3 else "")
