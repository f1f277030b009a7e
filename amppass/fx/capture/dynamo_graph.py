"""The graph ``torch.compile`` hands a backend, made into a graph amppass plans, and a planned graph made into
one inductor compiles.

Dynamo's graph takes the model's parameters and buffers as inputs and keeps other tensors as attributes;
its example values are fake tensors whose sizes are symbols of dynamo's shape environment. The steps, in the
order :mod:`amppass.pipelines.backend` takes them (its module docstring numbers the rules named here):

1. :func:`state_inputs` finds the inputs that are module state, by the source dynamo records for each.
2. :func:`refuse_own_backward` (training) refuses a graph that applies a ``torch.autograd.Function``.
3. :func:`trace_aten` traces the graph to ATen ops in dynamo's fake mode, its attributes as extra inputs,
   and cleans the constants the trace made so inductor can take them.
4. :func:`lift_state` turns the state inputs, and the attributes the trace took as inputs, back into
   attributes of one module.
5. :func:`views_as_reshapes` hands inductor a copy of the planned graph whose views are reshapes.

:func:`fake_mode` and :func:`symbol_ranges` read dynamo's fake mode and the value ranges of its symbols.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import torch
from torch import fx, nn

from ...errors import CaptureError, first_line
from .guards import range_bound
from .quiet import quiet_torch

# dynamo's source of a module's tensor: L['self']._modules['a']._parameters['w'], or through __dict__ where the
# model reads it so: ...__dict__['_modules']['a']...__dict__['_parameters']['w']
_STATE_SOURCE = re.compile(r"(?:\._|\.__dict__\['_)(parameters|buffers)(?:'\])?\['([^']+)'\]$")
_MODULE_STEP = re.compile(r"(?:\._modules|\.__dict__\['_modules'\])\['([^']+)'\]")


def state_inputs(placeholders: list[fx.Node], example_inputs: list[Any]) -> dict[int, str]:
    """Positions of the inputs that are the model's parameters and buffers, with their qualified names."""
    state = {}
    for position, node in enumerate(placeholders):
        grapharg = node.meta.get("grapharg")
        source = getattr(getattr(grapharg, "source", None), "name", "") or ""
        found = _STATE_SOURCE.search(source)
        if found is None and not isinstance(example_inputs[position], nn.Parameter):
            continue
        if found is not None:
            path = _MODULE_STEP.findall(source) + [found.group(2)]
            name = ".".join(path)
        else:
            name = node.name
        state[position] = re.sub(r"[^\w.]", "_", name)
    return state


def trace_aten(gm: fx.GraphModule, fakes: list[Any], index: int) -> fx.GraphModule:
    """Dynamo's graph as ATen ops (the operator set torch.export gives), traced over dynamo's own fake inputs.

    The trace runs in dynamo's fake mode, so the sizes dynamo made dynamic stay the same symbols (the backend's rule 3)
    and any guard the trace needs joins dynamo's. It records ops before autograd's decompositions, except in
    a graph that runs a ``vmap`` (:func:`_vmaps`). Tensors dynamo kept as attributes of its graph are inputs
    of the trace, so the graph becomes one function of tensors; :func:`lift_state` makes them attributes again.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = fake_mode(fakes)
    if mode is None:
        raise CaptureError(f"graph {index} has no fake inputs from dynamo to trace it with")
    function, attributes = _attributes_as_inputs(gm)
    with mode:
        fake_attributes = [mode.from_tensor(t, static_shapes=True) for _, t in attributes]
    try:
        with mode, quiet_torch():
            traced = make_fx(function, pre_dispatch=not _vmaps(gm))(*fakes, *fake_attributes)
    except Exception as err:  # any tracing failure leaves this graph unconverted
        raise CaptureError(f"graph {index} could not be traced to ATen ops: {first_line(err)}"
                           ) from err
    _clean_constants(traced, index)
    traced.meta["attributes"] = attributes  # name, tensor of each input after dynamo's own
    return traced


def refuse_own_backward(gm: fx.GraphModule) -> None:
    """The backend's rule 6: a graph that applies a ``torch.autograd.Function`` is not converted for training."""
    for node in gm.graph.nodes:
        if node.target is torch.ops.higher_order.autograd_function_apply:
            trace = (node.meta.get("stack_trace") or "").strip().splitlines()
            where = f" at {trace[-2].strip()}" if len(trace) >= 2 else ""
            raise CaptureError(f"it applies a torch.autograd.Function{where}, whose own backward a trace to ATen ops "
                               "would replace by the derivative of its forward")


