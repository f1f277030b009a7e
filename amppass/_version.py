"""amppass's version: one string, read by the package, the stored record of every conversion, the CLI and the build."""

__version__ = "0.1.0"
