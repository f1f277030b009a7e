"""The ``amppass`` command: convert an ONNX model to mixed precision, and report on a converted model.

Both commands write report files with ``--report FILE``, HTML or JSON by the file's extension.
Exit codes: 0 done; 1 a file or model amppass cannot use, or a conversion that failed; 2 a command line
that does not parse (unknown option or dtype, a report file that is neither .html nor .json, output path
equal to the input path without ``--force``, two outputs naming one file, a report file that is the input).
Every error is one line on stderr naming the file and the problem; no output file is left behind. An output
that is a symbolic link is followed: the file it points to is replaced, the link stays
(:mod:`amppass.files`, rule 6).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import re
import sys
import traceback
import zipfile
from typing import TYPE_CHECKING, Any, Iterator, NoReturn, Sequence

from ._version import __version__
from .errors import AmpPassError
from .files import Staged, check_writable, resolved
from .reporting.rows import PRECISION_FILTERS

# numpy, onnx, torch and everything that imports them load inside the commands, so that ``amppass --help``
# and a usage error answer at once (tests/test_cli_startup.py keeps it so)
if TYPE_CHECKING:
    import numpy as np
    import onnx

    from .reporting.report import Report

log = logging.getLogger(__name__)

# amppass.targets.ONNX_TARGETS and TORCH_TARGETS, spelled here because importing amppass.targets imports torch;
# tests/test_cli_startup.py checks that they are the same
ONNX_TARGETS = ("cpu", "cuda", "tensorrt")
TORCH_TARGETS = ("cpu", "cuda")

_CALIB_HELP = (
    "calibration feeds: a .npz (numpy.savez) with one array per model input, named after the input. "
    "An array with the input's rank is one batch; one with an extra leading axis is a list of batches "
    "(arr[i] is batch i); every array must hold the same number of batches"
)
_REPORT_HELP = "write the report to FILE: HTML for .html/.htm, JSON for .json (give several files for both)"
_EPILOG = (
    "examples:\n"
    "  amppass convert model.onnx -o model.fp16.onnx --dtype fp16 --report report.html\n"
    "  amppass convert model.onnx -o model.fp16.onnx --calib feeds.npz --tolerance 1e-2\n"
    "  amppass convert model.onnx -o model.bf16.onnx --dtype bf16 --target cuda --low-weight-tables\n"
    "  amppass convert model.onnx -o model.fp8.onnx --dtype fp8 --calib feeds.npz --target tensorrt\n"
    "  amppass report model.fp16.onnx --precision fp32 --by-op\n"
    "  amppass report model.fp16.onnx --report report.json\n"
    "  amppass convert model.pt2 -o model.bf16.pt2 --dtype bf16   # a program saved by torch.export.save\n"
    "  amppass convert model.pt2 -o model.fp8.pt2 --dtype fp8 --target cuda\n\n"
    "exit codes: 0 done, 1 a file or model that cannot be used or a failed conversion, 2 a bad command line"
)
_FORMATS = {".html": "html", ".htm": "html", ".json": "json"}
# what the compressed arrays of a --calib file may inflate to: this many bytes, or this many times their compressed
# size, whichever is more (numpy.savez stores arrays uncompressed; savez_compressed of real data shrinks them a
# few times, of masks and padding far more)
MAX_FEEDS_INFLATED, MAX_FEEDS_RATIO = 64 << 20, 100


class UsageError(Exception):
    """A command line amppass will not run (exit code 2)."""


class FileProblem(Exception):
    """A file or model the command cannot use, or a conversion that failed (exit code 1)."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors, so every failure reads the same."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


