"""Before/after tables from one run: a benchmark script measures each checkout of amppass in a fresh process
that imports it (``--root CHECKOUT``, repeated), or this checkout in its own process by default."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

try:
    from .results import markdown_table
except ImportError:  # imported as a script's neighbour in another checkout's process (--measure)
    from results import markdown_table

HERE = Path(__file__).resolve().parent


@contextlib.contextmanager
def at_commit(commit: str) -> Iterator[Path]:
    """A temporary folder holding the ``amppass`` package as it was at ``commit`` (``git archive`` of this
    repository), to measure as a root beside this checkout; raises RuntimeError where git cannot give it."""
    archive = subprocess.run(["git", "archive", commit, "amppass"], cwd=HERE.parent, capture_output=True)
    if archive.returncode:
        raise RuntimeError(f"git archive {commit} failed: {archive.stderr.decode(errors='replace').strip()[:200]}")
    with tempfile.TemporaryDirectory(prefix=f"amppass-{commit}-") as folder, tempfile.TemporaryFile() as tar:
        tar.write(archive.stdout)
        tar.seek(0)
        tarfile.open(fileobj=tar).extractall(folder, filter="data")
        yield Path(folder)


def run(script: str, measure: Callable[[str], dict[str, Any]], names: list[str],
        roots: list[Path] | None = None) -> list[dict[str, Any]]:
    """One row per name and checkout: ``measure(name)`` here, or ``script --measure name`` in each root."""
    if not roots:
        return [measure(n) for n in names]
    return [{"checkout": str(root), **_measure_in(script, root, n)} for n in names for root in roots]


def against(script: str, measure: Callable[[str], dict[str, Any]], names: list[str],
            commit: str) -> list[dict[str, Any]]:
    """One row per name for amppass at ``commit`` and for this checkout, each measured in a fresh process, the
    two rows of a name one after the other; ``checkout`` says which ("this" or the commit)."""
    with at_commit(commit) as folder:
        rows = run(script, measure, names, [folder, HERE.parent])
    for row in rows:
        row["checkout"] = commit if row["checkout"] == str(folder) else "this"
    return rows


def this_checkout(measure: Callable[[str], dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """``--quick``'s rows of a before/after section: ``measure(name)`` of this checkout alone, in this process (a
    fresh process of the older checkout costs more than the whole quick section), marked as :func:`against` marks
    this checkout's rows; the warning filters, amppass's log level and torch's thread count that ``measure`` sets
    for its own process are restored after (later sections read amppass's warnings: the training ones say from
    them what a model trained in)."""
    import logging
    import warnings

    import torch

    threads, logger = torch.get_num_threads(), logging.getLogger("amppass")
    level = logger.level
    try:
        with warnings.catch_warnings():
            return [{"checkout": "this", **measure(name)} for name in names]
    finally:
        torch.set_num_threads(threads)
        logger.setLevel(level)


def _measure_in(script: str, root: Path, name: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(HERE.parent)])}
    done = subprocess.run([sys.executable, script, "--measure", name], cwd=root, env=env,
                          capture_output=True, text=True, timeout=3600)
    if done.returncode:
        return {"model": name, "failed": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(description: str, measure: Callable[[str], dict[str, Any]],
         rows: Callable[[bool, list[Path] | None], list[dict[str, Any]]], full_help: str) -> None:
    """The command line of such a script: ``[--full] [--root CHECKOUT ...]`` prints the markdown table;
    ``--measure NAME`` (what :func:`run` calls in each checkout) prints one row as JSON."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--full", action="store_true", help=full_help)
    parser.add_argument("--root", action="append", type=Path, help="a checkout to measure (repeat to compare)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    print(markdown_table(rows(args.full, args.root)))