def _vmaps(gm: fx.GraphModule) -> bool:
    """Whether dynamo's graph runs a ``vmap`` as functorch's pre-dispatch calls (``_add_batch_dim``, ...): a trace
    at the pre-dispatch level runs those calls instead of recording them, and bakes their batched results into
    the graph as constants; traced below it, the vmap becomes the batched ATen ops it computes."""
    return any(n.op == "call_function" and getattr(n.target, "__module__", "") == "torch._functorch.predispatch"
               for n in gm.graph.nodes)


def _clean_constants(traced: fx.GraphModule, index: int) -> None:
    """The tensor constants the trace made, as inductor takes them.

    1. Work nothing reads goes (a trace can leave dead products of constants that are fake or batched tensors,
       which inductor cannot run); writes in place are kept (their schemas mark them impure).
    2. A 0-dim constant the model wrote as a Python number (``index[0, 0:] = n - 3``: ``fill_`` or ``copy_`` of
       ``lift_fresh_copy(tensor(n - 3))``) is made at run time by ``aten.scalar_tensor``: inductor's freezing
       folds a stored one into a constant its ``select_scatter`` cannot read.
    3. A constant still read that is not a plain tensor leaves the graph unconverted (a ``CaptureError``).
    """
    graph = traced.graph
    graph.eliminate_dead_code()
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.lift_fresh_copy.default:
            continue
        source = node.args[0]
        value = _fetch(traced, str(source.target)) if source.op == "get_attr" else None
        if isinstance(value, torch.Tensor) and value.dim() == 0 and _plain(value):
            with graph.inserting_before(node):
                made = graph.call_function(torch.ops.aten.scalar_tensor.default, (value.item(),),
                                           {"dtype": value.dtype, "device": value.device})
            made.meta = dict(node.meta)
            node.replace_all_uses_with(made)
            graph.erase_node(node)
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        if not node.users:
            graph.erase_node(node)
            continue
        value = _fetch(traced, str(node.target))
        if isinstance(value, torch.Tensor) and not _plain(value):
            raise CaptureError(f"graph {index}: the trace made constant {node.target!r}, read by "
                               f"{next(iter(node.users)).name}, of a vmap or fake tensor inductor cannot run")
    for name, _ in list(traced.named_buffers()) + list(traced.named_parameters()):
        if name.startswith("_tensor_constant") and not any(
            n.op == "get_attr" and n.target == name for n in graph.nodes
        ):
            delattr(traced, name)
    traced.recompile()


