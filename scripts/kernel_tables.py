"""Build amppass's static kernel tables (``amppass/targets/data/*.json``) from published support matrices.

Two sources, each read from a git checkout or mirror at a named revision, so every table records the
commit and date it was made from:

- onnxruntime's ``docs/OperatorKernels.md``, which onnxruntime generates from its kernel registry: one
  table per execution provider (CPU and CUDA here).
- onnx-tensorrt's ``docs/operators.md``, the ONNX parser's support matrix: one table for TensorRT.

A table keeps, for every (domain, op) and opset range, the float types among its kernels' type
constraints (float, float16, bfloat16, double); a range whose kernels take none of them is kept with an
empty list, so the loader can tell "the op exists but not in this type" from "the op is unknown".

Usage::

    python scripts/kernel_tables.py onnxruntime --git ~/onnxruntime --rev <commit> --version 1.30.0-dev
    python scripts/kernel_tables.py tensorrt --git ~/onnx-tensorrt --rev release/10.1-GA --version 10.1

The source files are read, never copied into amppass: only the facts (op, opsets, types) are kept.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "amppass" / "targets" / "data"

FLOAT_TYPES = ("bfloat16", "double", "float", "float16")
OPEN_END = 2147483647  # onnxruntime's own "no upper opset" (INT_MAX in its kernel registry)

ORT_FILE = "docs/OperatorKernels.md"
TRT_FILE = "docs/operators.md"
ORT_PROVIDERS = {"CPUExecutionProvider": "onnxruntime_cpu.json", "CUDAExecutionProvider": "onnxruntime_cuda.json"}

# TensorRT's matrix spells types its own way; only the float ones matter here. Other entries (INT8, FP8,
# BOOL...) are quantized or integer types, and the doc's typos of them ("INF64") fall out the same way.
_TRT_FLOATS = {"FP32": "float", "FLOAT32": "float", "FP16": "float16", "FLOAT16": "float16",
               "BF16": "bfloat16", "BFLOAT16": "bfloat16", "DOUBLE": "double"}

Rows = dict[str, dict[str, list[list]]]  # domain -> op -> [[since, until, [float types]]]


class ParseError(ValueError):
    """A line of a source document that does not have the shape the parser expects."""


def _git(git_dir: Path, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", str(git_dir), *args], check=True, capture_output=True,
                          text=True).stdout


def _git_dir(path: Path) -> Path:
    """The git directory of a checkout (``path/.git``) or of a bare mirror (``path`` itself)."""
    return path / ".git" if (path / ".git").exists() else path


def read_source(path: Path, rev: str, file: str) -> tuple[str, str, str]:
    """``file``'s text at ``rev`` in the repository at ``path``, with the full commit id and its date."""
    git_dir = _git_dir(path)
    commit = _git(git_dir, "rev-parse", f"{rev}^{{commit}}").strip()
    date = _git(git_dir, "log", "-1", "--format=%cs", commit).strip()
    return _git(git_dir, "show", f"{commit}:{file}"), commit, date


def _versions(cell: str, where: str) -> tuple[int, int]:
    """``13+`` -> (13, open), ``[6, 12]`` -> (6, 12), ``13`` -> (13, 13)."""
    cell = cell.strip()
    if m := re.fullmatch(r"(\d+)\+", cell):
        return int(m[1]), OPEN_END
    if m := re.fullmatch(r"\[(\d+),\s*(\d+)\]", cell):
        return int(m[1]), int(m[2])
    if m := re.fullmatch(r"\d+", cell):
        return int(cell), int(cell)
    raise ParseError(f"{where}: opset cell {cell!r} is not N+, [A, B] or N")


def _ort_float_types(cell: str, where: str) -> list[str]:
    """Float types named as plain tensors in a 'Types Supported' cell (``seq(tensor(float))`` is not one)."""
    found = set()
    for constraint in filter(None, (part.strip() for part in cell.split("<br/>"))):
        if not re.fullmatch(r"\*\*\w+\*\* = .*", constraint):
            raise ParseError(f"{where}: type constraint {constraint!r} is not '**T** = types'")
        for name in constraint.split(" = ", 1)[1].split(","):
            if (m := re.fullmatch(r"tensor\((\w+)\)", name.strip())) and m[1] in FLOAT_TYPES:
                found.add(m[1])
    return sorted(found)


