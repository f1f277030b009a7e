"""Helpers the tests share, and the benchmarks with them: load on the machine, timing caches, output errors."""
