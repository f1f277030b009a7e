"""amppass's Fabric plugin for the unified ``lightning`` package: ``L.Fabric(plugins=[AmpPassPrecision("fp16")])``.

::

    import lightning as L
    from amppass.integrations.lightning.fabric import AmpPassPrecision

    fabric = L.Fabric(accelerator="cpu", plugins=[AmpPassPrecision("fp16")])   # no precision= flag

The plugin of :mod:`amppass.integrations.fabric` (its docstring says how to train and checkpoint with it), built
on ``lightning.fabric``'s ``Precision``: the class ``lightning.Fabric`` accepts. Imports ``lightning``, never
``lightning_fabric``.
"""

from __future__ import annotations

from ..fabric import plugin_class

__all__ = ["AmpPassPrecision"]

AmpPassPrecision = plugin_class("lightning.fabric")
