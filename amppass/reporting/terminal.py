"""The report for a terminal, as rich renderables: the summary first, then a table of decisions or of ops.

The decisions table opens on the decisions that matter (:func:`~amppass.reporting.rows.decision_order`: heavy
ops, fp32 ones first; constants and shapes last). It fits the width it is printed at, one line per row: node
names are shortened together so that different nodes still read apart (:func:`amppass.text.shorten_names`:
shared leading segments dropped, earlier segments abbreviated, layer indexes kept), op names lose their
middle, reasons their end, and narrow consoles leave out what a reader can do without (the MACs column below
120 columns, the source below 100). The caption says when something was cut; the HTML
and JSON reports hold every row in full.

The library only builds renderables (and text, for callers without a console); printing is the CLI's job.
"""

from __future__ import annotations

import io
from typing import Iterable, Iterator

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ..text import ELLIPSIS, cut, elide, printable, shorten_names
from .report import PRECISIONS, Report, Row, summary_lines
from .rows import decision_order, fp8_scales

STYLES = {"fp8": "bold magenta", "fp16": "bold green", "bf16": "bold blue", "fp32": "bold dark_orange", "-": "dim"}
GAP = 3  # columns between two table columns: padding, separator, padding
SOURCE_FROM, MACS_FROM = 100, 120  # console widths from which those columns are shown
# node and op columns at most (or a third and a sixth of a wider console); the reason column at least
NAME_MAX, OP_MAX, REASON_MIN = 28, 20, 28


def summary_panel(report: Report) -> Panel:
    """The summary lines in a titled panel (text from the model file escaped, :mod:`amppass.text`)."""
    info = report.info
    title = Text(printable(f"amppass {info.get('front_end', '')} → {info.get('dtype')}"))
    return Panel(Text("\n".join(printable(line) for line in summary_lines(report))), title=title,
                 title_align="left", expand=False)


class DecisionsTable:
    """One line per row, in the order given, laid out for the console width it is printed at.

    ``rows`` are the rows to list (a selection of ``report.rows``), of which the first ``max_rows``.
    """

    def __init__(self, rows: list[Row], max_rows: int | None = None, title: str = ""):
        self.rows, self.title = rows, title
        self.shown = rows if max_rows is None else rows[:max_rows]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[RenderableType]:
        width = options.max_width
        with_macs = width >= MACS_FROM and any(row.macs is not None for row in self.shown)
        cells = [  # escaped before anything is measured or shortened
            {"node": printable(row.name), "op": printable(row.op), "prec": printable(row.precision),
             "source": printable(row.source), "MACs": "" if row.macs is None else f"{row.macs:,}",
             "reason": printable("; ".join(filter(None, (fp8_scales(row), row.reason))))}
            for row in self.shown
        ]
        names = ["node", "op", "prec"] + ["source"] * (width >= SOURCE_FROM) + ["MACs"] * with_macs + ["reason"]
        widths = _widths(names, cells, width)
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold",
                      title=Text(self.title) if self.title else None, title_justify="left",
                      caption_justify="left")
        for name in names:
            table.add_column(name, width=widths[name], no_wrap=True, justify="right" if name == "MACs" else "left")
        shortened = False
        nodes = shorten_names([cell["node"] for cell in cells], widths["node"])  # rows that differ read apart
        for row, cell, node in zip(self.shown, cells, nodes, strict=False):
            texts = []
            for name in names:
                fitted = node if name == "node" else (cut if name == "reason" else elide)(cell[name], widths[name])
                shortened |= fitted != cell[name]
                texts.append(Text(fitted, style=STYLES.get(row.precision, "") if name == "prec" else ""))
            table.add_row(*texts)
        notes = []
        if len(self.shown) < len(self.rows):
            notes.append(f"{ELLIPSIS} {len(self.rows) - len(self.shown)} more rows")
        if shortened:
            notes.append(f"names and reasons shortened to fit {width} columns")
        if notes:
            table.caption = "; ".join(notes) + "; the HTML and JSON reports have every row in full"
        yield table