def parse_onnxruntime(text: str, provider: str) -> Rows:
    """The rows of ``provider``'s section of OperatorKernels.md.

    A section is a table whose op rows read ``|Op|params|versions|types|``; further opset ranges of the
    same op follow as ``|||versions|types|``, and ``|**Operator Domain:** *name*||||`` starts a domain.
    Every table line must have one of these shapes: a line that does not stops the parse, so a change of
    the document's format cannot go unnoticed as a table with missing ops.
    """
    lines = text.splitlines()
    heading = f"## Operators implemented by {provider}"
    try:
        start = lines.index(heading) + 1
    except ValueError:
        raise ParseError(f"no section {heading!r} in {ORT_FILE}") from None
    rows: Rows = {}
    domain = op = None
    for number, line in enumerate(lines[start:], start + 1):
        if line.startswith("## ") or line.startswith("<a name="):
            break
        if not line.startswith("|") or line.startswith("|---") or line.startswith("| Op Name") or line == "| |":
            continue
        where = f"{ORT_FILE} line {number}"
        if m := re.fullmatch(r"\|\*\*Operator Domain:\*\* \*([\w.]+)\*\|\|\|\|", line):
            domain, op = m[1], None
            rows.setdefault(domain, {})
            continue
        cells = line.split("|")
        if len(cells) != 6 or cells[0] or cells[5]:
            raise ParseError(f"{where}: expected 4 cells, got {line[:80]!r}")
        name, _, versions, types = cells[1:5]
        if name:
            op = name
        elif op is None:
            raise ParseError(f"{where}: opset row before any op")
        if domain is None:
            raise ParseError(f"{where}: op row before any 'Operator Domain' row")
        since, until = _versions(versions, where)
        rows[domain].setdefault(op, []).append([since, until, _ort_float_types(types, where)])
    if not any(rows.values()):
        raise ParseError(f"section {heading!r} of {ORT_FILE} has no op rows")
    return _sorted(rows)


def parse_tensorrt(text: str) -> tuple[Rows, list[str]]:
    """TensorRT's support matrix as rows (every op over all opsets) and the ops it marks unsupported.

    An op marked ``N`` has no TensorRT layer: it gets one row with no types, so a plan sees "none"
    (onnxruntime's TensorRT provider hands such nodes to another provider) rather than "unknown".
    """
    rows: Rows = {"ai.onnx": {}}
    unsupported = []
    in_matrix = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("## "):
            in_matrix = line.strip() == "## Operator Support Matrix"
            continue
        if not in_matrix or not line.startswith("|") or line.startswith("|---") or line.startswith("| Operator "):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        where = f"{TRT_FILE} line {number}"
        if len(cells) < 2 or not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", cells[0]):
            raise ParseError(f"{where}: expected '| Op | Y/N | types |', got {line[:80]!r}")
        op, supported = cells[0], cells[1].split()[0] if cells[1] else ""
        if supported not in ("Y", "N"):
            raise ParseError(f"{where}: 'Supported' cell {cells[1]!r} is neither Y nor N")
        names = [name.strip() for name in cells[2].split(",")] if supported == "Y" and len(cells) > 2 else []
        types = sorted({_TRT_FLOATS[name] for name in names if name in _TRT_FLOATS})
        if supported == "N":
            unsupported.append(op)
        if op in rows["ai.onnx"]:
            raise ParseError(f"{where}: {op} is listed twice")
        rows["ai.onnx"][op] = [[1, OPEN_END, types]]
    if not rows["ai.onnx"]:
        raise ParseError(f"no '## Operator Support Matrix' table in {TRT_FILE}")
    return _sorted(rows), sorted(unsupported)


def _sorted(rows: Rows) -> Rows:
    return {domain: {op: sorted(rows[domain][op]) for op in sorted(rows[domain])} for domain in sorted(rows)}


