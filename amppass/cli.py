"""The ``amppass`` command: convert an ONNX model to mixed precision, and report on a converted model.

Exit codes: 0 done; 1 a file or model amppass cannot use, or a conversion that failed; 2 a command line
that does not parse (unknown option or dtype, output path equal to the input path without ``--force``).
Every error is one line on stderr naming the file and the problem; no output file is left behind.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import zipfile
from typing import Any, NoReturn, Sequence

import numpy as np
import onnx

from . import __version__
from .errors import AmpPassError
from .report.report import Report, write_atomic

log = logging.getLogger(__name__)

_CALIB_HELP = (
    "calibration feeds: a .npz (numpy.savez) with one array per model input, named after the input. "
    "An array with the input's rank is one batch; one with an extra leading axis is a list of batches "
    "(arr[i] is batch i); every array must hold the same number of batches"
)
_EPILOG = (
    "examples:\n"
    "  amppass convert model.onnx -o model.fp16.onnx --dtype fp16 --report report.html\n"
    "  amppass convert model.onnx -o model.fp16.onnx --calib feeds.npz --tolerance 1e-2\n"
    "  amppass report model.fp16.onnx --json report.json\n"
    "  amppass convert model.pt2 -o model.bf16.pt2 --dtype bf16   # a program saved by torch.export.save\n\n"
    "exit codes: 0 done, 1 a file or model that cannot be used or a failed conversion, 2 a bad command line"
)


class UsageError(Exception):
    """A command line amppass will not run (exit code 2)."""


class FileProblem(Exception):
    """A file or model the command cannot use, or a conversion that failed (exit code 1)."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors, so every failure reads the same."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """The ``amppass`` argument parser with its ``convert`` and ``report`` commands."""
    parser = _Parser(prog="amppass", description="Mixed-precision conversion of ONNX models, with a per-node "
                     "report of every precision decision.", epilog=_EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"amppass {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the conversion does")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an unexpected error")
    commands = parser.add_subparsers(dest="command", metavar="{convert,report}")

    convert = commands.add_parser("convert", help="convert an ONNX model to fp16 or bf16",
                                  description="Convert an ONNX model to mixed precision and write the result.")
    convert.add_argument("model", help="the fp32 ONNX model (.onnx), or a torch.export program (.pt2)")
    convert.add_argument("-o", "--output", required=True, help="where to write the converted model")
    convert.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16", help="low-precision dtype (default fp16)")
    convert.add_argument("--calib", metavar="FEEDS.npz", help=_CALIB_HELP)
    convert.add_argument("--tolerance", type=float, metavar="X",
                         help="with --calib: the largest relative output error ||out - out_fp32|| / ||out_fp32|| "
                         "allowed over the feeds; the most sensitive nodes move back to fp32 until it is met")
    convert.add_argument("--report", metavar="REPORT.html", help="also write the HTML report")
    convert.add_argument("--json", metavar="REPORT.json", help="also write the JSON report")
    convert.add_argument("--keep-fp32", nargs="+", default=[], metavar="PATTERN",
                         help="op types or node-name regexes to keep in fp32")
    convert.add_argument("--force-low", nargs="+", default=[], metavar="PATTERN",
                         help="op types or node-name regexes to run in low precision regardless of the policy")
    convert.add_argument("--force", action="store_true", help="allow the output to overwrite the input model")

    report = commands.add_parser("report", help="show the precision report stored in a converted model",
                                 description="Show the per-node report read back from a converted model.")
    report.add_argument("model", help="an ONNX model (or .pt2 program) written by amppass convert")
    report.add_argument("--json", metavar="REPORT.json", help="write the report as JSON")
    report.add_argument("--html", metavar="REPORT.html", help="write the report as an HTML page")
    report.add_argument("--rows", type=int, default=None, metavar="N", help="show only the first N rows")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = build_parser()
    args = None
    try:
        args = parser.parse_args(argv)
        _configure_logging(args.verbose)
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        return _convert(args) if args.command == "convert" else _report(args)
    except UsageError as error:
        return _fail(2, str(error))
    except FileProblem as error:
        return _fail(1, str(error))
    except KeyboardInterrupt:
        return _fail(130, "interrupted")
    except Exception as error:  # the CLI's promise: one line, no traceback, unless asked for it
        if args is not None and args.debug:
            raise
        where = f"{args.model}: " if args is not None and getattr(args, "model", None) else ""
        return _fail(1, f"{where}unexpected {type(error).__name__}: {_one_line(error)} (rerun with --debug for details)")