class _Renamed(argparse.Action):
    """``--json`` / ``--html`` of earlier versions: a usage error that gives today's spelling."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        raise UsageError(f"{option_string} is now --report (the file's extension picks HTML or JSON): "
                         f"--report {values}")


def build_parser() -> argparse.ArgumentParser:
    """The ``amppass`` argument parser with its ``convert`` and ``report`` commands."""
    parser = _Parser(prog="amppass", description="Mixed-precision conversion of ONNX models, with a per-node "
                     "report of every precision decision.", epilog=_EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"amppass {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the conversion does")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback behind an error (also AMPPASS_DEBUG=1)")
    commands = parser.add_subparsers(dest="command", metavar="{convert,report}")

    convert = commands.add_parser("convert", help="convert an ONNX model to fp16, bf16 or fp8",
                                  description="Convert an ONNX model to mixed precision and write the result.")
    convert.add_argument("model", help="the fp32 ONNX model (.onnx), or a torch.export program (.pt2)")
    convert.add_argument("-o", "--output", required=True, help="where to write the converted model")
    convert.add_argument("--dtype", choices=("fp16", "bf16", "auto", "fp8"), default="fp16",
                         help="low-precision dtype (default fp16; auto is fp16, what every target runs fastest: "
                         "onnxruntime's CPU provider has no bf16 MatMul); fp8: the fp16 plan (bf16 for a .pt2 "
                         "program) with the matrix products the output error allows in e4m3, each with its scales "
                         "in the report; an ONNX model needs --calib (static activation scales; --tolerance "
                         "defaults to 2e-2), a .pt2 program for --target cpu needs --plan-for coverage")
    convert.add_argument("--target", choices=ONNX_TARGETS, default="cpu",
                         help="where the model will run: onnxruntime's CPU provider (default), its CUDA "
                         "provider, or TensorRT; decides which ops have low-precision kernels and how "
                         "--tolerance judges error (run here for cpu, simulated for the GPU targets)")
    convert.add_argument("--calib", metavar="FEEDS.npz", help=_CALIB_HELP)
    convert.add_argument("--tolerance", type=float, metavar="X",
                         help="with --calib: the largest relative output error ||out - out_fp32|| / ||out_fp32|| "
                         "allowed over the feeds; the most sensitive nodes move back to fp32 until it is met")
    _report_options(convert)
    convert.add_argument("--keep-fp32", nargs="+", default=[], metavar="PATTERN",
                         help="op types or node-name regexes to keep in fp32")
    convert.add_argument("--force-low", nargs="+", default=[], metavar="PATTERN",
                         help="op types or node-name regexes to run in low precision regardless of the policy")
    convert.add_argument("--low-weight-tables", action="store_true",
                         help="store tables read only by lookups (embedding Gathers) in low precision even where "
                         "they feed fp32 work: half their bytes, at the cost of rounding them")
    convert.add_argument("--keep-io-types", action=argparse.BooleanOptionalAction, default=True,
                         help="keep float32 inputs and outputs float32 (default); --no-keep-io-types gives the "
                         "model low-precision floating outputs")
    convert.add_argument("--plan-for", choices=("speed", "coverage"), default=None,
                         help="a .pt2 program only: speed (default) keeps fp32 what runs no faster low on this "
                         "machine; coverage runs low every op the numerics allow, the same plan on every machine "
                         "(needed for --dtype fp8 --target cpu: CPUs have no fp8 arithmetic)")
    convert.add_argument("--force", action="store_true", help="allow the output to overwrite the input model")

    report = commands.add_parser("report", help="show the precision report stored in a converted model",
                                 description="Show the per-node report read back from a converted model.")
    report.add_argument("model", help="an ONNX model (or .pt2 program) written by amppass convert")
    _report_options(report)
    report.add_argument("--precision", nargs="+", default=[], choices=PRECISION_FILTERS, metavar="P",
                        help="list only nodes in these precisions: fp8, fp16, bf16, fp32, low (any of those "
                        "below fp32), none (no floating-point work)")
    report.add_argument("--op", nargs="+", default=[], metavar="OP",
                        help="list only nodes running these ops (case-insensitive: Add, MatMul)")
    report.add_argument("--by-op", action="store_true", help="one line per op: nodes in each precision, MACs")
    report.add_argument("--rows", type=int, default=None, metavar="N", help="show only the first N rows")
    for command in (convert, report):
        command.add_argument("--trust-pickle", action="store_true",
                             help="read a .pt2 file whose author you trust as torch.export.load does: pickles, "
                             "compiled code and expressions in it run (without it such files are refused)")
    return parser


def _report_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--report", nargs="+", action="extend", default=[], metavar="FILE", help=_REPORT_HELP)
    for old in ("--json", "--html"):
        command.add_argument(old, action=_Renamed, help=argparse.SUPPRESS)


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
        if _debugging(args):  # the chain down to the library's or torch's own error
            traceback.print_exception(error, file=sys.stderr)
        return _fail(1, str(error))
    except KeyboardInterrupt:
        return _fail(130, "interrupted")
    except Exception as error:  # the CLI's promise: one line, no traceback, unless asked for it
        if _debugging(args):
            raise
        where = f"{args.model}: " if args is not None and getattr(args, "model", None) else ""
        return _fail(
            1, f"{where}unexpected {type(error).__name__}: {_one_line(error)} (rerun with --debug for details)"
        )


def _debugging(args: argparse.Namespace | None) -> bool:
    """``--debug`` or ``AMPPASS_DEBUG=1``: show the full traceback behind an error."""
    return (args is not None and args.debug) or os.environ.get("AMPPASS_DEBUG", "").strip() not in ("", "0")


def _convert(args: argparse.Namespace) -> int:
    if _is_program(args.model):
        return _convert_program(args)
    if args.plan_for is not None:
        raise UsageError(f"--plan-for {args.plan_for}: an ONNX plan does not time its ops on this machine (it is the "
                         "same for every machine already); --plan-for applies to a .pt2 program")
    if args.dtype == "fp8" and not args.calib:
        raise UsageError("--dtype fp8 needs --calib FEEDS.npz: the scales of the activations an fp8 product reads "
                         "are static, set from the ranges calibration observes; or convert with --dtype fp16")
    from .dtypes import fp8_format
    from .pipelines.convert_onnx import OnnxPlanOptions, convert_onnx_streamed, converted_dtype, fp8_tolerance
    from .targets import onnx_target

    _check_outputs(args.model, args.output, args.report, args.force)
    _check_report_formats(args.report)
    for path in (args.output, *args.report):
        _check_writable(path)
    loaded = _load_onnx(args.model)
    model = loaded.model
    feeds = _load_feeds(args.calib, model) if args.calib else None
    if args.tolerance is not None and feeds is None:
        raise UsageError("--tolerance needs --calib FEEDS.npz: the output error is measured on those feeds")
    fp8 = fp8_format(args.dtype)  # an fp8 plan is the fp16 plan with products lowered further
    tolerance = args.tolerance if fp8 is None else fp8_tolerance(feeds, args.tolerance)
    target = onnx_target(args.target, "fp16" if fp8 else args.dtype)  # "auto": fp16, what every target runs fastest
    dtype, previous = target.low.name, converted_dtype(model)
    if previous is None:  # a converted model is returned unchanged or refused, saying why
        _check_target_runs(model, args.target, dtype)
    options = OnnxPlanOptions(keep_fp32=args.keep_fp32, force_low=args.force_low,
                              low_weight_tables=args.low_weight_tables, keep_io_types=args.keep_io_types,
                              calibration=feeds, tolerance=tolerance,
                              progress=feeds is not None and sys.stderr.isatty())
    if previous == ("fp8" if fp8 else dtype):  # convert_onnx returns it unchanged, with a log warning
        print(f"{args.model}: already converted by amppass to {previous}; writing it unchanged")
    try:  # the model read once: external data memory-mapped, payloads streamed to the output
        converted = convert_onnx_streamed(loaded, target, options, fp8)
    except AmpPassError as error:
        raise FileProblem(f"{args.model}: {_one_line(error)}") from error
    report = _read_report(converted.model, args.model)
    with _writing() as staged:  # every output lands, or none does and the user's files stay as they were
        converted.stage(staged, args.output)
        for path, text in _report_files(report, args.report, args.model).items():
            staged.write(path, text)
    from .reporting.terminal import summary_panel

    _console().print(summary_panel(report))
    for path in (args.output, *args.report):
        print(f"wrote {path}")
    return 0


def _report(args: argparse.Namespace) -> int:
    _check_outputs(args.model, None, args.report, False)
    _check_report_formats(args.report)
    for path in args.report:
        _check_writable(path)
    model = _load_program(args.model, args.trust_pickle) if _is_program(args.model) else _load_onnx(args.model).model
    report = _read_report(model, args.model)
    with _writing() as staged:
        for path, text in _report_files(report, args.report, args.model).items():
            staged.write(path, text)
    from .reporting.terminal import render

    _console().print(render(report, precision=args.precision, op=args.op, by_op=args.by_op, max_rows=args.rows))
    for path in args.report:
        print(f"wrote {path}")
    return 0


def _convert_program(args: argparse.Namespace) -> int:
    """``amppass convert model.pt2 -o out.pt2``: a torch.export program through amppass.convert and amppass.save."""
    import amppass

    _check_outputs(args.model, args.output, args.report, args.force)
    if not args.output.endswith(".pt2"):
        raise UsageError(f"{args.output}: a converted program is written as a torch.export program; name it .pt2")
    if args.calib or args.tolerance is not None:
        raise UsageError("--calib and --tolerance read ONNX feeds; for a .pt2 program calibrate in Python with "
                         "amppass.convert(torch.export.load(path), calibration=batches)")
    if args.target not in TORCH_TARGETS:
        raise UsageError(f"--target {args.target}: a torch program runs on {' or '.join(TORCH_TARGETS)}")
    if args.dtype == "fp8" and args.target == "cpu" and args.plan_for != "coverage":
        raise UsageError("--dtype fp8 --target cpu: CPUs have no fp8 arithmetic, so an fp8 program runs slower "
                         "there than fp32 and is for testing the numerics only: add --plan-for coverage to convert "
                         "it anyway, or convert with --dtype bf16 for a fast CPU model, or --target cuda for a GPU "
                         "of compute capability 8.9 or later")
    _check_report_formats(args.report)
    for path in (args.output, *args.report):
        _check_writable(path)
    program = _load_program(args.model, args.trust_pickle)
    from .pipelines.serialize import stage

    try:
        converted = amppass.convert(program, dtype=args.dtype, target=args.target, keep_fp32=args.keep_fp32,
                                    force_low=args.force_low, low_weight_tables=args.low_weight_tables,
                                    keep_io_types=args.keep_io_types, plan_for=args.plan_for or "speed")
        report = amppass.report(converted)
        with _writing() as staged:  # the program and its reports land together, or none does
            stage(staged, converted, args.output)
            for path, text in _report_files(report, args.report, args.model).items():
                staged.write(path, text)
    except AmpPassError as error:
        raise FileProblem(f"{args.model}: {_one_line(error)}") from error
    from .reporting.terminal import summary_panel

    _console().print(summary_panel(report))
    for path in (args.output, *args.report):
        print(f"wrote {path}")
    return 0


def _is_program(path: str) -> bool:
    return path.endswith(".pt2")


def _load_program(path: str, trusted: bool) -> Any:
    """A .pt2 file, checked as untrusted input unless ``trusted``: the converted module if amppass wrote it,
    else the program it holds."""
    from amppass.pipelines.serialize import read_file

    if not os.path.isfile(path):
        raise FileProblem(f"{path}: no such file")
    torch_log = _Recorded()
    try:
        with torch_log.of("torch.export"):
            return read_file(path, trusted=trusted)
    except AmpPassError as error:
        unregistered = re.search(r"Deserializing (\S+) in pytree is not registered", f"{torch_log.text()}\n{error}")
        if unregistered:
            kind = unregistered.group(1)
            raise FileProblem(
                f"{path}: the program's inputs or outputs hold the class {kind}, which torch.export.load rebuilds "
                "only once its module is imported, and the command line imports no module a file names; convert it "
                f"in Python: import {kind.rpartition('.')[0]}, then amppass.convert(amppass.load_program({path!r}), "
                "dtype=...)"
            ) from error
        raise FileProblem(_one_line(error)) from error


class _Recorded(logging.Handler):
    """The records of a logger while :meth:`of` holds it, kept here instead of printed."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @contextlib.contextmanager
    def of(self, name: str) -> Iterator[None]:
        logger = logging.getLogger(name)
        handlers, propagate = logger.handlers, logger.propagate  # torch sets handlers of its own on its loggers
        logger.handlers, logger.propagate = [self], False
        try:
            yield
        finally:
            logger.handlers, logger.propagate = handlers, propagate

    def text(self) -> str:
        """Every record's message and exception text."""
        return "\n".join(self.format(record) for record in self.records)


