"""Converted decoders that generate: :func:`amppass.convert` on a transformers model with ``generate()``.

A transformers ``*ForCausalLM`` converts to a graph that computes its ``forward``; ``generate()``, the
configs and the KV cache live in the model's class, not in the graph. :func:`as_generator` gives the
converted graph that class back.

Rules:

1. The module returned for a decoder-only model (an encoder-decoder is left as converted, with a warning:
   :func:`as_generator`) is an instance of a subclass of the model's own class (``isinstance`` holds;
   ``generate()``, ``prepare_inputs_for_generation`` and the cache handling are the class's own), made
   without running its ``__init__``: it holds copies of the model's ``config`` and ``generation_config``, the
   model's other plain attributes, and the converted module as its only submodule, ``converted``. It holds
   none of the original's modules (the converted module keeps the original model for re-captures, as
   :class:`~amppass.serving.serving_graph.ServingGraph` says).
2. ``forward`` has the model's own signature (``generate`` reads it) and calls the converted module with the
   call's arguments, less those that are ``None`` and ``return_dict``: the graph returns the model's output
   class (``return_dict=False`` gives its tuple). So ``generate`` makes few layouts of call: the prefill (an
   empty cache) and the decode steps (a cache of any length, one plan whose lengths are dynamic).
3. ``dtype`` is the model's own (fp32 where ``keep_io_types``): what ``generate`` builds its inputs in.
4. ``amppass.report`` reads the converted module: the plan of every graph it runs.
"""

from __future__ import annotations

import copy
import functools
import logging
import sys
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

_OWN = ("config", "generation_config")  # copied: generate() may change them on the instance
_DROPPED = ("return_dict",)  # arguments the converted graph does not take (rule 2)


def is_generator(model: Any) -> bool:
    """Whether ``model`` is a transformers model whose class can ``generate()``."""
    if "transformers" not in sys.modules or not isinstance(model, nn.Module):
        return False
    from transformers import GenerationMixin

    can = getattr(type(model), "can_generate", None)
    return isinstance(model, GenerationMixin) and callable(can) and bool(can())


def as_generator(model: nn.Module, converted: nn.Module) -> nn.Module:
    """``converted`` in the class of ``model`` (rule 1) where ``model`` generates; otherwise ``converted``.

    An encoder-decoder (T5, BART, Whisper) comes back as ``converted``, with a warning: its ``generate()``
    runs the encoder on its own (``get_encoder()``), a call the converted graph of the whole model does not
    make."""
    if not is_generator(model):
        return converted
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        log.warning("%s is an encoder-decoder: the converted module computes its forward, without generate(), whose "
                    "encoder step the graph of the whole model cannot run; to generate in mixed precision, compile the "
                    "model's forward with the amppass backend: model.forward = torch.compile(model.forward, "
                    "backend='amppass'), then model.generate(...)", type(model).__name__)
        return converted
    cls = type(model)
    generator_cls = _classes.get(cls)
    if generator_cls is None:
        generator_cls = _classes[cls] = type(cls.__name__, (Generator, cls), {
            "forward": functools.wraps(cls.forward)(Generator._forward),
            "__module__": __name__,
            "__doc__": f"{cls.__name__} whose forward runs an amppass-converted graph (amppass.serving.generation).",
        })
    generator = generator_cls.__new__(generator_cls)
    nn.Module.__init__(generator)
    bookkeeping = set(vars(generator))
    for key, value in vars(model).items():
        if key not in bookkeeping:
            generator.__dict__[key] = copy.deepcopy(value) if key in _OWN else value
    generator.__dict__["_amppass_dtype"] = _io_dtype(model)
    generator.converted = converted
    generator.train(model.training)
    log.info("%s: converted graph wrapped in its class, so generate() runs it", cls.__name__)
    return generator


_classes: dict[type, type] = {}


class Generator:
    """The part of a converted generator's class that amppass adds (module docstring)."""

    converted: nn.Module

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        tuple_out = kwargs.get("return_dict") is False
        kwargs = {k: v for k, v in kwargs.items() if v is not None and k not in _DROPPED}
        out = self.converted(*args, **kwargs)
        return out.to_tuple() if tuple_out and hasattr(out, "to_tuple") else out

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's inputs and outputs as its callers see them (rule 3)."""
        return self._amppass_dtype


def _io_dtype(model: nn.Module) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32
