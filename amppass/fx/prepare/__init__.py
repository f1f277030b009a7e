"""Rewrites of a captured graph before it is planned: fused GELU, folded attention masks, aliasing groups of
in-place writes."""