def _plain(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds real data: not a fake tensor, not wrapped by functorch (vmap, grad)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return not isinstance(tensor, FakeTensor) and not torch._C._functorch.is_functorch_wrapped_tensor(tensor)


def _attributes_as_inputs(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[tuple[str, torch.Tensor]]]:
    """A copy of ``gm`` whose tensor attributes are extra inputs, after dynamo's, and those attributes."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attributes: list[tuple[str, torch.Tensor]] = []
    reads = [n for n in gm.graph.nodes if n.op == "get_attr" and isinstance(_fetch(gm, str(n.target)), torch.Tensor)]
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.node_copy(node, lambda n: env[n])
    for node in reads:
        env[node] = graph.placeholder(f"attribute_{len(attributes)}")
        attributes.append((str(node.target), _fetch(gm, str(node.target))))
    for node in gm.graph.nodes:
        if node not in env:
            env[node] = graph.node_copy(node, lambda n: env[n])
    return fx.GraphModule(gm, graph), attributes


def lift_state(traced: fx.GraphModule, placeholders: list[fx.Node], example_inputs: list[Any],
          state: dict[int, str]) -> tuple[fx.GraphModule, list[int]]:
    """The backend's rule 1: state inputs become attributes of a module.

    ``traced`` takes dynamo's inputs, then the attributes of dynamo's graph. Returns the module and the
    positions of dynamo's inputs it takes: every input but state, sizes included (inductor reads a size
    from dynamo's own input; read from a tensor instead, its backward can hold sizes it cannot evaluate).
    """
    root = nn.Module()
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = [n for n in traced.graph.nodes if n.op == "placeholder"]
    users = [i for i in range(len(placeholders)) if i not in state]
    for i in users:
        env[inputs[i]] = graph.placeholder(placeholders[i].name)
        env[inputs[i]].meta = dict(inputs[i].meta)
    named = [(i, name, example_inputs[i]) for i, name in state.items()]
    named += [(len(placeholders) + k, name, tensor) for k, (name, tensor) in enumerate(traced.meta["attributes"])]
    for i, name, tensor in named:
        if _has(root, name) and _fetch(root, name) is not tensor:  # never two tensors under one name
            name = _unique(root, name)
        if not _has(root, name):
            _register(root, name, tensor)
        env[inputs[i]] = graph.get_attr(name)
        env[inputs[i]].meta = dict(inputs[i].meta)
    for node in traced.graph.nodes:
        if node.op == "get_attr":  # constants the trace made
            _register(root, str(node.target), _fetch(traced, str(node.target)))
        if node.op != "placeholder":
            env[node] = graph.node_copy(node, lambda n: env[n])
    return fx.GraphModule(root, graph), users


def _unique(root: nn.Module, name: str) -> str:
    """``name`` with a numbered last step that ``root`` does not hold yet."""
    number = 1
    while _has(root, f"{name}_{number}"):
        number += 1
    return f"{name}_{number}"


def _fetch(module: nn.Module, name: str) -> Any:
    for step in name.split("."):
        module = getattr(module, step)
    return module


def _has(module: nn.Module, name: str) -> bool:
    try:
        _fetch(module, name)
    except AttributeError:
        return False
    return True


def _register(root: nn.Module, name: str, tensor: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    owner = root
    for step in path:
        if not hasattr(owner, step):
            owner.add_module(step, nn.Module())
        owner = getattr(owner, step)
    if isinstance(tensor, nn.Parameter):
        owner.register_parameter(leaf, tensor)
    elif isinstance(tensor, torch.Tensor):
        owner.register_buffer(leaf, tensor)
    else:
        setattr(owner, leaf, tensor)


def fake_mode(fakes: list[Any]) -> Any:
    """The fake mode of dynamo's example values (its shape environment holds the symbols of their sizes)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return next((f.fake_mode for f in fakes if isinstance(f, FakeTensor)), None)


def symbol_ranges(fakes: list[Any]) -> dict[str, tuple[int, float]]:
    """The value ranges dynamo's shape environment knows for the symbols of these sizes."""
    mode = fake_mode(fakes)
    env = getattr(mode, "shape_env", None)
    if env is None:
        return {}
    return {str(symbol): (max(range_bound(r.lower), 0), range_bound(r.upper)) for symbol, r in env.var_to_range.items()}


def views_as_reshapes(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` whose views are reshapes, for inductor. Inductor traces the graph again with its own
    decompositions, where a view's input can come out with other strides than in the trace that recorded the
    view (a cat of permuted slices in GPT-NeoX-Japanese's rotary embedding: "Cannot view a tensor with shape
    [s52, 4, s27, 8] and strides (32*s27, 8, 32, 1)"); a reshape is that same view wherever one exists."""
    copied = copy.deepcopy(graph)
    for node in copied.nodes:
        if node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
    return copied
