"""Reading the docs' Markdown: fenced code blocks with their markers, and the check of a printed report summary
sample against what the summary prints here (tests/test_docs.py, rules 3 and 5)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.paths import ROOT

_FENCE = re.compile(r"^```(\w*)\s*$")


_NOT_RUN = re.compile(r"^<!-- not run: (.+) -->$")


_PRINTED = re.compile(r"^<!-- summary printed by the code above: (.+) -->$")


# summary lines whose words depend on the machine (how busy it was, whether low precision paid there), by label
WORDS_VARY = ("decided by", "speed check", "how the speed of each group of connected ops was known", "not timed",
              "whole model", "to time on this machine instead", "returned", "to convert it anyway")


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
    from amppass.reporting.report import Report, Row

    info = {"front_end": "fx", "dtype": "bf16", "mode": "inference"}
    kept = Row("BertModel", "module", "fp32", "profitability: the original runs", "profitability", rule="whole-model")
    shapes = set()
    for nodes, rows, native in ((0, [], True), (2, [], False), (2, [kept], False), (2, [kept], True)):
        for timing in ("measured", "cached", "table", "prior", "device", "unmeasured"):
            for whole in ({"skipped": "the machine was too busy for the timings to agree"},
                          {"converted_ms": 1.0, "original_ms": 2.0}):
                device = {"native_low": native, "why": "this CPU has none of amx_bf16, avx512_bf16"}
                profit = {"nodes_fp32": nodes, "regions_fp32": nodes, "timing": {timing: 2}, "device": device}
                summary = Report(rows, {**info, "profitability": profit, "whole_model": whole}).summary()
                for line in summary.splitlines():
                    label, _, rest = line.partition(": ")
                    shapes.add(_masked(line))
                    shapes.update(_masked(f"{label}: {part}") for part in rest.split("; "))
    return shapes


def check_summary_sample(block: Block, printed: str, page: Path = ROOT / "README.md") -> None:
    """tests/test_docs.py's rule 5: the sample reads as what the code above printed here, on whatever machine this
    is."""
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
