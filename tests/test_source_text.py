"""No internal issue number in the package, the tests, the benchmarks' code or pyproject.toml: a comment or
docstring says the reason a line is there ("an unbounded pytest>=8 installed a release the suite had not run
with"), which a reader without the tracker can check, not the number of the issue that asked for it."""

from __future__ import annotations

import re

from tests.helpers.paths import ROOT

# "issue 41", "Issue #44", "issue 41, row 8", "rows 5 and 13:", "item 2:" (an issue's numbered rows)
ISSUE_NUMBER = re.compile(r"\bissues?[ -]#?\d+|\b(?:rows?|items?) \d+(?: and \d+)?[:,)]", re.IGNORECASE)


def _sources() -> list:
    return [ROOT / "pyproject.toml", ROOT / "benchmarks" / "README.md",
            *(p for folder in ("amppass", "tests", "benchmarks", "scripts", "examples", "models")
              for p in sorted((ROOT / folder).rglob("*.py")) if "site" not in p.relative_to(ROOT).parts)]


def test_no_internal_issue_number_in_code_comments_tests_or_pyproject():
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in _sources() for number, line in enumerate(path.read_text().splitlines(), 1)
             if ISSUE_NUMBER.search(line) and path != ROOT / "tests" / "test_source_text.py"]
    assert not found, "say the reason, not the issue's number:\n" + "\n".join(found)


def test_the_pattern_finds_the_forms_an_issue_number_takes():
    for said in ("(issue 41, row 8: ...", "before the issue-42 moves", "Issue #44's fast path", "issue 41 row 12:",
                 "(rows 5 and 13: ...", "# -- item 2: checkpoints"):
        assert ISSUE_NUMBER.search(said), said
    for fine in ("onnxruntime's PR #29709", "--rows 25", "the first 2 rows", "row 0 of the table is"):
        assert not ISSUE_NUMBER.search(fine), fine
