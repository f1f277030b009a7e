"""How much of a node's rounding reaches the model's outputs: linearised propagation of relative error.

A node rounded to low precision changes its output by some relative error (its local error). Downstream,
most ops pass a relative error on at about its size: a matrix product or convolution of a perturbed input,
an activation function, a reshape, a normalisation. Additions do not: a branch added to a residual stream
ten times its size reaches the sum at a tenth of its relative error, and a part of a concatenation at its
share of the whole. So a node's *gain* is the product, along its path to an output, of the norm ratio
``||input|| / ||result||`` at each addition or concatenation (the policy facts "addition" and "join"),
and the largest over its paths; ``local error * gain`` estimates its relative effect on the output.

Norms come from one calibration batch. Ops that amplify (a sigmoid of 50x, an exponential) or attenuate
otherwise are not modelled here: the tolerance search measures regions of the graph for that
(:func:`amppass.analysis.tolerance.by_region_effect`).
"""

from __future__ import annotations

from typing import Mapping

from .policy import ADDITION, JOIN
from .view import GraphView, OpView


def gains(view: GraphView, norms: Mapping[str, float]) -> dict[str, float]:
    """Node name -> the share of a relative error in its output that reaches the outputs of ``view``.

    ``norms`` holds the L2 norm of values on one batch; a value without one passes errors on unchanged.
    A node none of whose outputs reaches a graph output (through float edges) gets 0.
    """
    reach = {value: 1.0 for value in view.outputs}  # value -> its gain
    found: dict[str, float] = {}
    for node in reversed(view.nodes):  # every reader of a value comes before its producer
        gain = max((reach.get(v, 0.0) for v in node.outputs), default=0.0)
        found[node.name] = gain
        for value in node.inputs:
            reach[value] = max(reach.get(value, 0.0), gain * _share(node, value, norms))
    return found


def _share(node: OpView, value: str, norms: Mapping[str, float]) -> float:
    """The factor a relative error in input ``value`` of ``node`` is scaled by in its output."""
    if not ({ADDITION, JOIN} & node.facts) or not node.outputs:
        return 1.0
    whole, part = norms.get(node.outputs[0]), norms.get(value)
    if whole is None or part is None or whole <= 0:
        return 1.0
    return part / whole
