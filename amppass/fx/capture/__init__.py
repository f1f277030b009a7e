"""Capturing a module as a graph: torch.export and symbolic tracing, the graphs torch.compile hands its backend,
the guards of what a capture takes, and the checks that the graph is the model (fidelity, writes into inputs, a
Function's own backward)."""