# -- checks ---------------------------------------------------------------------------------------------

def _check_report_formats(paths: Sequence[str]) -> None:
    for path in paths:
        if os.path.splitext(path)[1].lower() not in _FORMATS:
            raise UsageError(f"{path}: --report writes HTML (.html, .htm) or JSON (.json), chosen by the file's "
                             "extension; name the file report.html or report.json")


def _check_target_runs(model: onnx.ModelProto, target: str, dtype: str) -> None:
    """Refuse a dtype the target has no kernel for on any of the model's heavy ops (MatMul, Conv, ...): the
    conversion would keep all of them fp32 and write a model with nothing in that dtype. The message names the
    targets that run them. convert_onnx refuses the same (:func:`amppass.pipelines.convert_onnx.missing_low_kernels`);
    here it is a usage error in the command line's words."""
    from .pipelines.convert_onnx import missing_low_kernels
    from .targets import onnx_target

    missing = missing_low_kernels(model, target, dtype)
    if missing is None:
        return
    ops, able = missing
    where = onnx_target(target, dtype).runtime
    other = "fp16" if dtype == "bf16" else "bf16"
    fix = f"pass --target {' or --target '.join(able)} to convert for where it runs" if able else "no target runs it"
    raise UsageError(f"--dtype {dtype} --target {target}: {where} has no {dtype} kernel for {', '.join(ops)}, so "
                     f"the converted model would run all of them in fp32, with nothing in {dtype}; {fix}, or "
                     f"convert with --dtype {other}")