class OpsTable:
    """One line per op: how many nodes run it in each precision, and their MACs where counted."""

    def __init__(self, report: Report, rows: list[Row], title: str = ""):
        self.groups, self.title = report.by_op(rows), title

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[RenderableType]:
        present = [p for p in PRECISIONS if any(p in g.by_precision for g in self.groups)]
        with_macs = any(g.macs is not None for g in self.groups)
        cells = [
            {"op": printable(g.op), "nodes": str(g.nodes), **{p: str(g.by_precision.get(p, "")) for p in present},
             "MACs": "" if g.macs is None else f"{g.macs:,}"}
            for g in self.groups
        ]
        names = ["op", "nodes", *present] + ["MACs"] * with_macs
        fixed = {n: max([len(n)] + [len(c[n]) for c in cells]) for n in names[1:]}
        op_width = max(options.max_width - sum(fixed.values()) - GAP * (len(names) - 1), 8)
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold",
                      title=Text(self.title) if self.title else None, title_justify="left")
        table.add_column("op", no_wrap=True, width=min(op_width, max([2] + [len(c["op"]) for c in cells])))
        for name in names[1:]:
            style = STYLES.get(name, "") if name in PRECISIONS else ""
            table.add_column(name, width=fixed[name], justify="right", no_wrap=True, header_style=f"bold {style}")
        for cell in cells:
            table.add_row(Text(elide(cell["op"], op_width)), *(Text(cell[n]) for n in names[1:]))
        yield table


def render(report: Report, *, precision: Iterable[str] = (), op: Iterable[str] = (), by_op: bool = False,
           max_rows: int | None = None) -> RenderableType:
    """Summary, then the decisions (or, with ``by_op``, the ops) of the rows the filters keep.

    ``precision`` and ``op`` filter as :meth:`Report.select` does; ``max_rows`` cuts the decisions table.
    """
    precision, op = list(precision), list(op)
    rows = report.select(precision, op)
    filters = [f"precision {', '.join(precision)}"] * bool(precision) + [f"op {', '.join(op)}"] * bool(op)
    if filters and not rows:
        ops = ", ".join(sorted({row.op for row in report.rows}))
        return Group(summary_panel(report),
                     Text(printable(f"no node matches {'; '.join(filters)}; the model's ops: {ops}")))
    title = printable(f"{len(rows)} of {len(report.rows)} nodes: {'; '.join(filters)}") if filters else ""
    table = OpsTable(report, rows, title) if by_op else \
        DecisionsTable([rows[i] for i in decision_order(rows)], max_rows, title)
    return Group(summary_panel(report), table)


def render_text(report: Report, width: int = 80, **filters) -> str:
    """The terminal view as plain text (no colour codes), ``width`` columns wide; ``filters`` as for
    :func:`render`."""
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, force_terminal=False).print(render(report, **filters))
    return buffer.getvalue()


def _widths(names: list[str], cells: list[dict[str, str]], width: int) -> dict[str, int]:
    """Column widths that fit ``width``: fixed columns at their longest cell, node and op within their
    caps, shrunk (down to half their cap) while the reason has less than ``REASON_MIN``."""
    caps = {"node": max(NAME_MAX, width // 3), "op": max(OP_MAX, width // 6)}
    natural = {n: max([len(n)] + [len(c[n]) for c in cells]) for n in names}
    widths = dict(natural, node=min(natural["node"], caps["node"]), op=min(natural["op"], caps["op"]))
    fixed = sum(widths[n] for n in names if n not in ("node", "op", "reason")) + GAP * (len(names) - 1)
    room = width - fixed
    for name, cap in (("node", NAME_MAX), ("op", OP_MAX)):
        short = REASON_MIN - (room - widths["node"] - widths["op"])
        if short > 0:
            widths[name] -= min(short, max(widths[name] - cap // 2, 0))
    widths["reason"] = max(min(room - widths["node"] - widths["op"], natural["reason"]), 1)
    return widths
