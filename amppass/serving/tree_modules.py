"""The modules of a converted train-mode model's tree (:mod:`amppass.serving.tree`, rules 3 and 4): one
:class:`TreeModule` per module of the original, holding that module's parameters, buffers and submodules and running
its piece of the graph of the root's mode; each made an instance of its original module's class too, with the
original's plain attributes, so code that looks for a class or an attribute (FSDP2 and activation-checkpointing
wrap policies, ``model.apply(init_weights)``, containers iterated as their class does) keeps finding it.
"""

from __future__ import annotations

import collections
import copy
import functools
import logging
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import InputError

log = logging.getLogger(__name__)


class Mode:
    """Which code every part of one tree runs: the key of the root's current plan, so a part never runs
    another mode's or shape's code. The example's plan of each mode is keyed by the ``training`` flag."""

    def __init__(self, training: bool):
        self.key: Any = training
        self.calls = 0  # root calls under way: a part runs only inside one (or in backward, recomputing)


class Children:
    """Iterating, ``len`` and indexing reach a module's submodules in order, as they do on the
    ``nn.ModuleList`` or ``nn.Sequential`` it may stand for (``for block in model.transformer.h: ...``)."""

    _modules: dict[str, nn.Module]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __bool__(self) -> bool:  # a module with no submodules is still a module, not an empty container
        return True

    def __getitem__(self, key: int | str) -> nn.Module:
        if isinstance(key, str):
            return self._modules[key]
        return list(self._modules.values())[key]


class TreeModule(nn.Module):
    """One module of the original model: its parameters, buffers and submodules, and its part of each graph.

    Made an instance of the original module's class too by :func:`as_original` (rule 4)."""

    def __init__(self, original_type: str, mode: Mode, path: str = ""):
        super().__init__()
        self.original_type = original_type
        self._code: dict[bool, Callable[..., Any]] = {}
        self._mode = mode
        self._path = path

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run this module's part of the graph of the root's mode (only inside a call of the root)."""
        if kwargs or not self._mode.calls and torch._C._current_graph_task_id() < 0:
            raise InputError(
                f"{self._path or self.original_type} ({self.original_type}) is a part of a model amppass converted in "
                "train mode: it runs its piece of the converted graph, which takes the graph's own values, inside "
                "a call of the whole model only. Call the whole model, or convert this submodule of the original "
                f"on its own (amppass.convert(original.{self._path or '<submodule>'}, example_inputs, mode=...))")
        return self._code[self._mode.key](self, *args)

    def extra_repr(self) -> str:
        """What ``print(model)`` shows beside the part's class name."""
        return "converted by amppass"

    def __deepcopy__(self, memo: dict[int, Any]) -> "TreeModule":
        """A copy with its own tensors that runs in the same tree (peft's ``modules_to_save`` copies a part to
        train it beside the original): it shares the tree's mode unless the whole tree is being copied, which
        puts its own copy of the mode in ``memo`` first."""
        memo.setdefault(id(self._mode), self._mode)
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__dict__.update({key: copy.deepcopy(value, memo) for key, value in self.__dict__.items()})
        return copied


class PlainTreeModule(Children, TreeModule):
    """A part whose original class could not be mixed in: it still iterates and indexes like the container
    it may stand for."""


# What nn.Module itself keeps in an instance's __dict__: a part has its own, never the original's.
_MODULE_KEYS = frozenset(vars(nn.Module())) | {"forward"}


@functools.cache
def _tree_module_class(original: type) -> type:
    """``original`` with :class:`TreeModule` first in its order: the part's ``forward``, everything else the class's
    (but slicing, for the containers: theirs builds a new instance of the part's class, which only the tree can)."""
    namespace = {"__module__": original.__module__, "__qualname__": original.__qualname__}
    if issubclass(original, (nn.ModuleList, nn.Sequential)):
        namespace["__getitem__"] = _container_item
    return type(original.__name__, (TreeModule, original), namespace)


def _container_item(self: nn.Module, index: Any) -> Any:
    """A converted ``nn.ModuleList``/``nn.Sequential`` indexed as the original; a slice holds the same parts
    in a plain container of that kind (``for block in model.layers[:2]``)."""
    if isinstance(index, slice):
        items = list(self._modules.items())[index]
        if isinstance(self, nn.Sequential):
            return nn.Sequential(collections.OrderedDict(items))
        return nn.ModuleList([module for _, module in items])
    return super(TreeModule, self).__getitem__(index)  # type: ignore[misc]


def as_original(module: nn.Module, mode: Mode, path: str) -> TreeModule:
    """A part for original ``module`` at ``path`` (rule 4): an instance of its class holding its plain attributes."""
    part: TreeModule = PlainTreeModule(type(module).__name__, mode, path)
    try:
        part.__class__ = _tree_module_class(type(module))
    except Exception as err:  # noqa: BLE001 - the part still runs; only isinstance checks miss it
        log.info("%s: the converted part is not an instance of the class (%s); wrap it by its path",
                 type(module).__name__, err)
        return part
    for key, value in vars(module).items():
        if key in _MODULE_KEYS or key in vars(part):
            continue
        if not _holds_state(value, module):
            part.__dict__[key] = value
        elif type(value) in (dict, list, collections.OrderedDict):  # a cache of tensors the class's code refills
            part.__dict__[key] = type(value)()
    return part


def _holds_state(value: Any, module: nn.Module) -> bool:
    """Whether ``value`` holds tensors, modules or ``module`` itself (a bound method): a part never shares those."""
    if getattr(value, "__self__", None) is module:
        return True
    return any(isinstance(leaf, (torch.Tensor, nn.Module)) for leaf in pytree.tree_leaves(value))