def _check_outputs(model: str, output: str | None, reports: Sequence[str], force: bool) -> None:
    """Refuse, before any work, outputs that name one file (the same path once links are followed, or one file
    under two names), a report file that is the input model, and ``-o`` naming the input without ``--force``."""
    named: list[tuple[str, str]] = [("-o", output)] if output is not None else []
    named += [("--report", path) for path in reports]
    if output is not None and _file_key(output) == _file_key(model) and not force:
        raise UsageError(f"{output}: output path is the input model; choose another -o or pass --force to overwrite it")
    for option, path in named[output is not None:]:
        if _file_key(path) == _file_key(model):
            raise UsageError(f"{option} {path}: that is the input model; the report would replace it. Name the "
                             "report file report.html or report.json")
    seen: dict[tuple, tuple[str, str]] = {}
    for option, path in named:
        first = seen.setdefault(_file_key(path), (option, path))
        if first != (option, path):
            raise UsageError(f"{first[0]} {first[1]} and {option} {path} name one file, and one would replace the "
                             "other; give each output its own file name")


def _file_key(path: str) -> tuple:
    """What tells two paths apart as files: device and inode where the file exists (a hard link is the same
    file), else the path with its links followed."""
    try:
        found = os.stat(path)
    except OSError:
        return ("path", resolved(path))
    return ("file", found.st_dev, found.st_ino)


