"""Unscale an optimizer's gradients, look for inf/NaN in them, and agree on the finding across ranks.

One fused kernel per (device, dtype) divides the gradients by the scale and raises a flag on inf/NaN
(``torch._amp_foreach_non_finite_check_and_unscale_``, as ``torch.amp.GradScaler`` does). Whether the ranks of a
distributed run must then agree on the flag depends on whether their gradients can differ:

1. DistributedDataParallel all-reduces the gradients before the step, and an inf or NaN on one rank spreads to
   every rank's sum, so each rank finds the same flag on its own: no collective (GradScaler's behaviour).
2. Sharded DTensor gradients (FSDP2's ``fully_shard``, tensor parallelism) hold a different piece on each rank,
   so the flag is all-reduced (MAX) over the process group of each sharded dimension of their device mesh.
   Every rank of a mesh takes part in its backward's collectives, so this cannot wait on a rank that is absent.
3. An explicit ``process_group`` (ZeRO-style sharding of plain tensors, gradients edited per rank after DDP's
   all-reduce) all-reduces the flag over that group every step; every rank in it must call the scaler.

The check runs on each DTensor's local shard, so there is one all-reduce per group per optimizer step, however
many parameter groups, dtypes or devices the gradients span (DTensor's own handler of the kernel would issue
one per (device, dtype) batch).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ScalerUsageError, ScalerValueError

__all__ = ["unscale_and_check"]


def unscale_and_check(
    optimizer: torch.optim.Optimizer,
    inv_scale: torch.Tensor,
    allow_fp16: bool,
    process_group: Any = None,
) -> torch.Tensor:
    """Multiply ``optimizer``'s gradients by ``inv_scale`` in place; return 1.0 if any rank saw inf/NaN, else 0.0.

    The flag is a float32 scalar on ``inv_scale``'s device. ``process_group`` None agrees only over the groups
    sharded DTensor gradients name (rule 2 of the module docstring); a group agrees over that group (rule 3).
    """
    grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    sharded_over: dict[str, Any] = {}  # the groups sharded gradients must agree over, by name
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if grad.dtype == torch.float16 and not allow_fp16:
                raise ScalerValueError(
                    "unscale_() found an fp16 gradient; unscaling it in fp16 underflows again. Keep fp32 "
                    "master parameters and cast them to fp16 inside the forward (amppass.convert(..., "
                    "mode='train') does)"
                )
            if _is_dtensor(grad):
                sharded_over.update(_sharded_groups(grad))
                with torch.no_grad():
                    grad = grad.to_local()  # the shard itself: unscaled in place, no collective per batch
            if grad.is_sparse:
                if grad.dtype == torch.float16:
                    # Duplicate indices are summed later, and fp16 sums can overflow: check the sums.
                    grad = param.grad = grad.coalesce()
                grad = grad._values()
            grads[(grad.device, grad.dtype)].append(grad)
    if not grads:
        raise ScalerUsageError(
            "none of the optimizer's parameters has a gradient; call scaler.scale(loss).backward() "
            "before scaler.unscale_(optimizer) or scaler.step(optimizer)"
        )

    flags: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for (device, _), tensors in grads.items():
            flag = flags.setdefault(device, torch.zeros((), dtype=torch.float32, device=device))
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, inv_scale.to(device))
    found_inf = torch.zeros((), dtype=torch.float32, device=inv_scale.device)
    for flag in flags.values():
        # max, not sum: fused optimizers subtract the flag from their step counters, so it must stay 0 or 1.
        found_inf = torch.maximum(found_inf, flag.to(found_inf.device, non_blocking=True))

    if process_group is not None:
        if not dist.is_initialized():
            raise ScalerUsageError(
                "LossScaler(process_group=...) was given a group, but torch.distributed is not initialized "
                "in this process; call torch.distributed.init_process_group first, or drop process_group"
            )
        groups = [process_group]
    else:
        groups = list(sharded_over.values())
    for group in groups:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    return found_inf


def _is_dtensor(tensor: torch.Tensor) -> bool:
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _sharded_groups(grad: Any) -> dict[str, Any]:
    """The process groups of the mesh dimensions over which ``grad`` is not replicated, by group name."""
    mesh = grad.device_mesh
    groups = (mesh.get_group(dim) for dim, placement in enumerate(grad.placements) if not placement.is_replicate())
    return {group.group_name: group for group in groups}
