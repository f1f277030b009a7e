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
from pathlib import Path

import pytest

from amppass.cli import main
from tests.helpers.docs import Block, blocks, check_summary_sample

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if p.name != "__init__.py")
# Arguments that keep an example fast in the test run (its defaults show the real sizes).
EXAMPLE_ARGS = {"quickstart": ["--size", "small", "--rows", "5"]}
# Examples that start several processes run with the slow tests (``-m slow``).
SLOW_EXAMPLES = {"fsdp2"}


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
            check_summary_sample(block, printed.getvalue(), page)
            printed = io.StringIO()
        if block.not_run or block.language in ("text", ""):
            continue
        if block.language == "python":
            with contextlib.redirect_stdout(_Tee(sys.stdout, printed)):
                exec(compile(block.code, f"{page.relative_to(ROOT)}:{block.line}", "exec"), namespace)
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
