"""The checkout's root, for tests at any depth of the tests/ tree and the benchmarks' own tests."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
