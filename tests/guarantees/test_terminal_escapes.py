"""Text from a model file reaches the terminal escaped: no control sequence runs, no escape is cut in half.

A converted ONNX model carries its decisions in metadata anyone can edit: node names, ops and reasons that
hold terminal controls (clear screen, window title, an OSC 8 link showing one address and opening another),
a bidirectional override, or rich markup. ``amppass report`` prints them as visible escapes.
"""

from __future__ import annotations

import json
import re

import pytest

import amppass
from amppass.cli import main
from amppass.onnx.io.read_model import load
from amppass.onnx.io.save import save
from amppass.reporting.terminal import render_text
from amppass.text import cut, elide, printable
from tests.helpers.onnx_files import matmul_64

CLEAR, TITLE = "\x1b[2J\x1b[H", "\x1b]0;owned\x07"
LINK = "\x1b]8;;https://evil.example/\x1b\\https://docs.example/\x1b]8;;\x1b\\"
HOSTILE = f"{CLEAR}{TITLE}{LINK}\u202egnp.exe\u2028[/bold][link=https://evil.example/]x"
ESCAPE = re.compile(r"\\\\|\\x[0-9a-f]{2}|\\u[0-9a-f]{4}|\\U[0-9a-f]{8}")


def forged(tmp_path):
    """A converted model whose MatMul decision holds hostile text in its name, op and reason, and whose summary
    in its front end (the panel's title)."""
    model = amppass.convert_onnx(matmul_64())
    node = next(n for n in model.graph.node if n.op_type == "MatMul")
    node.name = f"mm{HOSTILE}"
    stored = next(p for p in node.metadata_props if p.key == "amppass")
    decision = json.loads(stored.value)
    decision.update(op=f"MatMul{HOSTILE}", reason=f"because {HOSTILE} " * 4)
    stored.value = json.dumps(decision)
    info = next(p for p in model.metadata_props if p.key == "amppass")
    info.value = json.dumps({**json.loads(info.value), "front_end": f"onnx{TITLE}"})  # the dtype is fp16 or bf16
    path = tmp_path / "forged.onnx"
    save(model, str(path))
    return path


def _no_controls(text: str) -> None:
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text and "\u2028" not in text


@pytest.mark.parametrize("flags", [[], ["--by-op"], ["--op", "matmul"], ["--rows", "1"]])
def test_report_prints_hostile_text_as_escapes(tmp_path, capsys, monkeypatch, flags):
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["report", str(forged(tmp_path)), *flags]) == 0
    out = capsys.readouterr().out
    _no_controls(out)
    assert "\\x1b" in out


@pytest.mark.parametrize("width", [40, 60, 80, 120, 200])
def test_shortened_cells_never_cut_an_escape(tmp_path, width):
    report = amppass.report(load(str(forged(tmp_path))).model)
    text = render_text(report, width=width)
    _no_controls(text)
    assert "mm\\x1b" in text, "the forged node's row is printed, its name escaped"
    for line in text.splitlines():
        units = re.findall(r"\\\\|\\x..|\\u....|\\U........|\\.?|[^\\]", line, re.S)
        assert all(len(u) == 1 and u != "\\" or ESCAPE.fullmatch(u) for u in units), f"a cut escape: {line!r}"
        # escaped twice would read as an escaped backslash then an escape's letters (the name's one backslash,
        # after ESC in its link, is an escaped backslash followed by an escape or plain text)
        after = ["".join(units[i + 1:i + 4]) for i, u in enumerate(units) if u == "\\\\"]
        assert not any(re.fullmatch(r"x[0-9a-f]{2}", a) for a in after), f"escaped twice: {line!r}"


def test_escaping_comes_before_shortening_at_every_width():
    text = "ab" + HOSTILE * 2 + "yz"
    whole = printable(text)
    for width in range(1, len(whole) + 2):
        for short in (elide(whole, width), cut(whole, width)):
            assert len(short) <= width
            _no_controls(short)
            units = re.findall(r"\\\\|\\x..|\\u....|\\U........|\\.?|[^\\]", short, re.S)
            assert all(len(u) == 1 and u != "\\" or ESCAPE.fullmatch(u) for u in units), \
                f"{short!r} cuts an escape at width {width}"
    assert elide(whole, len(whole)) == whole and printable("plain name_1 ü 名") == "plain name_1 ü 名"
    assert printable("a\\b\x1b") == "a\\\\b\\x1b" and printable(printable("\x1b")) == "\\\\x1b"


def test_cli_errors_quote_file_text_escaped(tmp_path, capsys):
    """An error message that quotes text from the file (here a custom op's name) is escaped too."""
    from onnx import helper

    model = matmul_64()
    model.graph.node[0].op_type = f"Foo{TITLE}"
    model.graph.node[0].domain = "evil"
    model.opset_import.append(helper.make_opsetid("evil", 1))
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    assert main(["convert", str(path), "-o", str(tmp_path / "o.onnx"), "--keep-fp32", "nothing-matches"]) == 1
    captured = capsys.readouterr()
    _no_controls(captured.out + captured.err)
    # the error is printed, and it names the op with its controls as visible escapes (not left out)
    assert "'nothing-matches' matches no node name" in captured.err
    assert "evil.Foo\\x1b]0;owned\\x07" in captured.err
    assert not (tmp_path / "o.onnx").exists()