def _convert(args: argparse.Namespace) -> int:
    from .onnx.convert import convert_onnx, converted_dtype

    if _is_program(args.model):
        return _convert_program(args)
    _check_not_input(args.model, args.output, args.force)
    for path in (args.output, args.report, args.json):
        _check_writable(path)
    model = _load_onnx(args.model)
    feeds = _load_feeds(args.calib, model) if args.calib else None
    if args.tolerance is not None and feeds is None:
        raise UsageError("--tolerance needs --calib FEEDS.npz: the output error is measured on those feeds")
    options: dict[str, Any] = {"dtype": args.dtype, "keep_fp32": args.keep_fp32, "force_low": args.force_low}
    if feeds is not None:
        options.update(calibration=feeds, tolerance=args.tolerance, progress=sys.stderr.isatty())
    if converted_dtype(model) == args.dtype:  # convert_onnx returns it unchanged, with a log warning
        print(f"{args.model}: already converted by amppass to {args.dtype}; writing it unchanged")
    try:  # from the path: weights in external files are memory-mapped, not loaded
        converted = convert_onnx(args.model, **options)
    except AmpPassError as error:
        raise FileProblem(f"{args.model}: {_one_line(error)}") from error
    report = _read_report(converted, args.model)
    outputs: dict[str, str | bytes | onnx.ModelProto] = {args.output: converted}
    if args.report:
        outputs[args.report] = report.to_html(title=os.path.basename(args.model))
    if args.json:
        outputs[args.json] = report.to_json()
    _write_all(outputs)
    from .report.terminal import summary_panel

    _console().print(summary_panel(report))
    for path in outputs:
        print(f"wrote {path}")
    return 0


def _report(args: argparse.Namespace) -> int:
    for path in (args.json, args.html):
        _check_writable(path)
    model = _load_program(args.model) if _is_program(args.model) else _load_onnx(args.model)
    report = _read_report(model, args.model)
    outputs: dict[str, str | bytes] = {}
    if args.html:
        outputs[args.html] = report.to_html(title=os.path.basename(args.model))
    if args.json:
        outputs[args.json] = report.to_json()
    _write_all(outputs)
    from .report.terminal import render

    _console().print(render(report, max_rows=args.rows))
    for path in outputs:
        print(f"wrote {path}")
    return 0


def _convert_program(args: argparse.Namespace) -> int:
    """``amppass convert model.pt2 -o out.pt2``: a torch.export program through amppass.convert and amppass.save."""
    import amppass

    _check_not_input(args.model, args.output, args.force)
    if not args.output.endswith(".pt2"):
        raise UsageError(f"{args.output}: a converted program is written as a torch.export program; name it .pt2")
    if args.calib or args.tolerance is not None:
        raise UsageError("--calib and --tolerance read ONNX feeds; for a .pt2 program calibrate in Python with "
                         "amppass.convert(torch.export.load(path), calibration=batches)")
    for path in (args.output, args.report, args.json):
        _check_writable(path)
    program = _load_program(args.model)
    try:
        converted = amppass.convert(program, dtype=args.dtype, keep_fp32=args.keep_fp32, force_low=args.force_low)
        report = amppass.report(converted)
        amppass.save(converted, args.output)
    except AmpPassError as error:
        raise FileProblem(f"{args.model}: {_one_line(error)}") from error
    outputs: dict[str, str | bytes | onnx.ModelProto] = {}
    if args.report:
        outputs[args.report] = report.to_html(title=os.path.basename(args.model))
    if args.json:
        outputs[args.json] = report.to_json()
    try:
        _write_all(outputs)
    except FileProblem:
        os.remove(args.output)
        raise
    from .report.terminal import summary_panel

    _console().print(summary_panel(report))
    for path in [args.output, *outputs]:
        print(f"wrote {path}")
    return 0


def _is_program(path: str) -> bool:
    return path.endswith(".pt2")


def _load_program(path: str) -> Any:
    """A .pt2 file: the converted module if amppass wrote it, else the program torch.export.load reads."""
    import amppass
    import torch

    if not os.path.isfile(path):
        raise FileProblem(f"{path}: no such file")
    try:
        if zipfile.is_zipfile(path) and any(n.endswith("/extra/amppass.json") for n in zipfile.ZipFile(path).namelist()):
            return amppass.load(path)
        return torch.export.load(path)
    except AmpPassError as error:
        raise FileProblem(_one_line(error)) from error
    except Exception as error:  # a zip that is not a program, a truncated file, types not registered
        raise FileProblem(f"{path}: not a torch.export program torch.export.load can read ({_one_line(error)})") from error


# -- checks ---------------------------------------------------------------------------------------------

def _check_not_input(model: str, output: str, force: bool) -> None:
    same = os.path.realpath(model) == os.path.realpath(output) or (
        os.path.exists(output) and os.path.exists(model) and os.path.samefile(model, output)
    )
    if same and not force:
        raise UsageError(f"{output}: output path is the input model; choose another -o or pass --force to overwrite it")


def _check_writable(path: str | None) -> None:
    """Fail before any work if an output cannot be written (the library's own check, as a CLI error)."""
    from .onnx.convert import check_target

    if path is None:
        return
    try:
        check_target(path)
    except AmpPassError as error:
        raise FileProblem(str(error)) from error