def _check_writable(path: str | None) -> None:
    """Fail before any work if an output cannot be written (the library's own check, as a CLI error)."""
    if path is None:
        return
    try:
        check_writable(path)
    except AmpPassError as error:
        raise FileProblem(str(error)) from error


def _load_onnx(path: str) -> Any:
    """The model at ``path`` (external data not loaded), checked to be a valid ONNX model by onnx.checker on a
    stand-in that holds no weights (:func:`amppass.pipelines.convert_onnx.load`)."""
    from .pipelines.convert_onnx import load

    if not os.path.exists(path):
        raise FileProblem(f"{path}: no such file")
    if not os.path.isfile(path):
        raise FileProblem(f"{path}: not a file")
    try:
        return load(path, check=True)
    except AmpPassError as error:
        raise FileProblem(_one_line(error)) from error


def _load_feeds(path: str, model: onnx.ModelProto) -> list[dict[str, np.ndarray]]:
    """Calibration batches from a .npz, checked against the model's inputs (see ``--calib``).

    The file's sizes are checked from its zip directory, then every array's shape and dtype from its .npy header
    (bounded bytes), before any array is read, so a small file that would expand to gigabytes is refused without
    reading it; Python objects (pickles) are refused."""
    import numpy as np

    if not os.path.isfile(path):
        raise FileProblem(f"{path}: no such file")
    if not zipfile.is_zipfile(path):
        raise FileProblem(f"{path}: not a .npz file (write the feeds with numpy.savez)")
    declared = _declared(path)
    initializers = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]
    names = [i.name for i in inputs]
    missing = [n for n in names if n not in declared]
    extra = sorted(set(declared) - set(names))
    if missing or extra:
        problem = f"no array for model input(s) {', '.join(missing)}" if missing else \
            f"array(s) {', '.join(extra)} are not model inputs"
        raise FileProblem(f"{path}: {problem}; the model's inputs are {', '.join(names)}, "
                          f"the file's arrays {', '.join(sorted(declared)) or '(none)'}")
    counts = {value.name: _batch_count(path, value, *declared[value.name]) for value in inputs}
    if len(set(counts.values())) != 1:
        raise FileProblem(f"{path}: arrays hold different numbers of batches: "
                          + ", ".join(f"{n}={c}" for n, c in counts.items()))
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in names}
    except Exception as error:  # a truncated or damaged file
        raise FileProblem(f"{path}: not a .npz of arrays written by numpy.savez ({_one_line(error)})") from error
    batches = {value.name: _batches(value, arrays[value.name]) for value in inputs}
    return [{name: b[i] for name, b in batches.items()} for i in range(counts[names[0]])] if names else []


