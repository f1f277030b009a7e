"""torch's capture logs stay quiet inside amppass, come back on request, and the user's settings survive."""

from __future__ import annotations

import logging
import sys
import threading

import pytest
import torch
from torch import nn

import amppass
from amppass.fx.capture.quiet import quiet_torch


class _DataDependent(nn.Module):
    """Python control flow on a tensor's value: torch.export cannot capture it, and no submodule holds its weight
    (so it does not convert by parts either)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return x * 2 if (x @ self.weight).sum() > 0 else x


def _fail_capture() -> str:
    with pytest.raises(amppass.CaptureError) as error:
        amppass.convert(_DataDependent(), (torch.randn(2, 4),), dtype="fp16", plan_for="coverage")
    return str(error.value)


def test_a_capture_failure_prints_nothing_but_the_error(capfd):
    torch_logger = logging.getLogger("torch")
    level, stderr = torch_logger.level, sys.stderr
    message = _fail_capture()
    out, err = capfd.readouterr()
    assert "data-dependent" in message
    assert out == "" and err == ""  # torch logs the fake-tensor graph and prints it: 40+ lines without quiet
    assert torch_logger.level == level and sys.stderr is stderr


@pytest.mark.parametrize("ask", ["env", "logger"])
def test_torch_logs_come_back_when_asked_for(capfd, monkeypatch, ask):
    amppass_logger = logging.getLogger("amppass")
    level = amppass_logger.level
    if ask == "env":
        monkeypatch.setenv("AMPPASS_DEBUG", "1")
    else:
        amppass_logger.setLevel(logging.DEBUG)
    try:
        _fail_capture()
    finally:
        amppass_logger.setLevel(level)
    assert "def forward" in capfd.readouterr().err  # torch's partial graph


def test_other_threads_keep_their_stderr(capsys):
    with quiet_torch():
        other = threading.Thread(target=lambda: print("from another thread", file=sys.stderr))
        other.start()
        other.join()
        print("from the capturing thread", file=sys.stderr)
        with quiet_torch():  # nested: still quiet after the inner exit
            pass
        print("still the capturing thread", file=sys.stderr)
    print("after", file=sys.stderr)
    err = capsys.readouterr().err
    assert err == "from another thread\nafter\n"
