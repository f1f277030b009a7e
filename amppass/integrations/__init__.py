"""amppass in the tools people train with: one line each, the tool itself imported only by its own module.

============================  ==============================================================================
tool                          the one line
============================  ==============================================================================
Lightning ``Trainer``         ``Trainer(plugins=[amppass.integrations.lightning.AmpPassPrecision("fp16")])``;
                              with ``import lightning as L``: ``amppass.integrations.lightning.pytorch``
Lightning ``Fabric``          ``Fabric(plugins=[amppass.integrations.fabric.AmpPassPrecision("fp16")])``;
                              with ``import lightning as L``: ``amppass.integrations.lightning.fabric``
transformers ``Trainer``      ``amppass.integrations.transformers.AmpPassTrainer(..., amppass_dtype="fp16")``
accelerate                    ``model, optimizer = amppass.integrations.accelerate.prepare(accelerator, model,
                              optimizer, dtype="fp16")``
============================  ==============================================================================

Each converts the model at its first call, with that call's inputs as the example
(:mod:`amppass.integrations.routing`): a train-mode conversion (fp32 master weights, casts in the graph) that
reads and updates **the model's own parameters and buffers**, as the tool's own precision flag trains the model
you hand it. So the tool's optimizer, its checkpoints (the model's own state-dict keys), ``save_pretrained`` and
``LightningModule.load_from_checkpoint`` work unchanged, and the fp32 model you hold is the trained one. fp16
installs an :class:`amppass.LossScaler` where the tool keeps its scaler: gradients are unscaled before clipping,
steps with inf/NaN gradients are skipped, and the scaler's state goes into the tool's checkpoints. bf16 needs no
scaler. The tool's own autocast flag on top of a converted model is refused (Lightning and the transformers
``Trainer``) or warned about (accelerate): it would cast again what amppass planned.

``import amppass`` imports none of these tools; ``amppass.integrations.<tool>`` imports its tool.
"""
