"""Write the benchmark results: ``RESULTS.md`` (tables, machine, versions, commands) and PNG plots."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("torch", "onnx", "onnxruntime-gpu", "onnxruntime", "transformers", "numpy", "amppass")


@dataclass
class Section:
    """One part of RESULTS.md: a heading, the command that reproduces it, its tables and notes."""

    title: str
    command: str
    tables: list[tuple[str, list[dict]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def machine() -> dict[str, str]:
    """What the figures were measured on, from the standard library and /proc only."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info = {
        "cpu": cpu,
        "logical cores (os.cpu_count)": str(os.cpu_count()),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        total_kb = int(meminfo.read_text().split("MemTotal:")[1].split()[0])
        info["memory"] = f"{total_kb / 2**20:.1f} GiB"
    try:
        import torch

        info["torch threads"] = str(torch.get_num_threads())
    except ImportError:
        pass
    return info


def versions() -> dict[str, str]:
    """Installed versions of the packages the benchmarks touch, plus the git commit."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
        found["git commit"] = commit + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        pass
    return found


def load() -> str:
    """The 1/5/15-minute load averages against the core count: how busy the machine was."""
    if not hasattr(os, "getloadavg"):
        return "unknown"
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f} on {os.cpu_count()} cores"


def fmt(value: object) -> str:
    """A table cell: errors in scientific notation, other numbers to about three significant digits."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) < 0.01:
            return f"{value:.2e}"
        if abs(value) >= 100:
            return f"{value:.0f}"
        return f"{value:.3g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: list[dict]) -> str:
    """A GitHub markdown table with the union of the rows' keys as columns, in first-seen order."""
    if not rows:
        return "(no rows)"
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_markdown(path: Path, mode: str, sections: list[Section], started: str, load_before: str) -> None:
    """Render every section, with the machine, versions, date and load, into ``path``.

    Sections of an earlier ``RESULTS.md`` at ``path`` that this run did not measure are kept as they were,
    in their place, so ``--only`` updates a section without losing the others.
    """
    parts = [
        "# amppass benchmark results",
        "",
        f"Last written by `python -m benchmarks run --{mode}` on {started} (UTC); each section says when it "
        "was measured and names the command that reproduces it. Timings are medians of interleaved repeats "
        "taken in one process; they are "
        "only comparable within a table.",
        "",
        "## Machine",
        "",
        *(f"- {k}: {v}" for k, v in machine().items()),
        f"- load average (1/5/15 min) at start: {load_before}; at end: {load()}. The machine is shared: other "
        "processes ran during the measurement, so absolute timings are noisy; ratios within a table are "
        "measured side by side and hold up better.",
        "- GPU: none (CPU only).",
        "",
        "## Versions",
        "",
        *(f"- {k}: {v}" for k, v in versions().items()),
        "",
    ]
    rendered = {section.title: _render(section) for section in sections}
    earlier = _earlier_sections(path)
    for title, text in earlier.items():
        parts.append(rendered.pop(title, text))
    parts += rendered.values()
    path.write_text("\n".join(parts))


def _render(section: Section) -> str:
    parts = [f"## {section.title}", "", f"Command: `{section.command}`", ""]
    for note in section.notes:
        parts += [note, ""]
    for caption, rows in section.tables:
        if caption:
            parts += [f"**{caption}**", ""]
        parts += [markdown_table(rows), ""]
    return "\n".join(parts)


def _earlier_sections(path: Path) -> dict[str, str]:
    """Title -> text of the measured sections of the RESULTS.md at ``path`` (none if there is none)."""
    if not path.exists():
        return {}
    found: dict[str, str] = {}
    for chunk in path.read_text().split("\n## ")[1:]:
        title = chunk.split("\n", 1)[0].strip()
        if title not in ("Machine", "Versions"):
            found[title] = "## " + chunk.rstrip("\n") + "\n"
    return found


def plot_latency(rows: list[dict], path: Path) -> None:
    """Grouped bars: speed relative to fp32 eager (higher is faster) per model and shape, one bar per variant."""
    points: list[tuple[str, str]] = []
    variants: list[str] = []
    for row in rows:
        key = (row["model"], row["shape"])
        points += [key] if key not in points else []
        variants += [row["variant"]] if row["variant"] not in variants else []
    ms = {(r["model"], r["shape"], r["variant"]): r["latency_ms"] for r in rows}
    width = 0.8 / len(variants)
    fig, ax = _pyplot().subplots(figsize=(max(6.0, 1.4 * len(points)), 4.0))
    for i, variant in enumerate(variants):
        speed = [ms[(m, s, "fp32")] / ms[(m, s, variant)] for m, s in points]
        ax.bar([p + i * width for p in range(len(points))], speed, width, label=variant)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([p + 0.4 - width / 2 for p in range(len(points))])
    ax.set_xticklabels([f"{m}\n{s}" for m, s in points], fontsize=8)
    ax.set_ylabel("speed vs fp32 eager (x)")
    _save(fig, ax, "bf16 inference latency on CPU (median, interleaved)", path)


def plot_scaling(rows: list[dict], fitted: dict, path: Path) -> None:
    """Conversion time against node count on log-log axes, with the linear fit."""
    nodes = [r["nodes"] for r in rows]
    seconds = [r["convert_s"] for r in rows]
    fig, ax = _pyplot().subplots(figsize=(5.5, 4.0))
    ax.loglog(nodes, seconds, "o-", label="amppass.convert_onnx")
    ax.loglog(nodes, [fitted["intercept_s"] + fitted["s_per_node"] * n for n in nodes], "--",
              label=f"a + b*n fit (R²={fitted['r2']:.3f}); exponent {fitted['exponent']:.2f}")
    ax.set_xlabel("graph nodes")
    ax.set_ylabel("conversion time (s)")
    _save(fig, ax, "ONNX conversion time against graph size", path)


def not_run(err: BaseException) -> str:
    """Why a baseline could not run here (a package not installed, a kernel failing on this CPU), as a table's row
    says it: the section goes on without that baseline."""
    if isinstance(err, ModuleNotFoundError):
        return f"not run: {err.name} is not installed (pip install -e \".[bench]\")"
    first = (str(err).strip().splitlines() or [""])[0]
    return f"not run on this CPU: {type(err).__name__}: {first[:160]}"


def _pyplot():
    """matplotlib's pyplot, drawing to files only, imported when the first plot is drawn: ``--help`` and the
    sections without plots run without matplotlib (the ``bench`` extra installs it)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def _save(fig, ax, title: str, path: Path) -> None:
    """Title, legend and layout shared by every plot, then write it and free the figure."""
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)


def now() -> str:
    """The current UTC time, to the minute."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
