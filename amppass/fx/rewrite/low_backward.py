"""State in a converted train graph where its backward pass runs in low precision.

Autograd differentiates the rewritten graph as it is: the backward of an op that runs in fp16/bf16 takes and
produces fp16/bf16 gradients; the backward of an fp32 op runs in fp32; the backward of each inserted cast
casts the gradient back, so the fp32 master parameters receive fp32 gradients. An fp32-accumulating op
(softmax with ``dtype=torch.float32`` on a low input) computes its backward in fp32 and hands its input a
low-precision gradient.

What the forward pass saves for backward is the plan's memory cost in training: an op run low saves its
inputs low, an op kept fp32 saves fp32 tensors (its reason says why). :func:`record_saved_bytes` measures it
per node on the example inputs, for the report.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from ...analysis.record import META_KEY
from ...dtypes import short_name

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


class _SavedByNode(fx.Interpreter):
    """Runs a graph once and records, per node, the bytes autograd saved for backward while it ran."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.saved: dict[str, dict[str, int]] = {}
        self._seen: set[int] = set()

    def run_node(self, node: fx.Node) -> Any:
        found: dict[str, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self._seen:  # a tensor saved by two ops is held once
                self._seen.add(storage.data_ptr())
                dtype = short_name(tensor.dtype)
                found[dtype] = found.get(dtype, 0) + storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            result = super().run_node(node)
        if found:
            self.saved[node.name] = found
        return result


def record_saved_bytes(gm: fx.GraphModule, flat_inputs: list[Any]) -> dict[str, Any]:
    """Run the train graph ``gm`` once on ``flat_inputs`` and record what it saves for backward.

    Each planned node gets ``evidence["saved_bytes"]`` (bytes of the tensors autograd saved while it ran,
    each storage counted once, at the first node that saved it); ``gm.meta["amppass"]["backward"]`` gets the
    total and its split by dtype. The run changes nothing: buffers updated in place (batch norm's running
    statistics) are restored, and the random number generator state is forked.
    """
    buffers = [(b, b.clone()) for b in gm.buffers()]
    recorder = _SavedByNode(gm)
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        recorder.run(*flat_inputs, enable_io_processing=False)
    with torch.no_grad():
        for buffer, before in buffers:
            buffer.copy_(before)
    by_dtype: dict[str, int] = {}
    for node in gm.graph.nodes:
        saved = recorder.saved.get(node.name)
        if not saved:
            continue
        for dtype, size in saved.items():
            by_dtype[dtype] = by_dtype.get(dtype, 0) + size
        meta = node.meta.get(META_KEY)
        if meta and "evidence" in meta:
            meta["evidence"]["saved_bytes"] = sum(saved.values())
            meta["evidence"]["saved_dtypes"] = sorted(saved)
    summary = {"saved_bytes": sum(by_dtype.values()), "saved_bytes_by_dtype": by_dtype,
               "saved_measured_on": "the example inputs, one forward in train mode"}
    gm.meta[META_KEY].setdefault("backward", {}).update(summary)
    return summary