def _declared(path: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Array name -> (shape, dtype) from each member's .npy header; no array data is read, and the file's sizes
    are checked before any header is (:func:`_check_feed_sizes`)."""
    import numpy as np

    found = {}
    try:
        with zipfile.ZipFile(path) as archive:
            _check_feed_sizes(path, archive)
            for member in archive.infolist():
                name = member.filename[:-4] if member.filename.endswith(".npy") else member.filename
                with archive.open(member) as stream:
                    version = np.lib.format.read_magic(stream)
                    read = {(1, 0): np.lib.format.read_array_header_1_0,
                            (2, 0): np.lib.format.read_array_header_2_0}.get(version)
                    if read is None:
                        raise ValueError(f"array {name}: .npy format {version} is not one numpy.savez writes "
                                         "for numeric arrays")
                    shape, _, dtype = read(stream)
                    header = stream.tell()
                if dtype.hasobject:
                    raise ValueError(f"array {name} holds Python objects")
                if header + math.prod(shape) * dtype.itemsize != member.file_size:
                    raise ValueError(f"array {name} declares {math.prod(shape) * dtype.itemsize:,} bytes of shape "
                                     f"{tuple(shape)}, but its entry holds {member.file_size - header:,}")
                found[name] = (tuple(shape), dtype)
    except FileProblem:
        raise
    except Exception as error:  # not a zip of .npy files, a pickled object, a truncated header
        raise FileProblem(f"{path}: not a .npz of arrays written by numpy.savez ({_one_line(error)})") from error
    return found


def _check_feed_sizes(path: str, archive: zipfile.ZipFile) -> None:
    """The sizes a .npz declares, checked from its directory before anything is inflated: every entry stored or
    deflated, not encrypted, its bytes inside the file, stored ones as long as their data, all of them together no
    more bytes than the file holds (so no byte is read twice), and what compressed entries inflate to at most
    :data:`MAX_FEEDS_INFLATED` or :data:`MAX_FEEDS_RATIO` times their compressed bytes, whichever is more."""
    size = os.path.getsize(path)
    members = archive.infolist()
    for member in members:
        problem = ("is encrypted" if member.flag_bits & 0x1 else
                   f"uses compression method {member.compress_type}, not one numpy.savez writes"
                   if member.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED) else
                   "claims more bytes than the file holds" if member.header_offset + member.compress_size > size else
                   "is stored with two different sizes" if member.compress_type == zipfile.ZIP_STORED and
                   member.compress_size != member.file_size else None)
        if problem:
            raise FileProblem(f"{path}: entry {member.filename[:100]!r} {problem}; write the feeds again with "
                              "numpy.savez")
    if sum(m.compress_size for m in members) > size:
        raise FileProblem(f"{path}: its entries claim more bytes than the file holds (entries that share bytes); "
                          "write the feeds again with numpy.savez")
    packed = [m for m in members if m.compress_type == zipfile.ZIP_DEFLATED]
    inflated, limit = sum(m.file_size for m in packed), max(MAX_FEEDS_INFLATED,
                                                            MAX_FEEDS_RATIO * sum(m.compress_size for m in packed))
    if inflated > limit:
        raise FileProblem(f"{path}: its compressed arrays would inflate to {inflated:,} bytes, more than the "
                          f"{limit:,} amppass reads from {sum(m.compress_size for m in packed):,} compressed bytes; "
                          "write the feeds with numpy.savez (uncompressed) instead of numpy.savez_compressed")


def _batch_count(path: str, value: onnx.ValueInfoProto, shape: tuple[int, ...], dtype: np.dtype) -> int:
    """How many batches an array of the declared ``shape`` and ``dtype`` holds for input ``value``; a
    FileProblem if it cannot feed it."""
    import onnx

    from .onnx.view import dims as value_dims

    dims = value_dims(value)
    if len(shape) not in (len(dims), len(dims) + 1):
        raise FileProblem(f"{path}: array {value.name} has shape {shape}; the model's input has rank "
                          f"{len(dims)} (give rank {len(dims)}, or {len(dims) + 1} for a list of batches)")
    wanted = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
    if dtype.kind != wanted.kind and not (dtype.kind in "iu" and wanted.kind in "iu"):
        raise FileProblem(f"{path}: array {value.name} is {dtype}; the model's input is {wanted}")
    batch = shape[-len(dims):] if dims else ()
    if any(d is not None and d != s for d, s in zip(dims, batch, strict=False)):
        shown = ["?" if d is None else d for d in dims]
        raise FileProblem(f"{path}: array {value.name} has a batch of shape {batch}; the model's input is {shown}")
    return shape[0] if len(shape) == len(dims) + 1 else 1


def _batches(value: onnx.ValueInfoProto, array: np.ndarray) -> list[np.ndarray]:
    """``array`` (checked by :func:`_batch_count`) as a list of batches in the input's dtype."""
    import numpy as np
    import onnx

    from .onnx.view import dims as value_dims

    wanted = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
    batches = [array] if array.ndim == len(value_dims(value)) else list(array)
    return [np.ascontiguousarray(b, dtype=wanted) for b in batches]


# -- output -------------------------------------------------------------------------------------------

def _report_files(report: Report, paths: Sequence[str], model: str) -> dict[str, str]:
    """Each ``--report`` path with the report in its format (checked by :func:`_check_report_formats`)."""
    title = os.path.basename(model)
    return {path: report.to_html(title=title) if _FORMATS[os.path.splitext(path)[1].lower()] == "html"
            else report.to_json() for path in paths}


def _read_report(model: Any, path: str) -> Report:
    import amppass

    try:
        return amppass.report(model)
    except AmpPassError as error:
        raise FileProblem(f"{path}: {_one_line(error)}") from error


@contextlib.contextmanager
def _writing() -> Iterator[Staged]:
    """A :class:`~amppass.files.Staged` set of outputs; a write that fails is a FileProblem naming its file."""
    try:
        with Staged() as staged:
            yield staged
    except AmpPassError as error:
        raise FileProblem(_one_line(error)) from error


def _console():
    from rich.console import Console

    return Console()


def _fail(code: int, message: str) -> int:
    from .text import printable  # messages quote names and text from the model file

    print(f"amppass: error: {printable(message)}", file=sys.stderr)
    return code


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text[:500] + ("…" if len(text) > 500 else "")


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="amppass: %(levelname)s: %(message)s")
    # dependencies' deprecation notices are not the user's business unless they ask for detail
    logging.captureWarnings(True)
    logging.getLogger("py.warnings").setLevel(logging.INFO if verbose else logging.ERROR)
