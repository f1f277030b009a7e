"""The per-node precision report, rebuilt from a converted model alone."""
