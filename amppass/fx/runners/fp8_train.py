"""Which matrix products of a bf16 train graph run in fp8 (``convert(..., mode="train", dtype="fp8")``), then lowered.

Training keeps inference's per-node rule (:mod:`amppass.fx.runners.fp8`) where it applies, and says why each
product is or is not fp8:

1. **Structure**, as for inference: only a product the bf16 plan runs low, with a stored weight, whose sizes are
   multiples of 16, can be fp8; convolutions and attention stay bf16 with inference's reasons. Training lowers
   ``addmm``/``mm`` with a stored weight too (transformers' ``Conv1D``, GPT-2's every product): the op reads the
   weight transposed, and its gradient comes back through the transpose.
2. **Range**: a weight whose own e4m3 error at conversion is beyond
   :data:`~amppass.fx.runners.fp8.RANGE_LIMIT` stays bf16 (inference's rule without calibration). Calibration is
   not read for fp8 in training: scales follow the tensors as they train (dynamic), none is fixed at conversion.
3. **Ends**: the graph's first and last fp8 candidates stay bf16, as fp8 training recipes keep them: the first
   reads the embeddings or the raw input, the last writes the logits the loss reads, and their errors are not
   averaged by any later product.

The chosen products become ``amppass::fp8_train_linear`` (:mod:`amppass.fx.rewrite.fp8_train`): e4m3 forward
operands, e5m2 gradients, fp32 master weights; input and gradient scales from each call's own ranges by default
(``recipe="dynamic"``: no state for the module tree, checkpoints and FSDP2 to carry; delayed scaling trained the
character GPT of benchmarks/fp8_train.py to a final loss within the run's noise of dynamic's, docs/fp8.md), or from
amax histories of the last :data:`~amppass.fx.rewrite.fp8_train.HISTORY` calls (``recipe="delayed"``, buffers of
the converted model). No loss scaling is needed: each gradient product
scales ``dY`` by its own largest magnitude into e5m2's range; the summary's ``loss_scaling`` says so.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import fx

from ...analysis.record import META_KEY, fp8_record, stored_fp8_products
from ...dtypes import E4M3, E5M2
from ..rewrite.fp8 import TENSOR, linear_weights, mark
from ..rewrite.fp8_train import HISTORY, lower_train
from .fp8 import RANGE_LIMIT, _rounding_error, _structure

log = logging.getLogger(__name__)

LOSS_SCALING = ("not needed: every gradient product scales the output's gradient by its own largest magnitude into "
                "e5m2's range (up to 57344), so no LossScaler is needed; one may still wrap the loop (it never skips)")
_WEIGHTS_THEN = "weights: from the fp32 master weight on every call; inputs (e4m3) and output gradients (e5m2): "
SCALES = {"dynamic": _WEIGHTS_THEN + "dynamic, from each call's own largest magnitude",
          "delayed": _WEIGHTS_THEN + f"delayed, from the largest of an amax history of the last {HISTORY} training "
                                     "calls (the call's own while it is empty), buffers in the model's state_dict"}
EVIDENCE = {"dynamic": "dynamic", "delayed": f"delayed (amax history of {HISTORY})"}
RANGES = {"dynamic": "from their own range on every call",  # the reason's words for the input's and gradient's scales
          "delayed": f"from the largest of their last {HISTORY} ranges in training"}


def plan_fp8_train(gm: fx.GraphModule, recipe: str = "dynamic", record: bool = True) -> dict[str, Any]:
    """Choose the products of ``gm`` (a train or eval graph rewritten for bf16 in place) that train in fp8 (module
    docstring), lower them with ``recipe``'s scales (``record``: the train graph, which records delayed scaling's
    ranges), record every product's outcome on its node; the summary for the model's record."""
    why_not: dict[str, str] = {}
    candidates: list[str] = []
    errors: dict[str, float] = {}
    weights = linear_weights(gm)  # the fp32 masters the train rewrite's casts read
    for node in gm.graph.nodes:
        why = _structure(node, gm, weights)
        if why is None:
            continue
        if why:
            why_not[node.name] = why
            continue
        errors[node.name] = _rounding_error(weights[node.name], TENSOR)
        if errors[node.name] > RANGE_LIMIT:
            why_not[node.name] = (f"stays bf16: its weight's own e4m3 error at conversion is "
                                  f"{errors[node.name]:.3g}, beyond {RANGE_LIMIT:g} (twice e4m3's largest rounding "
                                  "error of one value): one per-tensor scale leaves its small values to e4m3's "
                                  "subnormals or zero")
            continue
        candidates.append(node.name)
    ends = {candidates[0]: "first", candidates[-1]: "last"} if len(candidates) > 1 else {}
    for name, end in ends.items():
        why_not[name] = (f"stays bf16: the graph's {end} fp8-capable product ("
                         + ("it reads the embeddings or the raw input" if end == "first" else
                            "it writes the logits the loss reads") +
                         "); fp8 training keeps the first and last products in higher precision")
    chosen = [name for name in candidates if name not in ends]
    lower_train(gm, set(chosen), recipe, record)
    for name in chosen:
        mark(gm, name, {"format": E4M3.name, "gradient_format": E5M2.name, "weight_scale": "per call",
                        "input_scale": EVIDENCE[recipe], "gradient_scale": EVIDENCE[recipe], "recipe": recipe,
                        "weight_error": errors[name], "output": "bf16", "kernel": "torch._scaled_mm"},
             "fp8 training: e4m3 input and weight, e5m2 output gradient, per-tensor scales (weight's from the fp32 "
             f"master weight on every call, input's and gradient's {RANGES[recipe]}), fp32 "
             "accumulation, bf16 output, fp32 weight gradient")
    for name, why in why_not.items():
        mark(gm, name, {"why_not": why}, why)
    decisions = (node.meta.get(META_KEY) for node in gm.graph.nodes)
    info = fp8_record(E4M3.name, "bf16", stored_fp8_products(decisions, "bf16"), gradient_format=E5M2.name,
                      scales=SCALES[recipe], recipe=recipe,
                      **({"history": HISTORY} if recipe == "delayed" else {}), loss_scaling=LOSS_SCALING,
                      range_limit=RANGE_LIMIT)
    log.info("fp8 training: %d of %d products in %s forward, %s gradients; loss scaling %s", len(chosen),
             len(chosen) + len(why_not), E4M3.name, E5M2.name, LOSS_SCALING)
    return info
