"""Docs that are tests: every fenced code block of README.md and docs/*.md runs, and so does every examples/ script.

Rules:

1. A file's ```python blocks run in order in one namespace (a block may use what an earlier block of the same
   file made), in a fresh temporary folder as the working directory, so files a block writes go there.
2. A ```bash block runs after the blocks above it, one command per line (``# ...`` comments dropped): each
   command must be ``amppass ...`` or ``python -m amppass ...`` and exit with 0. It runs in this process
   (``amppass.cli.main``, what both spellings call), which saves starting Python and torch per command.
3. A block whose fence is right after a line ``<!-- not run: REASON -->`` does not run; the reason must say why
   (a GPU, several processes, minutes of CPU). ```text blocks (printed output) never run.
4. Every script in examples/ runs as ``python -m examples.<name>`` and must exit with 0 (those that start
   several processes with the slow tests).
5. A ```text block right after a line ``<!-- summary printed by the code above: WHERE -->`` is a report summary
   the Python blocks above printed on the machine WHERE names. It must read as what they print here, on any CPU:
   a line is named by its label (the words before the first colon); a line printed here too must read the same
   with its numbers masked; a line whose words depend on the machine (:data:`WORDS_VARY`) must be one the
   summary prints on some machine; a line not printed here must be one some machines do not print
   (:data:`SOMETIMES`); and every line printed here that all machines print is in the sample.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from amppass.cli import main

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if p.name != "__init__.py")
# Arguments that keep an example fast in the test run (its defaults show the real sizes).
EXAMPLE_ARGS = {"quickstart": ["--size", "small", "--rows", "5"]}
# Examples that start several processes run with the slow tests (``-m slow``).
SLOW_EXAMPLES = {"fsdp2"}
_FENCE = re.compile(r"^```(\w*)\s*$")
_NOT_RUN = re.compile(r"^<!-- not run: (.+) -->$")
_PRINTED = re.compile(r"^<!-- summary printed by the code above: (.+) -->$")
# summary lines whose words depend on the machine (how busy it was, whether low precision paid there), by label
WORDS_VARY = ("decided by", "speed check", "how the speed of each group of connected ops was known", "not timed",
              "whole model", "to time on this machine instead")
# and lines some machines do not print at all (a CPU where the original module is kept has no MACs line)
SOMETIMES = (*WORDS_VARY, "heavy compute in bf16", "whole model per call")


@dataclass
class Block:
    """A fenced code block: its language, first line number (1-based), code, and why it does not run."""

    language: str
    line: int
    code: str
    not_run: str | None
    printed_on: str | None = None  # rule 5: the machine a summary sample was printed on


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, in order."""
    found, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i].strip())
        if not opening:
            i += 1
            continue
        marker = _NOT_RUN.match(lines[i - 1].strip()) if i else None
        printed = _PRINTED.match(lines[i - 1].strip()) if i else None
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        indent = len(lines[i]) - len(lines[i].lstrip())
        code = "\n".join(line[indent:] for line in lines[i + 1:end])
        found.append(Block(opening.group(1), i + 1, code, marker.group(1) if marker else None,
                           printed.group(1) if printed else None))
        i = end + 1
    return found


def _environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _run_shell(block: Block, page: Path) -> None:
    for line in block.code.splitlines():
        command = line.split(" #", 1)[0].strip()
        if not command or command.startswith("#"):
            continue
        words = shlex.split(command)
        if words[:3] == ["python", "-m", "amppass"]:
            words = words[3:]
        elif words[:1] == ["amppass"]:
            words = words[1:]
        else:
            raise AssertionError(f"{page.name}:{block.line}: {command!r} is not an amppass command; mark the block "
                                 "<!-- not run: REASON --> or make it one")
        try:
            code = main(words)
        except SystemExit as exit_:  # --help
            code = exit_.code
        assert code in (0, None), f"{page.name}:{block.line}: {command} exited {code}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_code_block_of_the_page_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs:{page.name}"}
    printed = io.StringIO()
    for block in blocks(page):
        if block.printed_on:
            _check_summary_sample(block, printed.getvalue(), page)
            printed = io.StringIO()
        if block.not_run or block.language in ("text", ""):
            continue
        if block.language == "python":
            with contextlib.redirect_stdout(_Tee(sys.stdout, printed)):
                exec(compile(block.code, f"{page.relative_to(ROOT)}:{block.line}", "exec"), namespace)  # noqa: S102
        elif block.language in ("bash", "sh", "console"):
            _run_shell(block, page)
        else:
            raise AssertionError(f"{page.name}:{block.line}: a ```{block.language} block; use python, bash or text")


