"""Capturing a torch module as an FX GraphModule: torch.export with example inputs, symbolic_trace without.

The caller's module is never changed: its training flags are restored after capture, and the graph
module returned owns its own module tree (tensors are shared, never written in place).

Capture is serialised by :data:`CAPTURE_LOCK`: torch.export keeps process-wide state (the proxy dispatch
mode slot, the mode stack, the config patched below), so two threads exporting at once corrupt each other's
traces. Everything after capture (analysis, rewrite, calibration) runs concurrently.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
from typing import Any, Iterator

import torch
from torch import fx, nn
from torch.export import Dim

from ...errors import CaptureError, InputError, first_line
from .copies import private_copy, shared_copy
from .function_backward import FUNCTIONS_KEY, functions_applied
from .guards import GUARDS_KEY, ShapeGuards, example_refusal, plain_inputs, specialised_dims
from .input_writes import unreturned_write
from .modes import module_mode
from .quiet import quiet_torch

log = logging.getLogger(__name__)

CAPTURE_LOCK = threading.RLock()  # one torch.export / symbolic_trace / ONNX export at a time (module docstring)


@contextlib.contextmanager
def capturing(model: nn.Module, train: bool) -> Iterator[None]:
    """Hold :data:`CAPTURE_LOCK` with ``model`` in train or eval mode, transformers' cache types registered with
    torch's pytree: around every trace or export of it (torch.export and the ONNX exporter alike)."""
    with CAPTURE_LOCK, module_mode(model, train):
        _register_cache_types(model)
        yield

_HINTS = (
    "Try: pass example_inputs (and example_kwargs) exactly as forward() takes them; for data-dependent "
    "Python control flow use torch.cond, convert the submodules around the untraceable part separately, or "
    "compile the model with torch.compile(model, backend='amppass'), which converts every region dynamo "
    "traces around it."
)


def capture(
    model: nn.Module,
    example_inputs: Any = None,
    example_kwargs: dict[str, Any] | None = None,
    *,
    train: bool = False,
    dynamic_shapes: Any = "auto",
    note_fixed_dims: bool = True,
    static_image_sizes: bool = True,
) -> fx.GraphModule:
    """Return a private GraphModule for ``model``.

    With ``example_inputs`` (or ``example_kwargs``) the model is captured by ``torch.export`` (non-strict),
    which handles real architectures; every input dimension is left for export to decide
    (``Dim.AUTO``) unless ``dynamic_shapes`` says otherwise. Without them it is traced symbolically.
    The model is captured in eval mode unless ``train`` is set. Dimensions export had to fix are logged
    as a warning unless ``note_fixed_dims`` is off; the graph's guards are kept in ``gm.meta``. The spatial sizes
    of image and volume inputs stay static under ``"auto"`` (:func:`_static_image_dims`) unless
    ``static_image_sizes`` is off: the re-capture for a call at another size widens them to dynamic, so that one
    more plan takes every size. Keyword inputs
    that reach forward()'s ``**kwargs`` and hold no tensor (``return_dict=True``) are fixed in the graph and
    recorded in its guards; tensors that reach it (the Trainer's ``num_items_in_batch``) are captured as
    keyword inputs of their own, with their dimensions dynamic like the others. Mappings torch's pytree does not
    know (``BatchEncoding``) are taken as dicts.
    """
    if not isinstance(model, nn.Module):
        raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}; pass the module object "
                         "itself (torch.load a saved module first; for an .onnx file use amppass.convert_onnx)")
    example_inputs, example_kwargs = plain_inputs(example_inputs), plain_inputs(example_kwargs)
    if isinstance(example_inputs, dict):
        raise InputError("example_inputs is a dict; pass positional inputs as a tuple, e.g. example_inputs=(x,), "
                         "and keyword inputs as example_kwargs={'name': tensor}")
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise InputError(f"example_kwargs must be a dict of keyword inputs, got {type(example_kwargs).__name__}; "
                         "e.g. example_kwargs={'attention_mask': mask}")
    if example_inputs is None and example_kwargs is None:
        with capturing(model, train):
            return _symbolic(model)
    args = example_inputs if isinstance(example_inputs, tuple) else (
        () if example_inputs is None
        else (tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,))
    )
    kwargs = dict(example_kwargs or {})
    with capturing(model, train):
        return _export(model, args, kwargs, dynamic_shapes, note_fixed_dims, static_image_sizes)


