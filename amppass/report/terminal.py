"""The report for a terminal, as rich renderables: a table of decisions and a summary panel.

The library only builds renderables (and text, for callers without a console); printing is the CLI's job.
"""

from __future__ import annotations

import io

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .report import Report, summary_lines

STYLES = {"fp16": "bold green", "bf16": "bold blue", "fp32": "bold dark_orange", "-": "dim"}


def summary_panel(report: Report) -> Panel:
    """The summary lines in a titled panel."""
    info = report.info
    title = f"amppass {info.get('front_end', '')} → {info.get('dtype')}"
    return Panel(Text("\n".join(summary_lines(report))), title=title, title_align="left", expand=False)


def decisions_table(report: Report, max_rows: int | None = None) -> Table:
    """One line per node in graph order; with ``max_rows`` the rest is counted in the caption.

    The MACs column appears when the front end counted any.
    """
    table = Table(show_lines=False, header_style="bold", caption_justify="left")
    with_macs = any(row.macs is not None for row in report.rows)
    columns = [
        ("node", {"overflow": "fold", "max_width": 32}),
        ("op", {"overflow": "fold", "max_width": 20}),
        ("prec", {"no_wrap": True}),
        ("source", {"no_wrap": True}),
        ("MACs", {"justify": "right", "no_wrap": True}),
        ("casts in", {"overflow": "fold", "max_width": 20}),
        ("reason", {}),
    ]
    for name, options in columns:
        if name != "MACs" or with_macs:
            table.add_column(name, **options)
    rows = report.rows if max_rows is None else report.rows[:max_rows]
    for row in rows:
        macs = ["" if row.macs is None else f"{row.macs:,}"] if with_macs else []
        table.add_row(
            row.name, row.op, Text(row.precision, style=STYLES.get(row.precision, "")), row.source,
            *macs, ", ".join(row.casts), row.reason,
        )
    if len(rows) < len(report.rows):
        table.caption = f"… {len(report.rows) - len(rows)} more nodes (write --json or --html for all)"
    return table


def render(report: Report, max_rows: int | None = None) -> RenderableType:
    """Table then summary, for ``rich.console.Console.print``."""
    return Group(decisions_table(report, max_rows), summary_panel(report))


def render_text(report: Report, width: int = 120, max_rows: int | None = None) -> str:
    """The terminal view as plain text (no colour codes), ``width`` columns wide."""
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, force_terminal=False).print(render(report, max_rows))
    return buffer.getvalue()
