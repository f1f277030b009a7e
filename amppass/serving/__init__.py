"""The modules ``amppass.convert`` returns and what they do when called: the per-shape plans
(:class:`~amppass.serving.serving_graph.ServingGraph`), the fp32 face, the kept original, the train/eval
graphs and their module tree, and ``generate()`` for transformers decoders."""
