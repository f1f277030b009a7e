"""Applying a plan to an FX graph: casts on edges, weights converted once, device literals, what the backward keeps."""
