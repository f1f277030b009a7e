"""A cap a user sets from the environment (amppass.limits.env_cap), as the .pt2 size cap and the ONNX node cap
read it: unset or blank gives the default, a whole number (with ``_`` or ``,`` between digits) the cap, anything
else an InputError naming the variable, its value, what it caps and the default."""

from __future__ import annotations

import pytest

from amppass.archive import layout
from amppass.errors import InputError
from amppass.limits import env_cap
from amppass.onnx.io import validate

VARIABLE = "AMPPASS_TEST_CAP"


@pytest.mark.parametrize("text, cap", [(None, 7), ("", 7), ("  ", 7), ("12", 12), ("1_000", 1000), ("2,000", 2000),
                                       (" 5 ", 5)])
def test_the_variable_sets_the_cap_and_unset_gives_the_default(monkeypatch, text, cap):
    if text is None:
        monkeypatch.delenv(VARIABLE, raising=False)
    else:
        monkeypatch.setenv(VARIABLE, text)
    assert env_cap(VARIABLE, 7, "the most things", 100) == cap


@pytest.mark.parametrize("text", ["lots", "0", "-3", "1.5", "1e6"])
def test_anything_but_a_whole_number_above_zero_is_refused_with_the_fix(monkeypatch, text):
    monkeypatch.setenv(VARIABLE, text)
    with pytest.raises(InputError) as raised:
        env_cap(VARIABLE, 7_000, "the most things a model may hold", 100)
    assert str(raised.value) == (f"{VARIABLE}={text!r} is not a whole number above 0; set it to the most things a "
                                 f"model may hold (e.g. {VARIABLE}=100), or unset it for the default 7,000")


def test_the_file_and_node_caps_read_their_variables_through_it(monkeypatch):
    monkeypatch.setenv(layout.ENV_MAX_FILE, "1_000")
    monkeypatch.setenv(validate.ENV_MAX_NODES, "2,000")
    assert layout.file_limit() == 1000 and validate.node_limit() == 2000
    monkeypatch.setenv(layout.ENV_MAX_FILE, "lots")
    with pytest.raises(InputError, match="AMPPASS_MAX_PT2_BYTES='lots' .* size in bytes of the largest .pt2 file"):
        layout.file_limit()
    monkeypatch.delenv(layout.ENV_MAX_FILE)
    monkeypatch.delenv(validate.ENV_MAX_NODES)
    assert layout.file_limit() == layout.MAX_FILE and validate.node_limit() == validate.MAX_NODES
