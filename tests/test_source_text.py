"""No internal issue number in the package, the tests, the benchmarks' code, the docs or pyproject.toml: a comment or
docstring says the reason a line is there ("an unbounded pytest>=8 installed a release the suite had not run
with"), which a reader without the tracker can check, not the number of the issue that asked for it."""

from __future__ import annotations

import re

from tests.helpers.paths import ROOT

# "issue N", "Issue #N", "issue-N", "issue N, row M", "rows N and M:", "item N:" (an issue's numbered rows)
ISSUE_NUMBER = re.compile(r"\bissues?[ -]#?\d+|\b(?:rows?|items?) \d+(?: and \d+)?[:,)]", re.IGNORECASE)


def _sources() -> list:
    return [ROOT / "pyproject.toml", ROOT / "benchmarks" / "README.md", ROOT / "README.md",
            *sorted((ROOT / "docs").glob("*.md")),
            *(p for folder in ("amppass", "tests", "benchmarks", "scripts", "examples", "models")
              for p in sorted((ROOT / folder).rglob("*.py")) if "site" not in p.relative_to(ROOT).parts)]


def test_no_internal_issue_number_in_code_comments_tests_or_pyproject():
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in _sources() for number, line in enumerate(path.read_text().splitlines(), 1)
             if ISSUE_NUMBER.search(line)]
    assert not found, "say the reason, not the issue's number:\n" + "\n".join(found)


# the forms, each with a number put in where the test runs (a literal one here would itself be an issue number)
FORMS = ("(issue {n}, row {m}: ...", "before the issue-{n} moves", "Issue #{n}'s fast path", "issue {n} row {m}:",
         "(rows {m} and {n}: ...", "# -- item {m}: checkpoints")


def test_the_pattern_finds_the_forms_an_issue_number_takes():
    for form in FORMS:
        said = form.format(n=7 * 6, m=3 + 5)
        assert ISSUE_NUMBER.search(said), said
    for fine in ("onnxruntime's PR #29709", "--rows 25", "the first 2 rows", "row 0 of the table is"):
        assert not ISSUE_NUMBER.search(fine), fine