def _symbolic(model: nn.Module) -> fx.GraphModule:
    try:
        with quiet_torch():
            traced = fx.symbolic_trace(model)
    except Exception as err:
        raise CaptureError(
            f"torch.fx.symbolic_trace could not trace {type(model).__name__}: {first_line(err, 300)}. "
            "Pass example_inputs so amppass captures it with torch.export instead, which follows "
            "data-dependent shapes the symbolic tracer cannot; or convert the submodules around the "
            "untraceable part separately."
        ) from err
    return shared_copy(traced)  # own module objects: replacing a weight never touches the caller's modules


def _export(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any, notes: bool,
            static_images: bool) -> fx.GraphModule:
    written = unreturned_write(model, args, kwargs)
    if written is not None:
        raise CaptureError(f"{written}. Call it without that input (use_cache=False), or make the model return "
                           "what it writes (a decoder: config.is_decoder=True)")
    fixed, named = _variadic_keywords(model, args, kwargs)
    whole, call = model, kwargs  # as the caller passed them, to run the model on if no capture works
    if fixed or named:
        model, kwargs = _with_named(model, fixed, named), {k: v for k, v in kwargs.items() if k not in fixed}
    # (dynamic_shapes, keep size-1 dimensions dynamic): the most general capture first
    why_static, kept = None, dict[str, str]()
    if dynamic_shapes != "auto":
        attempts = [(dynamic_shapes, False)]
    else:
        auto, why_static, kept = _auto_dims_and_why(model, args, kwargs, static_images)
        attempts = [(auto, True), (auto, False), (None, False)] if auto is not None else [(None, False)]
    last: Exception | None = None
    traced = model if fixed or named else private_copy(model)
    for shapes, oblivious in attempts:
        try:
            with size_one_dynamic(oblivious), quiet_torch(), functions_applied() as functions:
                program = torch.export.export(traced, args, kwargs, dynamic_shapes=shapes, strict=False)
        except Exception as err:  # noqa: BLE001 - retried with static shapes, then reported
            log.debug("torch.export with dynamic_shapes=%s (size-1 dims dynamic: %s) failed: %s", shapes, oblivious,
                      err)
            last = err
            continue
        gm = without_dtype_asserts(_with_guards_kept(program.module(), fixed))
        gm.meta[FUNCTIONS_KEY] = sorted(functions)
        if dynamic_shapes == "auto" and notes:
            _note_fixed_dims(gm, model, dynamic=shapes is not None,
                             why=why_static if last is None else first_line(last, 300), kept=kept)
        return gm
    check_example(whole, args, call)  # the example itself is wrong: say how, in the model's terms, not export's
    reason = first_line(last, 300)
    raise CaptureError(
        f"torch.export could not capture {type(model).__name__}: {reason}{'' if reason.endswith('.') else '.'} {_HINTS}"
    ) from last