def dumps(table: dict) -> str:
    """``table`` as JSON with one op per line, so a regenerated table reads as a diff of ops."""
    head = [f" {json.dumps(key)}: {json.dumps(value)}" for key, value in table.items() if key != "ops"]
    domains = []
    for domain, ops in table["ops"].items():
        lines = ",\n".join(f"   {json.dumps(op)}: {json.dumps(rows)}" for op, rows in ops.items())
        domains.append(f"  {json.dumps(domain)}: {{\n{lines}\n  }}")
    body = ",\n".join(domains)
    return "{\n" + ",\n".join([*head, f' "ops": {{\n{body}\n }}']) + "\n}\n"


def _write(name: str, table: dict) -> Path:
    """Write ``table`` to ``DATA/name`` through a temporary file, so a failed run leaves the old table."""
    path = DATA / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(dumps(table))
    tmp.replace(path)
    return path


def _source(args: argparse.Namespace, upstream: str, file: str, commit: str, date: str) -> dict:
    source = {"repo": args.repo or upstream, "file": file, "version": args.version, "commit": commit, "date": date}
    if args.via:
        source["read_via"] = args.via
    return source


def build_onnxruntime(args: argparse.Namespace) -> list[Path]:
    text, commit, date = read_source(args.git, args.rev, ORT_FILE)
    written = []
    for provider, name in ORT_PROVIDERS.items():
        table = {
            "provider": provider,
            "source": _source(args, "microsoft/onnxruntime", ORT_FILE, commit, date),
            "note": "Float types (float, float16, bfloat16, double) among each kernel's type constraints, per "
                    f"opset range [since, until]; until {OPEN_END} means no upper bound. A range with no "
                    "float types is an op whose kernels take other types only. The document lists the kernels "
                    "of the build that generated it (a given wheel or later release can differ) and leaves out "
                    "kernels that declare no type constraints (NonMaxSuppression, QLinearConcat...), which "
                    "this table therefore reports as unknown.",
            "ops": parse_onnxruntime(text, provider),
        }
        written.append(_write(name, table))
    return written


def build_tensorrt(args: argparse.Namespace) -> list[Path]:
    text, commit, date = read_source(args.git, args.rev, TRT_FILE)
    rows, unsupported = parse_tensorrt(text)
    stated = re.search(r"inclusive range of opset (\d+) to opset (\d+)", text)
    ops = rows["ai.onnx"]
    table = {
        "provider": "TensorrtExecutionProvider",
        "source": _source(args, "onnx/onnx-tensorrt", TRT_FILE, commit, date),
        "note": "TensorRT's ONNX parser support matrix. It lists no opset ranges, so every op spans "
                f"[1, {OPEN_END}]; the document states the opsets it supports in 'stated_opsets'. An op "
                "with no types is one TensorRT does not import; DequantizeLinear lists its quantized input "
                "types only, so it has none either. TensorRT runs a layer in the ONNX types "
                "of a strongly typed network; 'fp16_native' and 'bf16_native' list the ops whose layer "
                "takes that type.",
        "stated_opsets": [int(stated[1]), int(stated[2])] if stated else None,
        "fp16_native": sorted(op for op, spans in ops.items() if "float16" in spans[0][2]),
        "bf16_native": sorted(op for op, spans in ops.items() if "bfloat16" in spans[0][2]),
        "unsupported": unsupported,
        "ops": rows,
    }
    return [_write("tensorrt.json", table)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", choices=("onnxruntime", "tensorrt"))
    parser.add_argument("--git", type=Path, required=True, help="checkout or bare mirror of the source repo")
    parser.add_argument("--rev", required=True, help="commit, tag or branch to read the document at")
    parser.add_argument("--version", required=True, help="release the revision belongs to, as recorded")
    parser.add_argument("--repo", help="owner/name recorded as the source (default: the upstream repo)")
    parser.add_argument("--via", help="where the commit was read when --git is not the upstream repo itself "
                                      "(a fork or mirror that carries the upstream commit), recorded as is")
    args = parser.parse_args(argv)
    try:
        written = (build_onnxruntime if args.source == "onnxruntime" else build_tensorrt)(args)
    except (ParseError, subprocess.CalledProcessError) as err:
        detail = err.stderr.strip() if isinstance(err, subprocess.CalledProcessError) else str(err)
        print(f"kernel_tables: {detail}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
