"""The captured graph computes what the model computes: one fp32 call of each on the example, compared.

torch.export runs the model's Python once, and a model can see that it is being traced
(``torch.compiler.is_exporting()``, transformers' ``is_torchdynamo_exporting()`` in its mask code) and take
another path there. Where that path answers otherwise, every output of the converted model is wrong before any
low-precision rounding: PaliGemma's base model, captured by torch.export, gives hidden states 0.1 (relative)
from its own on a plain prompt, in fp32. A conversion of that graph can only carry the error on, so the
conversion refuses it, naming the output.

Rules:

1. With an example call, in inference, the model (in eval mode, without grad) and the captured fp32 graph run it
   once each; each floating output leaf is compared by relative L2 error. Past :data:`LIMIT` the capture is
   refused with a CaptureError naming the output and the error. fp32 kernels of the two differ by rounding only
   (about 1e-6), far below the limit.
2. A model whose own two calls differ by more than a tenth of the limit (a counter it reads) is not judged.
3. Not judged either: a graph that writes into its inputs (the check must not change the caller's tensors), a
   graph that draws random numbers (its draws are its own), and outputs whose leaves do not pair up. The
   model's buffers are put back as they were after the calls.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ...errors import CaptureError, first_line
from ..arguments import argument
from ..prepare.aliasing import writes_an_input
from .copies import private_copy
from .inputs import flatten_inputs
from .modes import module_mode

log = logging.getLogger(__name__)

LIMIT = 1e-3  # relative L2 error of an fp32 output: far past fp32 rounding, far below a different computation


def check_fidelity(model: nn.Module, gm: fx.GraphModule, args: tuple, kwargs: dict) -> None:
    """Rules 1-3: raise CaptureError where the captured graph's fp32 outputs are not the model's on the example."""
    if writes_an_input(gm) or _draws_random(gm):
        return
    with _buffers_kept(model):  # the graph shares them with the model, and may write them as it does
        try:
            flat = flatten_inputs(gm, args, kwargs, index=0)
            wanted = _call_model(model, args, kwargs)
            with torch.no_grad():
                got = pytree.tree_leaves(fx.Interpreter(gm).run(*flat, enable_io_processing=False))
        except Exception as err:  # noqa: BLE001 - a call that fails here fails later with its own error, or never runs
            log.info("the capture's fidelity was not checked: the example call failed (%s)", first_line(err, 200))
            return
        worst = _worst(got, wanted) if len(got) == len(wanted) else None
        if worst is None or worst[1] <= LIMIT:
            return
        noise = _worst(_call_model(model, args, kwargs), wanted)
    if noise is not None and noise[1] > LIMIT / 10:
        log.info("the capture's fidelity was not checked: %s gives other outputs on each call (%.3g apart)",
                 type(model).__name__, noise[1])
        return
    index, error = worst
    name = type(model).__name__
    raise CaptureError(
        f"torch.export's graph of {name} does not compute what {name} computes: on the example, output {index} "
        f"(of {len(wanted)} tensors) differs from the model's by {error:.3g} (relative L2) in fp32, before any "
        f"conversion. The model takes another path while it is traced (transformers' mask code checks "
        f"is_torchdynamo_exporting(), for one), and a conversion of that graph would carry its answer. Run the "
        f"model under torch.autocast instead, or change the traced path in the model so torch.export's graph "
        f"agrees with it (torch.export.export(model, args).module() shows the difference without amppass)"
    )


def _draws_random(gm: fx.GraphModule) -> bool:
    """Whether the graph draws random numbers (``randn``, ``bernoulli``, dropout in training...): its draws are its
    own, and a model that seeds the generator in its forward reseeds eager calls only (torch.export keeps no
    ``manual_seed``). An op tagged random that draws nothing here (attention or dropout with probability 0, a
    dropout not training) does not count."""
    return any(n.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())
               and not _draws_nothing(n) for n in gm.graph.nodes)


def _draws_nothing(node: fx.Node) -> bool:
    """Whether a random op's arguments make it deterministic: a dropout probability of 0, or ``train=False``."""
    if argument(node, "train") is False:
        return True
    probability = argument(node, "dropout_p")
    probability = argument(node, "p") if probability is None else probability
    return isinstance(probability, (int, float)) and probability == 0


def _call_model(model: nn.Module, args: tuple, kwargs: dict) -> list:
    """The model's output leaves on the example, in eval mode without grad, called with containers of its own (a
    model that writes its output into its input dict, as sentence-transformers' modules do, writes there), on a
    private copy of the model (what its code caches on itself stays off the caller's model)."""
    args, kwargs = pytree.tree_map(lambda leaf: leaf, (args, kwargs))
    with torch.no_grad(), module_mode(model, False):
        return pytree.tree_leaves(private_copy(model)(*args, **kwargs))


@contextlib.contextmanager
def _buffers_kept(model: nn.Module) -> Iterator[None]:
    """The model's buffers put back as they were on the way out (a counter, a cache a call advances)."""
    saved = {name: buffer.clone() for name, buffer in model.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name in saved and buffer.shape == saved[name].shape:
                    buffer.copy_(saved[name])


def _worst(got: list, wanted: list) -> tuple[int, float] | None:
    """(index, relative L2 error) of the floating output pair that differs most; None where none pairs up."""
    worst: tuple[int, float] | None = None
    for index, (a, b) in enumerate(zip(got, wanted, strict=False)):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or not b.is_floating_point() or \
                a.shape != b.shape or b.numel() == 0:
            continue
        a, b = a.detach().double(), b.detach().double()
        finite = torch.isfinite(b)
        if not bool(torch.isfinite(a)[finite].all()):
            error = float("inf")
        else:
            scale = float(b[finite].norm())
            error = float((a - b)[finite].norm()) / scale if scale > 0 else float((a - b)[finite].norm())
        if worst is None or error > worst[1]:
            worst = (index, error)
    return worst
