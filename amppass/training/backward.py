"""State in a converted train graph where its backward pass runs in low precision.

Autograd differentiates the rewritten graph as it is: the backward of an op that runs in fp16/bf16 takes and
produces fp16/bf16 gradients; the backward of an fp32 op runs in fp32; the backward of each inserted cast
casts the gradient back, so the fp32 master parameters receive fp32 gradients. An fp32-accumulating op
(softmax with ``dtype=torch.float32`` on a low input) computes its backward in fp32 and hands its input a
low-precision gradient.
"""

from __future__ import annotations

from torch import fx

from ..fx.rewrite import META_KEY

_BACKWARD = {"low": None, "fp32": "fp32", "fp32-accumulate": "fp32"}


def annotate_backward(gm: fx.GraphModule, low_name: str) -> dict[str, object]:
    """Add ``evidence["backward"]`` (the dtype its gradient runs in) to every planned node of ``gm``.

    Returns the summary stored in ``gm.meta["amppass"]["backward"]``: how many planned ops run their
    backward in low precision and in fp32, the low ones' op names, and a sentence saying what that means.
    """
    low_ops: dict[str, int] = {}
    fp32 = 0
    for node in gm.graph.nodes:
        meta = node.meta.get(META_KEY)
        if not meta or meta.get("cast") or meta["precision"] not in _BACKWARD:
            continue
        backward = _BACKWARD[meta["precision"]] or low_name
        meta["evidence"]["backward"] = backward
        if backward == low_name:
            low_ops[meta["op"]] = low_ops.get(meta["op"], 0) + 1
        else:
            fp32 += 1
    return {
        "low_ops": sum(low_ops.values()),
        "fp32_ops": fp32,
        "ops_with_low_backward": sorted(low_ops),
        "statement": (
            f"the backward of every op run in {low_name} runs in {low_name} "
            f"({', '.join(sorted(low_ops)) or 'none'}); fp32 ops differentiate in fp32; the casts of the fp32 "
            "master parameters return fp32 gradients to them"
        ),
    }
