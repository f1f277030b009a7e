"""A ``torch.autograd.Function``'s own backward, which a train-mode capture cannot keep.

torch.export runs a Function's ``forward`` and records the ops inside it: the captured graph's backward is
autograd's derivative of those ops, not the ``backward`` the model wrote. Where the two agree (Bloom's GELU,
MRA's sparse products) nothing changes. Where they do not, the converted model trains on other gradients
without a word: a straight-through estimator's ``round`` has derivative zero, YOSO's hashed attention has an
approximate backward by design (a key bias's gradient had cosine 0.90 with the model's own), PhiMoE's sparse
mixer and RecurrentGemma's bounded square root change theirs on purpose.

So every capture records the Functions the model's code applied (:func:`functions_applied`, torch's own left
out), and a train-mode conversion that saw one compares, on the example, the fp32 gradients of the captured
graph with the original model's (:func:`check_backward`); where they differ it raises
:class:`~amppass.errors.CaptureError` naming the Functions. Gradients are taken with ``torch.autograd.grad``:
the caller's parameters get no ``.grad``.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from typing import Any, Iterator

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ...errors import CaptureError
from .modes import module_mode

FUNCTIONS_KEY = "amppass_autograd_functions"  # gm.meta: the Functions the capture applied, by qualified name
GRADIENT_TOLERANCE = 1e-3  # ||graph's gradient - model's|| / ||model's||, both fp32: far above rounding


@contextlib.contextmanager
def functions_applied() -> Iterator[set[str]]:
    """The qualified names of the ``torch.autograd.Function`` subclasses applied in this thread meanwhile
    (torch's own left out: their backward is the derivative, or they are torch's to keep)."""
    seen: set[str] = set()
    thread = threading.get_ident()
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == thread and not cls.__module__.startswith("torch."):
            seen.add(f"{cls.__module__}.{cls.__qualname__}")
        return original.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        torch.autograd.Function.apply = original  # type: ignore[method-assign]


def check_backward(model: nn.Module, graphs: dict[bool, fx.GraphModule], args: tuple, kwargs: dict) -> None:
    """Raise where a graph of ``model`` captured in fp32 (``graphs[True]`` in train mode, ``graphs[False]`` in eval
    mode) differentiates another function than the model's own Functions do (module docstring); nothing where
    the captures applied none.

    The comparison runs in eval mode on the model itself where the eval capture applied the Functions. A
    Function only the train capture applied (PhiMoE's router, which runs it only in training) is compared in
    train mode on a copy of the model and graph (batch norm updates its statistics there), with the same seed
    for both runs (dropout draws the same masks: the graph calls the same random ops in the same order)."""
    train_only = set(graphs[True].meta.get(FUNCTIONS_KEY, ())) - set(graphs[False].meta.get(FUNCTIONS_KEY, ()))
    if graphs[False].meta.get(FUNCTIONS_KEY):
        _compare(model, graphs[False], args, kwargs, graphs[False].meta[FUNCTIONS_KEY], train=False)
    if train_only:
        copied, graph = copy.deepcopy((model, graphs[True]))  # one memo: the copies share tensors as these do
        _compare(copied, graph, args, kwargs, sorted(train_only), train=True)


def _compare(model: nn.Module, gm: fx.GraphModule, args: tuple, kwargs: dict, functions: list[str],
             train: bool) -> None:
    parameters = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]
    if not parameters:
        return
    with module_mode(model, train=train), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        want = _gradients(model(*args, **kwargs), parameters)
        torch.manual_seed(0)
        got = _gradients(gm(*args, **kwargs), parameters)
    worst, where = 0.0, None
    names = {id(p): name for name, p in model.named_parameters()}
    for parameter, a, b in zip(parameters, want, got, strict=False):
        if a is None and b is None:
            continue
        a = torch.zeros_like(parameter) if a is None else a  # a parameter only one of them reaches
        b = torch.zeros_like(parameter) if b is None else b
        error = float((a - b).norm() / (a.norm() or b.norm() or 1.0))
        if not error <= worst:
            worst, where = error, names.get(id(parameter), "?")
    if worst > GRADIENT_TOLERANCE:
        raise CaptureError(
            f"{type(model).__name__} applies {', '.join(sorted(functions))} (torch.autograd.Function); torch.export "
            f"captures its forward and differentiates that, and on the example ({'train' if train else 'eval'} "
            f"mode) the gradient of {where} then differs from the model's own by {worst:.3g} (relative, fp32): "
            "training the converted model would follow other gradients. Convert the modules around it "
            "separately, train it with torch.compile(model, backend='amppass', options={'mode': 'train'}) (the "
            "graph holding the Function runs in fp32 with its backward), or convert it for inference")


def _gradients(out: Any, parameters: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """The gradients of a fixed random projection of every floating output (seeded: the same for both runs)."""
    outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()
               and t.requires_grad]
    if not outputs:
        return [None] * len(parameters)
    generator = torch.Generator().manual_seed(0)
    loss = sum((t.float() * torch.randn(t.shape, generator=generator).to(t.device)).sum() for t in outputs)
    return list(torch.autograd.grad(loss, parameters, allow_unused=True))
