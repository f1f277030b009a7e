"""Converted models that stand in for the original: its class, its attributes, its ``forward``'s signature.

Libraries read a model's attributes and signatures, not only its outputs: transformers' pipelines read
``model.device``, ``model.config`` and ``can_generate()``; ``generate()`` lives in the model's class;
``Trainer`` keeps the dataset columns that ``inspect.signature(model.forward)`` names; sentence-transformers'
``encode()`` reads its tokenizer from ``self[0]``. :func:`in_own_class` gives the converted module the
original's class back.

Rules:

1. The module returned for a transformers ``PreTrainedModel`` (any head), and for another module whose class
   has methods or properties of its own beyond ``forward`` (not one of torch's own modules), is an instance of a
   subclass of the model's class (``isinstance`` holds; ``generate()``, ``encode()``, ``can_generate()`` are
   the class's own), made without running its ``__init__``. It holds the model's plain attributes (its own
   copies of ``config`` and ``generation_config``, which callers change on the instance) and, as its only
   tensors, those of the converted module: its submodule ``converted``. Where such a class cannot be made
   (a class that refuses subclassing or ``__new__`` without arguments) the converted module comes back as it is.
2. A transformers model holds no other module. Another module holds weightless copies of its submodules, before
   ``converted``: the same classes and plain attributes (a tokenizer, a config), no parameters or buffers, and a
   ``forward`` that refuses to run; so methods that read them (``self[0].tokenizer``) keep working.
3. ``forward`` has the model's own signature and calls ``converted`` with the call; for a transformers model
   less the keyword values that are ``None`` and ``return_dict``: the graph returns the model's output class,
   and ``return_dict=False`` gives its ``to_tuple()``. ``forward(...)`` and ``module(...)`` run the same path.
   A train-mode transformers model (rule 7) takes its calls the same way, so sentence-transformers' call
   (``return_dict=True``, its own keyword order) runs the plan captured from the example.
4. It faces its caller as the original did: ``dtype`` is the model's own (fp32 where ``keep_io_types``),
   ``parameters()`` widen the low-precision copies to fp32 (:mod:`amppass.serving.fp32_parameters`), ``device`` is
   where the converted tensors are; ``get_input_embeddings()`` of a transformers model is an ``nn.Embedding`` over the
   converted model's table (in fp32, a fresh module on each call).
5. An encoder-decoder's ``generate()`` raises :class:`~amppass.errors.InputError`: it runs the encoder on its
   own (``get_encoder()``), a call the graph of the whole model cannot make.
6. The converted module's own API stays at hand: ``graph``, ``meta``, ``plans``, ``guards``,
   ``drop_original()`` read ``converted``'s; :func:`amppass.report` reads ``converted``.
7. A train-mode model keeps its own class (:class:`~amppass.serving.train_eval.TrainEvalGraphs`, whose module tree
   is the original's); :func:`with_signature` gives its ``forward`` the model's signature and, but for a
   transformers model, the other methods of the model's class with the plain attributes they read (a parent
   model converted by parts calls them: torchvision's RetinaNet calls ``self.head.compute_loss``). A transformers
   model gets its own copies of ``config`` and ``generation_config`` (sentence-transformers' ``Transformer``
   reads ``self.model.config``), the very ones its saves write (rule 8). A method of the model's class that
   calls ``super()`` needs an instance of that class: it raises :class:`~amppass.errors.InputError` naming what
   to convert instead (a ``SentenceTransformer``'s ``encode``: its transformer, converted on its own and put
   back as ``st[0].model``, trains inside it).
8. Saving where users save: the class's own ``save_pretrained`` and ``save`` (transformers, sentence-transformers)
   write what the original's would: its keys and fp32 weights, which its plain class loads
   (``Class.from_pretrained(path)``). They run on the original model, the one the converted module keeps for
   later plans, dressed in the converted model's plain attributes (its own ``config``, the weightless copies'
   settings). They refuse (:class:`~amppass.errors.InputError`) where the original is not held
   (``drop_original()``, a symbolic trace) or where its weights changed after converting (the file would load as
   another model than the one that runs): never a file that loads as a different model. A train-mode model
   (rule 7) writes its own fp32 tensors, trained, under the original's names, from the same class's method.
   ``state_dict()`` of a converted inference model stays its storage, the low-precision copies under
   ``converted.`` names (:mod:`amppass.serving.fp32_parameters`, rule 3), as ``named_parameters()`` names them: the
   original's fp32 weights are not the converted model's tensors (they are the caller's, released by
   ``drop_original()``), and a state dict of them would not load back into it.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import os
import re
import sys
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..errors import InputError
from .fp32_parameters import fp32_parameters, low_face, stored_parameters

log = logging.getLogger(__name__)

_OWN = ("config", "generation_config")  # copied: generate() and pipelines change them on the instance
_DROPPED = ("return_dict",)  # arguments the converted graph of a transformers model does not take (rule 3)
_CONVERTED_API = ("graph", "meta", "plans", "guards", "drop_original", "code", "select")  # rule 6
_SAVERS = ("save_pretrained", "save")  # the class's own ways to write the model to disk (rule 8)
_MODULE_KEYS = frozenset(vars(nn.Module()))  # what nn.Module keeps in an instance's __dict__
# a weight's low-precision copy beside its fp32 tensor (serving.fp32_parameters)
_LOW_COPY = re.compile(r"__(fp16|bf16)$")
# rule 9: given the converted module and the class it is saved as, exports it at once and returns the function
# that writes it into a save folder, saying what it wrote there
PlanFile = Callable[[nn.Module, type], Callable[[str], str]]


def is_transformers_model(model: Any) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel``."""
    if "transformers" not in sys.modules or not isinstance(model, nn.Module):
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def transformers_call(model: nn.Module, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """A transformers model's keyword inputs as its converted graph takes them (rule 3): without ``None`` values
    and ``return_dict``. Other models' inputs are returned as they are."""
    if kwargs is None or not is_transformers_model(model):
        return kwargs
    return _graph_kwargs(kwargs)


def _graph_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Rule 3: keyword inputs less the ``None`` values and ``return_dict``."""
    return {k: v for k, v in kwargs.items() if v is not None and k not in _DROPPED}


def _transformers_forward(run: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """Rule 3: ``run`` (a converted transformers model's graph) called as the model's ``forward`` is: the graph
    returns the model's output class, and ``return_dict=False`` gives its ``to_tuple()``."""
    tuple_out = kwargs.get("return_dict") is False
    out = run(*args, **_graph_kwargs(kwargs))
    return out.to_tuple() if tuple_out and hasattr(out, "to_tuple") else out


def in_own_class(model: nn.Module, converted: nn.Module, plan_file: PlanFile) -> nn.Module:
    """``converted`` in the class of ``model`` (rules 1 and 2) where that class has more than ``forward`` to
    offer and can be made; otherwise ``converted``. ``plan_file`` writes the plan beside the weights its class's
    save methods write (rule 9)."""
    transformers = is_transformers_model(model)
    if not transformers and not _own_api(type(model)):
        return converted
    try:
        cls = _dropin_class(type(model), _mixin(model, transformers))
        module = cls.__new__(cls)
    except Exception as err:  # noqa: BLE001 - any class that cannot be remade keeps the converted module
        log.info("%s: the converted module is returned as it is: its class cannot be subclassed without its "
                 "__init__ (%s)", type(model).__name__, err)
        return converted
    if cls.__mro__[1] is EncoderDecoderDropIn:
        log.warning("%s is an encoder-decoder: the converted model computes its forward; its generate() runs the "
                    "encoder on its own, which the graph of the whole model cannot, so it raises; to generate in "
                    "mixed precision, compile the model's forward with the amppass backend: model.forward = "
                    "torch.compile(model.forward, backend='amppass'), then model.generate(...)", type(model).__name__)
    nn.Module.__init__(module)
    bookkeeping = set(vars(module))
    for key, value in vars(model).items():
        if key not in bookkeeping:
            module.__dict__[key] = copy.deepcopy(value) if key in _OWN else value
    module.__dict__["_amppass_dtype"] = _io_dtype(model)
    module.__dict__["_amppass_plan_file"] = plan_file
    if transformers:
        module.__dict__["_amppass_embeddings"] = _embedding_name(model)
    else:
        for name, child in model.named_children():
            module._modules[name] = _weightless_copy(child, converted, module._amppass_dtype)
    module.converted = converted
    module.train(model.training)
    log.info("%s: converted module wrapped in its class", type(model).__name__)
    return module


def with_signature(module: nn.Module, model: nn.Module) -> nn.Module:
    """``module`` with its ``forward`` showing ``model.forward``'s signature (rule 7): its class becomes a
    subclass made for that; ``module`` is returned."""
    cls, wanted = type(module), type(model)
    signed = _signed.get((cls, wanted))
    if signed is None:
        run = cls.forward

        if is_transformers_model(model):  # rule 3, as the inference drop-in calls its graph
            def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
                return _transformers_forward(functools.partial(run, self), args, kwargs)
        else:
            def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
                return run(self, *args, **kwargs)

        own = {} if is_transformers_model(model) else _methods_of(wanted, cls)
        signed = _signed[(cls, wanted)] = type(cls.__name__, (cls,), {
            **own, "forward": functools.wraps(wanted.forward)(forward),
            "__module__": cls.__module__, "__doc__": cls.__doc__, "__qualname__": cls.__qualname__,
            **savers(wanted, _trained_saveable),
        })
    attributes = _plain_attributes(model)
    if savers(wanted, _trained_saveable):  # rule 8: the class and plain attributes to save the trained tensors as
        module.__dict__["_amppass_saved_as"] = (wanted, attributes)
    for key in _OWN:  # rule 7: its own copies, the very ones it saves with (rule 8)
        if key in attributes:
            module.__dict__[key] = attributes[key]
    if not is_transformers_model(model):  # rule 7: what the class's own methods read
        for key, value in attributes.items():
            if getattr(value, "__self__", None) is not model:  # a bound method would call the caller's model
                module.__dict__.setdefault(key, value)
    module.__class__ = signed
    return module


def _methods_of(wanted: type, base: type) -> dict[str, Any]:
    """Rule 7: the methods and properties of ``wanted``'s own classes (outside torch) that
    ``base`` does not define, nearest class first; so a parent model's code can call a part's other methods
    (torchvision's RetinaNet calls ``self.head.compute_loss``)."""
    found: dict[str, Any] = {}
    for klass in wanted.__mro__:
        if klass in (nn.Module, object) or klass.__module__.startswith("torch."):
            continue
        for name, value in vars(klass).items():
            if name.startswith("__") or name == "forward" or hasattr(base, name):
                continue
            if "__class__" in getattr(getattr(value, "__code__", None), "co_freevars", ()):
                value = _needs_own_class(klass, name)  # super(): a call on this module cannot run it
            if callable(value) or isinstance(value, (property, functools.cached_property, staticmethod,
                                                     classmethod)):
                found.setdefault(name, value)
    return found


def _needs_own_class(klass: type, name: str) -> Callable[..., Any]:
    """Rule 7: a method of ``klass`` that calls ``super()``, which only an instance of ``klass`` can run (a
    ``SentenceTransformer``'s ``encode``): raises :class:`~amppass.errors.InputError` saying what to convert."""

    def refused(self: Any, *args: Any, **kwargs: Any) -> Any:
        cls = klass.__name__
        raise InputError(
            f"{cls}.{name}() calls super(), which needs an instance of {cls}, and a model converted with mode='train' "
            f"is amppass's own module ({type(self).__mro__[1].__name__}): convert the part that trains and put it "
            f"back in the {cls}, which keeps its class (a SentenceTransformer: st[0].model = amppass.convert("
            "st[0].model, example_kwargs=features, mode='train', ...), features the input_ids, attention_mask and "
            "token_type_ids of st.preprocess(sentences)), or call it on the original model")

    return refused


_classes: dict[tuple[type, type], type] = {}
_signed: dict[tuple[type, type], type] = {}
_weightless_classes: dict[type, type] = {}


class DropIn:
    """The part of a converted model's class that amppass adds (module docstring)."""

    converted: nn.Module

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.converted(*args, **kwargs)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """The converted module's parameters, low-precision copies widened to fp32 (rule 4)."""
        named = nn.Module.named_parameters(self, *args, **kwargs)
        low = low_face(self.converted)
        return named if low is None else fp32_parameters(named, low)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's inputs and outputs as its callers see them (rule 4)."""
        return self._amppass_dtype

    def _amppass_saveable(self, how: str) -> tuple[nn.Module, Callable[[str], None]]:
        """The original model dressed as this one, for the class's ``how`` method to save (rule 8), and what to do
        in the folder once it has (rule 9): the plan, exported before anything is written, written beside."""
        converted = nn.Module.__getattr__(self, "converted")
        plans = getattr(converted, "_plans", None)  # a ServingGraph keeps the original for later plans
        original = getattr(plans, "original", None)
        name = type(self).__name__
        if original is None:
            why = getattr(plans, "origin", None) or "it was converted without example inputs"
            raise InputError(f"{name}.{how}() writes the original model's keys and fp32 weights, and this converted "
                             f"model does not hold the original ({why}): call {how}() on the original model itself; "
                             f"{name} loads what it writes")
        changed = changed_weight(converted, original)
        if changed is not None:
            raise InputError(f"{name}.{how}(): the original model's {changed} changed after it was converted, so the "
                             "file would load as another model than the one this converted model runs: convert the "
                             f"changed original again and save that, or call {how}() on the original itself")
        write = self.__dict__["_amppass_plan_file"](converted, type(original))

        def beside(folder: str) -> None:
            said_at_save("plan", f"{name}.{how}({folder!r}) wrote the original's keys and fp32 weights, which {name} "
                         f"loads as the original in fp32, and {write(folder)}")

        return _dressed(original, self), beside

    def __reduce__(self) -> Any:
        raise InputError(f"{type(self).__name__}: torch.save cannot pickle a converted model (its graph runs generated "
                         "code): save the graph with amppass.save(model.converted, 'model.pt2'), or convert the "
                         "original where it runs")

    def __getattr__(self, name: str) -> Any:
        if name in _CONVERTED_API:  # rule 6
            return getattr(nn.Module.__getattr__(self, "converted"), name)
        return super().__getattr__(name)


class TransformersDropIn(DropIn):
    """What a converted transformers model adds to :class:`DropIn` (rules 3 to 5)."""

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        return _transformers_forward(self.converted, args, kwargs)

    def get_input_embeddings(self) -> nn.Module:
        """The input embedding table as an ``nn.Embedding`` in fp32 (rule 4): the table the graph reads."""
        name = self._amppass_embeddings
        weight = dict(self.converted.named_parameters()).get(f"{name}.weight") if name is not None else None
        if weight is None:
            weight = next((b for n, b in self.converted.named_buffers() if n == f"{name}.weight"), None)
        if weight is None:
            raise InputError(f"{type(self).__name__}: the converted graph holds no input embedding table (its "
                             "original has none, or the graph reads it under another name)")
        return nn.Embedding.from_pretrained(weight.detach().float(), freeze=True)



class EncoderDecoderDropIn(TransformersDropIn):
    """A converted encoder-decoder: its ``generate()`` refuses to run (rule 5)."""

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: see the module docstring's rule 5."""
        raise InputError(
                f"{type(self).__name__} is an encoder-decoder: its generate() runs the encoder on its own "
                "(get_encoder()), which the converted graph of the whole model cannot do; to generate in mixed "
                "precision, compile the original's forward with the amppass backend: model.forward = "
                "torch.compile(model.forward, backend='amppass'), then model.generate(...)")


class WeightlessCopy:
    """A submodule of a converted module's class that holds no tensors (rule 2)."""

    _amppass_converted: nn.Module
    _amppass_dtype: torch.dtype

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise InputError(f"{type(self).__name__} is a part of a model amppass converted: it holds no weights (the "
                         "converted graph runs the whole model's forward); call the converted model itself, or "
                         "convert this part on its own")

    @property
    def device(self) -> torch.device:
        """Where the converted model's tensors are."""
        converted = self._amppass_converted
        tensor = next(iter(list(converted.parameters()) + list(converted.buffers())), None)
        return tensor.device if tensor is not None else torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        """The converted model's input and output dtype."""
        return self._amppass_dtype


def _mixin(model: nn.Module, transformers: bool) -> type:
    if not transformers:
        return DropIn
    return EncoderDecoderDropIn if getattr(model.config, "is_encoder_decoder", False) else TransformersDropIn


def _dropin_class(cls: type, mixin: type) -> type:
    made = _classes.get((cls, mixin))
    if made is None:
        made = _classes[(cls, mixin)] = type(cls.__name__, (mixin, cls), {
            "forward": functools.wraps(cls.forward)(_calling(mixin._forward)), "__module__": __name__,
            "__doc__": f"{cls.__name__} whose forward runs an amppass-converted module (amppass.serving.dropin).",
            **savers(cls, mixin._amppass_saveable)})
    return made


def savers(cls: type, saveable: Callable[[Any, str], tuple[nn.Module, Callable[[str], None]]]) -> dict[str, Any]:
    """Rules 8 and 9: each of ``cls``'s own save methods, run on the module ``saveable(self, name)`` gives (of
    ``cls``, holding the weights to write) instead of on the converted module, then the function it gives on
    the folder written (not where transformers' ``is_main_process=False`` says another process writes it)."""
    made = {}
    for name in _SAVERS:
        method = getattr(cls, name, None)
        if not callable(method):
            continue

        def save(self: Any, *args: Any, _name: str = name, _method: Any = method, **kwargs: Any) -> Any:
            module, beside = saveable(self, _name)
            done = getattr(module, _name)(*args, **kwargs)
            folder = saved_folder(_method, self, args, kwargs)
            if folder is not None:
                beside(folder)
            return done

        made[name] = functools.wraps(method)(save)
    return made


_mixed: dict[tuple[type, type], type] = {}


def mixed_class(mixin: type, cls: type, doc: str, methods: Callable[[type], dict[str, Any]]) -> type:
    """The subclass of ``mixin`` and a model's class ``cls`` that a converted model in its own class is an instance
    of (a kept original, a model converted by parts), made once: named as ``cls``, in ``mixin``'s module, with
    ``doc`` and ``methods(cls)`` (its save methods)."""
    made = _mixed.get((mixin, cls))
    if made is None:
        made = _mixed[(mixin, cls)] = type(cls.__name__, (mixin, cls), {
            "__module__": mixin.__module__, "__qualname__": cls.__qualname__, "__doc__": doc, **methods(cls)})
    return made


def held_in(module: nn.Module, cls: type, key: str, record: Any, what: str) -> bool:
    """Make ``module`` an instance of ``cls`` (a :func:`mixed_class`) carrying ``record`` under ``key``; False, with
    an info line naming ``what`` it is, for a class that cannot take another base (a C layout)."""
    try:
        module.__class__ = cls
    except TypeError as err:
        log.info("%s: %s cannot be held in a class of amppass's (%s)", type(module).__name__, what, err)
        return False
    module.__dict__[key] = record
    return True


def saved_folder(method: Callable[..., Any], module: Any, args: tuple, kwargs: dict) -> str | None:
    """The folder a class's save ``method`` called with ``(args, kwargs)`` wrote (its first argument), or None
    where it wrote none (transformers' ``is_main_process=False``: another process writes it)."""
    call = inspect.signature(method).bind(module, *args, **kwargs).arguments
    folder = list(call.values())[1] if len(call) > 1 else None
    if isinstance(folder, (str, os.PathLike)) and call.get("is_main_process", True):
        return os.fspath(folder)
    return None


_WARNED_AT_SAVE: set[str] = set()


def said_at_save(kind: str, message: str) -> None:
    """Rule 9: log what a save wrote and how to get the conversion back (``message``); a warning the first time a
    save of its ``kind`` says it in this process, at INFO after that (a Trainer saves at every checkpoint)."""
    log.log(logging.INFO if kind in _WARNED_AT_SAVE else logging.WARNING, message)
    _WARNED_AT_SAVE.add(kind)


def _dressed(original: nn.Module, looks: nn.Module) -> nn.Module:
    """A module of ``original``'s class holding its submodules and tensors (never copied) and, over its plain
    attributes, those of ``looks`` (the converted model or one of its weightless copies): what a save method of the
    class writes as the original with the converted model's settings (its ``config``). The original is unchanged."""
    cls = type(original)
    dressed = cls.__new__(cls)
    dressed.__dict__.update(vars(original))
    dressed.__dict__.update({key: value for key, value in vars(looks).items()
                             if key not in _MODULE_KEYS and not key.startswith("_amppass")})
    modules = {}
    for name, child in original._modules.items():
        part = looks._modules.get(name)
        modules[name] = _dressed(child, part) if child is not None and isinstance(part, WeightlessCopy) else child
    dressed.__dict__["_modules"] = modules
    return dressed


def changed_weight(converted: nn.Module, original: nn.Module) -> str | None:
    """The first tensor of ``converted`` (by name) whose original no longer holds the values it was made from:
    fp32 tensors equal, low-precision copies equal to the original's cast to their dtype. Tensors the graph
    holds that the original does not name, or in another shape, are not compared."""
    theirs = dict(original.named_parameters(remove_duplicate=False))
    theirs.update(original.named_buffers(remove_duplicate=False))
    held = stored_parameters(converted, remove_duplicate=False) + list(converted.named_buffers(remove_duplicate=False))
    with torch.no_grad():
        for name, tensor in held:
            base = _LOW_COPY.sub("", name)
            source = theirs.get(base)
            if source is None or source is tensor or source.shape != tensor.shape:
                continue
            if source.is_floating_point() and tensor.is_floating_point():
                same = torch.allclose(source.detach().to(tensor.device, tensor.dtype), tensor.detach(), rtol=0, atol=0,
                                      equal_nan=True)
            elif source.dtype == tensor.dtype:
                same = torch.equal(source.detach().to(tensor.device), tensor.detach())
            else:
                continue
            if not same:
                return base
    return None


class _Itself:
    """Where an attribute's object pointed back at the model (sentence-transformers' ``model_card_data.model``):
    the model being saved takes its place (:func:`_trained_saveable`)."""


def _plain_attributes(model: nn.Module) -> dict[str, Any]:
    """``model``'s own attributes that hold no tensors or modules (``config``, its own copy), for a train-mode
    model to save itself as ``model``'s class (rule 8). An object whose attributes point back at ``model`` is
    kept as a shallow copy pointing at :class:`_Itself` instead (the original is not kept)."""
    kept = {}
    for key, value in vars(model).items():
        if key in _MODULE_KEYS:
            continue
        back = [name for name, held in getattr(value, "__dict__", {}).items() if held is model]
        if back:
            value = copy.copy(value)
            value.__dict__.update(dict.fromkeys(back, _Itself))
        elif any(isinstance(leaf, (torch.Tensor, nn.Module))
                                        for leaf in torch.utils._pytree.tree_leaves(value)):
            continue
        kept[key] = copy.deepcopy(value) if key in _OWN else value
    return kept


def _trained_saveable(self: nn.Module, how: str) -> tuple[nn.Module, Callable[[str], None]]:
    """Rule 8 for a train-mode model: a module of the original's class with its plain attributes, holding this
    module's tree (the original's names, the trained fp32 tensors); rule 9: then the log line saying so."""
    cls, attributes = self.__dict__["_amppass_saved_as"]
    dressed = cls.__new__(cls)
    dressed.__dict__.update({key: value for key, value in vars(self).items() if key in _MODULE_KEYS})
    for key, value in attributes.items():
        back = [name for name, held in getattr(value, "__dict__", {}).items() if held is _Itself]
        if back:
            value = copy.copy(value)
            value.__dict__.update(dict.fromkeys(back, dressed))
        dressed.__dict__[key] = value

    def beside(folder: str) -> None:
        said_at_save("train", f"{cls.__name__}.{how}({folder!r}) wrote the trained fp32 weights under the original's "
                     f"keys, which {cls.__name__} loads; a train-mode conversion is not saved with them: convert the "
                     "loaded model again (mode='train' to go on training, mode='inference' to serve it)")

    return dressed, beside


def _calling(method: Any) -> Any:
    """A new function that calls ``method`` (``functools.wraps`` then names it after the class's forward)."""

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return method(self, *args, **kwargs)

    return forward


def _weightless_copy(module: nn.Module, converted: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``module`` and its submodules without parameters or buffers (rule 2)."""
    cls = _weightless_classes.get(type(module))
    if cls is None:
        base = type(module)
        cls = _weightless_classes[base] = type(base.__name__, (WeightlessCopy, base), {
            "forward": functools.wraps(base.forward)(_calling(WeightlessCopy._refuse)), "__module__": __name__,
            "__doc__": f"{base.__name__} without weights, part of a converted model (amppass.serving.dropin)."})
    weightless = cls.__new__(cls)
    nn.Module.__init__(weightless)
    bookkeeping = set(vars(weightless))
    for key, value in vars(module).items():
        if key not in bookkeeping:
            weightless.__dict__[key] = value
    weightless.__dict__["_amppass_converted"] = converted  # not a submodule: it belongs to the root
    weightless.__dict__["_amppass_dtype"] = dtype
    for name, child in module.named_children():
        weightless._modules[name] = _weightless_copy(child, converted, dtype)
    weightless.training = module.training
    return weightless


def _own_api(cls: type) -> bool:
    """Whether ``cls`` offers callers more than ``forward``: a public method or property of its own, defined
    outside torch (torch's own modules are what their converted graph computes)."""
    for klass in cls.__mro__:
        if klass in (nn.Module, object) or klass.__module__.startswith("torch."):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name == "forward":
                continue
            if callable(value) or isinstance(value, (property, functools.cached_property)):
                return True
    return False


def _embedding_name(model: nn.Module) -> str | None:
    """The module path of ``model``'s input embedding table, if it has one."""
    try:
        table = model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        return None
    return next((name for name, module in model.named_modules() if module is table), None)


def _io_dtype(model: nn.Module) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32
