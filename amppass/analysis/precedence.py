"""Which decision wins where several are made for one node: the whole order, highest first.

1. **Aliasing groups** (painting rule 9, :mod:`amppass.analysis.painting`): values that share storage with a value
   written in place run in one precision, fp32 where any member must for a reason of its own; such a group
   overrides even a user's ``force_low`` of one of its members, since a write through a cast copy never reaches the
   storage its readers read. So ``force_low`` means "low where correctness allows".
2. **The user's** ``keep_fp32`` and ``force_low`` (:mod:`amppass.analysis.overrides`): keeping fp32 wins over forcing
   low, and forcing low an op the target has no low kernel for keeps it fp32 with a warning.
3. **The finite check** (the conversion's own run of the example, :mod:`amppass.fx.runners.finite`): a node whose low
result
   goes inf or NaN where fp32's does not runs fp32, unless the user forced it low.
4. **Carried decisions**: the fp32 decisions calibration or the tolerance search made on the example's capture,
   carried by node name and op to a capture of other shapes (:mod:`amppass.fx.capture.guards`); ONNX's quantized (QDQ)
   nodes enter here.
5. **Profitability** (plan for speed, inference, torch): regions not faster in low precision on the target run fp32.
6. **Measured on this capture**: the range rules from calibration statistics (:mod:`amppass.analysis.rules`), then
   the tolerance search, which moves only nodes nothing above pinned.
7. **The policy table and painting** (:mod:`amppass.analysis.policy`, :mod:`amppass.analysis.painting`): what no
   level above decided.

Levels 1 and 7 are painting's own; :func:`pinned` merges levels 2 to 6 into the decisions painting starts from (the
calibration pipeline merges level 6 itself, under what it is given, the same way).
"""

from __future__ import annotations

from typing import Mapping

from .plan import Decision


def pinned(*, user: Mapping[str, Decision], finite: Mapping[str, Decision] | None = None,
           carried: Mapping[str, Decision] | None = None, profitability: Mapping[str, Decision] | None = None,
           measured: Mapping[str, Decision] | None = None) -> dict[str, Decision]:
    """The decisions painting keeps as they are (levels 2-6, module docstring), each node's from its highest level:
    ``user`` over ``finite`` over ``carried`` over ``profitability`` over ``measured``."""
    return {**(measured or {}), **(profitability or {}), **(carried or {}), **(finite or {}), **user}