class _Tee(io.TextIOBase):
    """Writes to both streams: the test's output as before, and a copy for rule 5."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)


def _label(line: str) -> str:
    return line.split(":", 1)[0].strip()


def _masked(line: str) -> str:
    """``line`` with its numbers as ``#``, counted words singular and a list of node counts per precision as one
    ``<counts>`` (a CPU without bf16 lists no bf16 nodes): its shape, not its figures."""
    shape = re.sub(r"\b(node|group)s\b", r"\1", re.sub(r"(?<![\w.])\d[\d,.]*(e-?\d+)?", "#", line.strip()))
    return re.sub(r"# (fp16|bf16|fp32|-)(, # (fp16|bf16|fp32|-))*", "<counts>", shape)


def _summary_shapes() -> set[str]:
    """The masked lines the summary prints on some machine (busy or idle, low precision faster or not), each
    clause of a "; "-joined line apart."""
    from amppass.report.report import Report

    info = {"front_end": "fx", "dtype": "bf16", "mode": "inference"}
    shapes = set()
    for nodes in (0, 2):
        for timing in ("measured", "cached", "table", "prior", "device", "unmeasured"):
            for whole in ({"skipped": "the machine was too busy for the timings to agree"},
                          {"converted_ms": 1.0, "original_ms": 2.0}):
                profit = {"nodes_fp32": nodes, "regions_fp32": nodes, "timing": {timing: 2},
                          "device": {"native_low": False, "why": "this CPU has none of amx_bf16, avx512_bf16"}}
                summary = Report([], {**info, "profitability": profit, "whole_model": whole}).summary()
                for line in summary.splitlines():
                    label, _, rest = line.partition(": ")
                    shapes.add(_masked(line))
                    shapes.update(_masked(f"{label}: {part}") for part in rest.split("; "))
    return shapes


def _check_summary_sample(block: Block, printed: str, page: Path = ROOT / "README.md") -> None:
    """Rule 5: the sample reads as what the code above printed here, on whatever machine this is."""
    where = f"{page.name}:{block.line} (printed on {block.printed_on})"
    run = {_masked(_label(line)): line for line in printed.splitlines() if line.strip()}
    sample = [line for line in block.code.splitlines() if line.strip()]
    shapes = _summary_shapes()
    for line in sample:
        label = _masked(_label(line))
        if label in WORDS_VARY:
            parts = [_masked(f"{label}: {part}") for part in line.partition(": ")[2].split("; ")]
            assert label == "decided by" or _masked(line) in shapes or all(p in shapes for p in parts), (
                f"{where}: {line!r} is not a line the summary prints; regenerate the sample from a real run")
        elif label in run:
            assert _masked(line) == _masked(run[label]), f"{where}: {line!r} reads {run[label]!r} here"
        else:
            assert label in SOMETIMES, f"{where}: {line!r} was not printed here; the summary printed:\n{printed}"
    shown = {_masked(_label(line)) for line in sample}
    missing = [line for label, line in run.items() if label not in SOMETIMES and label not in shown]
    assert not missing, f"{where}: the summary also prints {missing}; regenerate the sample from a real run"


README_SAMPLE_CHECK = _check_summary_sample


def test_every_block_that_does_not_run_says_why():
    for page in PAGES:
        for block in blocks(page):
            assert block.not_run is None or len(block.not_run.split()) >= 3, (
                f"{page.name}:{block.line}: give the reason a block does not run in a few words")


@pytest.mark.parametrize("script", [pytest.param(p, marks=pytest.mark.slow) if p.stem in SLOW_EXAMPLES else p
                                    for p in EXAMPLES], ids=lambda p: p.stem)
def test_example_runs(script, tmp_path):
    done = subprocess.run([sys.executable, "-m", f"examples.{script.stem}", *EXAMPLE_ARGS.get(script.stem, [])],
                          cwd=tmp_path, capture_output=True, text=True, env=_environment(), timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings (lower case, punctuation dropped, spaces as dashes)."""
    headings = [line.lstrip("#").strip() for line in page.read_text().splitlines() if line.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_every_relative_link_leads_to_a_file_and_heading():
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.relative_to(ROOT)}: link {target} leads nowhere"
            assert not anchor or anchor in _anchors(linked), f"{page.relative_to(ROOT)}: no heading for {target}"
