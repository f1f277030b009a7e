"""The module ``amppass.convert(..., mode="train")`` returns: a train graph and an eval graph over one state.

torch.export bakes the training flag into the graph it captures (dropout's ``train`` argument, batch norm's
``training`` argument, any ``if self.training`` in Python) and its module refuses ``.train()``/``.eval()``.
torch.ao's ``move_exported_model_to_train/eval`` rewrote dropout and batch norm patterns in place, but
torch 2.13 no longer ships it and it cannot follow a model's own ``self.training`` branches. So both modes
are captured and converted, and :class:`TrainEvalGraphs` runs the one that matches ``self.training``.

Rules:

1. The module owns its state: parameters and buffers are cloned from the captured (caller's) tensors, so
   training the converted module never touches the caller's model. Tied weights stay tied.
2. Parameters and buffers keep the original model's qualified names, so ``named_parameters()``,
   ``state_dict()`` and checkpoints read as the original's, and any optimizer works on them.
3. Both graphs read the very same tensors: a step taken in train mode is seen in eval mode, and batch
   norm's running statistics, updated in place by the train graph, are what the eval graph normalises with.
   After anything that may replace tensors (``.to()``, ``load_state_dict(assign=True)``) the graphs are
   pointed at the module's tensors again.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Iterator, Mapping

import torch
from torch import fx, nn

log = logging.getLogger(__name__)


class TrainEvalGraphs(nn.Module):
    """Runs ``train_graph`` in training mode and ``eval_graph`` in eval mode, over one set of fp32 tensors.

    Args:
        train_graph: the model captured and converted in training mode; its state becomes this module's.
        eval_graph: the same model captured and converted in eval mode; its state is replaced by this
            module's, so only its graph is used.
        training: the mode to start in.
    """

    def __init__(self, train_graph: fx.GraphModule, eval_graph: fx.GraphModule, training: bool = True):
        super().__init__()
        _own_state(train_graph)
        # Rule 2: the train graph's module tree becomes this module's, so names are the original model's.
        for name, child in train_graph.named_children():
            self.add_module(name, child)
        for name, param in train_graph._parameters.items():
            self.register_parameter(name, param)
        for name, buf in train_graph._buffers.items():
            self.register_buffer(name, buf, persistent=name not in train_graph._non_persistent_buffers_set)
        # Not submodules: their state is this module's, and registering them would prefix every name.
        object.__setattr__(self, "_graphs", {True: train_graph, False: eval_graph})
        self._share_state()
        self.train(training)

    @property
    def train_graph(self) -> fx.GraphModule:
        """The converted graph run in training mode (the one :func:`amppass.report` reads)."""
        return self._graphs[True]

    @property
    def eval_graph(self) -> fx.GraphModule:
        """The converted graph run in eval mode."""
        return self._graphs[False]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the graph of the current mode."""
        return self._graphs[self.training](*args, **kwargs)

    def _apply(self, fn: Any, recurse: bool = True) -> "TrainEvalGraphs":
        result = super()._apply(fn, recurse)
        self._share_state()  # rule 3: buffers (and, on some settings, parameters) are new tensors now
        return result

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``, then both graphs read the loaded tensors (they may be new with ``assign``)."""
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self._share_state()
        return result

    def _share_state(self) -> None:
        """Rule 3: point every state attribute of both graphs at this module's tensor of the same name."""
        for graph in self._graphs.values():
            for name, tensor in _state(self):
                _set(graph, name, tensor)


def _state(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    return itertools.chain(
        module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)
    )


def _own_state(gm: fx.GraphModule) -> None:
    """Rule 1: replace every parameter and buffer of ``gm`` by a clone, keeping tied tensors tied."""
    clones: dict[int, torch.Tensor] = {}
    for name, tensor in list(_state(gm)):
        if id(tensor) not in clones:
            data = tensor.detach().clone()
            clones[id(tensor)] = (
                nn.Parameter(data, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else data
            )
        _set(gm, name, clones[id(tensor)])
    log.debug("train-mode module owns %d cloned tensors", len(clones))


def _set(root: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Store ``tensor`` at dotted ``name`` under ``root`` as a parameter or a buffer, as it was there."""
    *path, leaf = name.split(".")
    owner = root.get_submodule(".".join(path))
    if leaf in owner._parameters:
        owner._parameters[leaf] = tensor
    elif leaf in owner._buffers:
        owner._buffers[leaf] = tensor
    elif isinstance(tensor, nn.Parameter):
        owner.register_parameter(leaf, tensor)
    else:
        owner.register_buffer(leaf, tensor)