def _load_onnx(path: str) -> onnx.ModelProto:
    """The model at ``path`` without its external data, checked to be a well-formed ONNX model."""
    if not os.path.exists(path):
        raise FileProblem(f"{path}: no such file")
    if not os.path.isfile(path):
        raise FileProblem(f"{path}: not a file")
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as error:  # protobuf decode errors, missing external data, unreadable file
        raise FileProblem(f"{path}: not a readable ONNX model ({_one_line(error)})") from error
    if model.ir_version == 0 or not model.HasField("graph"):
        raise FileProblem(f"{path}: not an ONNX model (no IR version or graph in it)")
    try:
        onnx.checker.check_model(path)
    except (onnx.checker.ValidationError, onnx.onnx_cpp2py_export.shape_inference.InferenceError) as error:
        raise FileProblem(f"{path}: invalid ONNX model: {_one_line(error)}") from error
    return model


def _load_feeds(path: str, model: onnx.ModelProto) -> list[dict[str, np.ndarray]]:
    """Calibration batches from a .npz, checked against the model's inputs (see ``--calib``)."""
    if not os.path.isfile(path):
        raise FileProblem(f"{path}: no such file")
    if not zipfile.is_zipfile(path):
        raise FileProblem(f"{path}: not a .npz file (write the feeds with numpy.savez)")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except Exception as error:  # not a zip, a pickled object, a truncated file
        raise FileProblem(f"{path}: not a .npz of arrays written by numpy.savez ({_one_line(error)})") from error
    initializers = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]
    names = [i.name for i in inputs]
    missing = [n for n in names if n not in arrays]
    extra = sorted(set(arrays) - set(names))
    if missing or extra:
        problem = f"no array for model input(s) {', '.join(missing)}" if missing else \
            f"array(s) {', '.join(extra)} are not model inputs"
        raise FileProblem(f"{path}: {problem}; the model's inputs are {', '.join(names)}, "
                          f"the file's arrays {', '.join(sorted(arrays)) or '(none)'}")
    batches: dict[str, list[np.ndarray]] = {}
    for value in inputs:
        batches[value.name] = _batches(path, value, arrays[value.name])
    counts = {len(b) for b in batches.values()}
    if len(counts) != 1:
        raise FileProblem(f"{path}: arrays hold different numbers of batches: "
                          + ", ".join(f"{n}={len(b)}" for n, b in batches.items()))
    return [{name: b[i] for name, b in batches.items()} for i in range(counts.pop())]


def _batches(path: str, value: onnx.ValueInfoProto, array: np.ndarray) -> list[np.ndarray]:
    tensor = value.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
    if array.ndim == len(dims):
        batches = [array]
    elif array.ndim == len(dims) + 1:
        batches = list(array)
    else:
        raise FileProblem(f"{path}: array {value.name} has shape {array.shape}; the model's input has rank "
                          f"{len(dims)} (give rank {len(dims)}, or {len(dims) + 1} for a list of batches)")
    wanted = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
    if array.dtype.kind != wanted.kind and not (array.dtype.kind in "iu" and wanted.kind in "iu"):
        raise FileProblem(f"{path}: array {value.name} is {array.dtype}; the model's input is {wanted}")
    for batch in batches:
        if any(d is not None and d != s for d, s in zip(dims, batch.shape)):
            shown = ["?" if d is None else d for d in dims]
            raise FileProblem(f"{path}: array {value.name} has a batch of shape {batch.shape}; "
                              f"the model's input is {shown}")
    return [np.ascontiguousarray(b, dtype=wanted) for b in batches]


# -- output -------------------------------------------------------------------------------------------

def _read_report(model: Any, path: str) -> Report:
    import amppass

    try:
        return amppass.report(model)
    except AmpPassError as error:
        raise FileProblem(f"{path}: {_one_line(error)}") from error


def _write_all(outputs: dict[str, str | bytes | onnx.ModelProto]) -> None:
    """Write every output atomically (a model through :func:`amppass.onnx.convert.save`, with external data
    when it is over 2 GB); if one fails, remove those already written by this run."""
    from .onnx.convert import save

    written: list[str] = []
    try:
        for path, data in outputs.items():
            if isinstance(data, onnx.ModelProto):
                data_file, existed = path + ".data", os.path.exists(path + ".data")
                save(data, path)
                written += [path] + ([data_file] if os.path.exists(data_file) and not existed else [])
            else:
                write_atomic(path, data)
                written.append(path)
    except OSError as error:
        for path in written:
            if os.path.exists(path):
                os.remove(path)
        raise FileProblem(f"{error.filename or path}: cannot write: {error.strerror or error}") from error


def _console():
    from rich.console import Console

    return Console()


def _fail(code: int, message: str) -> int:
    print(f"amppass: error: {message}", file=sys.stderr)
    return code


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text[:500] + ("…" if len(text) > 500 else "")


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="amppass: %(levelname)s: %(message)s")
    # dependencies' deprecation notices are not the user's business unless they ask for detail
    logging.captureWarnings(True)
    logging.getLogger("py.warnings").setLevel(logging.INFO if verbose else logging.ERROR)
