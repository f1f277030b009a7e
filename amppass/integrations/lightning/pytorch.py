"""amppass's Lightning plugin for the unified ``lightning`` package: ``L.Trainer(plugins=[AmpPassPrecision("fp16")])``.

::

    import lightning as L
    from amppass.integrations.lightning.pytorch import AmpPassPrecision

    trainer = L.Trainer(plugins=[AmpPassPrecision("fp16")], gradient_clip_val=1.0)   # no precision= flag

The plugin of :mod:`amppass.integrations.lightning` (its docstring says what it does), built on
``lightning.pytorch``'s ``Precision``: the class ``lightning.Trainer`` accepts. Imports ``lightning``, never
``pytorch_lightning``.
"""

from __future__ import annotations

from . import plugin_class

__all__ = ["AmpPassPrecision"]

AmpPassPrecision = plugin_class("lightning.pytorch")