def check_example(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """:class:`CaptureError` in the model's terms where ``model`` itself fails on the example
    (:func:`~amppass.fx.capture.guards.example_refusal`): what a capture says of a wrong example, also for a
    conversion that captures nothing. The model runs once, on a private copy, with the random number generators'
    state put back after (a dropout draw must not move the caller's training)."""
    with torch.random.fork_rng():
        refused = example_refusal(private_copy(model), args, kwargs)
    if refused is not None:
        raise CaptureError(refused[0]) from refused[1]


def capture_program(program: torch.export.ExportedProgram) -> fx.GraphModule:
    """The module of a program exported elsewhere (``torch.export.load``), prepared as :func:`capture` prepares
    its own captures."""
    return without_dtype_asserts(_with_guards_kept(program.module()))


def _with_guards_kept(gm: fx.GraphModule, fixed: dict[str, Any] | None = None) -> fx.GraphModule:
    """Keep export's guards as a :class:`ShapeGuards` in ``gm.meta``, with the keyword values the capture fixed.

    The module amppass returns checks them before each call, and converts again for a call they reject;
    torch's guard node stays in the graph until then, so calibration runs are checked too.
    """
    gm.meta[GUARDS_KEY] = ShapeGuards.of(gm, fixed)
    return gm


def _note_fixed_dims(gm: fx.GraphModule, model: nn.Module, dynamic: bool, why: str | None,
                     kept: dict[str, str]) -> None:
    """Say at conversion which input dimensions the graph fixed, and why, since other sizes mean a new plan.

    The spatial sizes :func:`_static_image_dims` kept static are said once, as information: they are the default,
    not a failure of the capture."""
    name = type(model).__name__
    if not dynamic:
        log.warning("%s: torch.export could not keep any input dimension dynamic (%s); the converted model is "
                    "captured and converted again for each new input shape", name, why or "no reason given")
        return
    for input_name, rank in kept.items():
        log.info("%s: %s's spatial sizes are kept at the example's (the input of a %s: dynamic image sizes cost "
                 "torch.export minutes of symbolic shape reasoning on windowed models); the first call at another "
                 "size is captured and converted again with them dynamic. Pass dynamic_shapes= to make them "
                 "dynamic from the start",
                 name, input_name, rank)
    fixed = specialised_dims(gm, model, kept=set(kept))
    if fixed:
        log.warning("%s: %s; a call with another size is captured and converted again for it",
                    name, "; ".join(fixed))


def _register_cache_types(model: nn.Module) -> None:
    """Let torch.export flatten transformers' cache objects (DynamicCache and friends) in inputs and outputs.

    A decoder with ``use_cache=True`` returns a cache object; export needs its type registered as a pytree
    node, and transformers ships the registration. Models without transformers are left alone.
    """
    import sys

    if "transformers" not in sys.modules:
        return
    try:
        from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model
    except ImportError:
        log.debug("this transformers has no cache pytree registration; cache outputs may not capture")
        return
    for module in model.modules():
        if type(module).__module__.startswith("transformers."):
            register_cache_pytrees_for_model(module)
            return


def without_dtype_asserts(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop export's ``_assert_tensor_metadata`` checks: they pin fp32 dtypes the plan is about to change."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


def auto_dims(model: nn.Module, args: tuple, kwargs: dict) -> Any:
    """Dim.AUTO for every dimension of every tensor input, keyed by forward()'s argument names; None where
    forward() does not name them."""
    return _auto_dims_and_why(model, args, kwargs)[0]


def _auto_dims_and_why(model: nn.Module, args: tuple, kwargs: dict,
                       static_images: bool = True) -> tuple[Any, str | None, dict[str, str]]:
    """:func:`auto_dims`, why it is None where it is, and the inputs whose spatial sizes it keeps static
    (:func:`_static_image_dims`, unless ``static_images`` is off)."""
    signature = inspect.signature(model.forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as err:  # export reports the mismatch in its own words
        return None, f"the example does not bind to forward{signature}: {err}", {}
    variadic = [name for name in bound.arguments
                if signature.parameters[name].kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if variadic:
        return None, (f"forward() takes tensor inputs through its variadic parameter {variadic[0]!r}, whose "
                      "dimensions torch.export cannot name; pass them by the names forward() declares"), {}
    auto = {name: _dims(value) for name, value in bound.arguments.items()}
    return auto, None, _static_image_dims(model, bound.arguments, auto) if static_images else {}


def _static_image_dims(model: nn.Module, inputs: dict[str, Any], auto: dict[str, Any]) -> dict[str, str]:
    """Keep the spatial dimensions of image and volume inputs static in ``auto`` (in place): the floating tensors
    of rank N+2 among ``inputs`` in a model holding an N-d convolution (N = 2 or 3). Only their batch dimension
    stays dynamic; returns the inputs so changed, each with the convolution that set it.

    A dynamic height, width or depth is what costs torch.export its time on such models: every window partition
    or patch merge over a symbolic size is a divisibility question for sympy (a 3D Swin segmentation net takes
    six times as long to convert as with them fixed), and a network called at one resolution gains nothing by
    it. The first call at another resolution is captured again with them dynamic (:func:`capture`'s
    ``static_image_sizes``), once; ``dynamic_shapes=`` asks for dynamic sizes from the start. Sequence models
    (rank-3 inputs of a Conv1d, token ids) are left dynamic.
    """
    ranks = {len(m.kernel_size): type(m).__name__ for m in model.modules()
             if isinstance(m, nn.modules.conv._ConvNd) and len(m.kernel_size) in (2, 3)}
    kept = {name: ranks[value.ndim - 2] for name, value in inputs.items()
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.ndim - 2 in ranks}
    for name in kept:
        auto[name] = {0: Dim.AUTO}
    return kept


def _variadic_keywords(model: nn.Module, args: tuple, kwargs: dict) -> tuple[dict[str, Any], list[str]]:
    """The keyword inputs that reach forward()'s ``**kwargs``: ``(fixed, named)``.

    ``fixed``: those that hold no tensor (``return_dict=True``), fixed in the captured graph (a call with another
    value is another plan, :mod:`amppass.serving.serving_graph`). ``named``: those that hold tensors (the
    Trainer's ``num_items_in_batch``), which the capture takes as keyword parameters of their own
    (:func:`_with_named`). torch.export's non-strict trace lays out a call with values in ``**kwargs`` otherwise
    than the ``dynamic_shapes`` that mirror it (the variadic parameter's dict), so such a call could keep no
    dimension dynamic, and every sequence length of a padded batch would be a plan of its own."""
    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {}, []
    extra = next((bound.arguments[name] for name, p in signature.parameters.items()
                  if p.kind is inspect.Parameter.VAR_KEYWORD and name in bound.arguments), {})
    holds_tensor = {k: any(isinstance(leaf, torch.Tensor) for leaf in torch.utils._pytree.tree_leaves(v))
                    for k, v in extra.items()}
    return {k: v for k, v in extra.items() if not holds_tensor[k]}, [k for k in extra if holds_tensor[k]]


def _with_named(model: nn.Module, fixed: dict[str, Any], named: list[str]) -> nn.Module:
    """A copy of ``model`` (own module objects, the same tensors) whose forward has ``fixed`` bound and takes the
    tensor inputs ``named`` as keyword parameters of their own in place of its ``**kwargs`` (they still reach the
    model's code through it), so that ``dynamic_shapes`` can name every input (:func:`_variadic_keywords`)."""
    bound = shared_copy(model)
    forward = functools.partial(type(model).forward.__get__(bound), **fixed)
    signature = inspect.signature(model.forward)
    kept = [p for p in signature.parameters.values() if p.name not in fixed and p.kind is not p.VAR_KEYWORD]
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY) for name in named]
    forward.__signature__ = signature.replace(parameters=kept + added)
    bound.forward = forward  # an instance attribute: nn.Module.__call__ and torch.export read it
    return bound


def _dims(value: Any) -> Any:
    """The dynamic_shapes entry of one input: export wants a registered pytree node (a cache object) as
    the list of its flattened children's entries, and containers as the same container."""
    if isinstance(value, torch.Tensor):
        return {i: Dim.AUTO for i in range(value.ndim)}
    if type(value) in (list, tuple):
        return type(value)(_dims(v) for v in value)
    if type(value) is dict:
        return {k: _dims(v) for k, v in value.items()}
    node = torch.utils._pytree.SUPPORTED_NODES.get(type(value))
    if node is not None:
        return [_dims(child) for child in node.flatten_fn(value)[0]]
    return None


@contextlib.contextmanager
def size_one_dynamic(enabled: bool) -> Iterator[None]:
    """Let a batch of 1 in the example stay dynamic instead of being baked into the graph.

    Fails where a size-1 dimension broadcasts; the caller then retries without it.
    """
    config = torch.fx.experimental._config
    with config.patch(backed_size_oblivious=enabled):
        yield
