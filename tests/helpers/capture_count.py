"""Counting the captures amppass makes while converting (the first conversion's, and any made again later)."""

from __future__ import annotations

import pytest

from amppass.pipelines import convert as convert_module


def counted_captures(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The ``train`` flag of every capture made from now on (a train-mode conversion captures once with
    ``train=True`` and once with ``train=False``); the list grows as captures are made."""
    made: list[bool] = []
    real = convert_module.capture

    def counting(*args, **kwargs):
        made.append(kwargs.get("train", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(convert_module, "capture", counting)
    return made
