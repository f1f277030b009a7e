"""A .pt2 archive (a torch.export program) read as untrusted input: nothing in it runs, nothing unbounded inflates.

``torch.export.load`` (torch 2.13, ``torch/export/pt2_archive/_package.py`` and ``torch/_export/serde/``)
runs code from the file in three ways, and :class:`Pt2Archive` refuses each before torch reads the file:

- pickles: a weight or tensor constant flagged ``use_pickle`` in ``data/weights/model_weights_config.json`` or
  ``data/constants/model_constants_config.json`` is read with ``torch.load(weights_only=False)``; a constant
  file named ``custom_obj_*`` goes through TorchScript's unpickler and ``opaque_obj_*`` through
  ``pickle.loads``; ``data/sample_inputs/model.pt`` (and the legacy ``data/weights/model.pt``) is read with
  ``weights_only=True`` and, when that fails, again with ``weights_only=False``; so is the torch 2.7 layout
  torch falls back to when an archive does not load.
- native code: ``data/aotinductor/`` holds a shared library that torch loads with the program.
- Python expressions: each symbolic size in ``models/model.json`` (``expr_str``) goes through
  ``sympy.sympify``, which evaluates it.

(A node's call target is looked up by name from ``torch``, ``math`` or ``operator``; torch's own verifier then
refuses any that is not an operator, when the program is built.)

Rules:

1. **One open file.** The file is opened once (without blocking, a regular file only); the checks and torch
   read that open file, so a file renamed into its place in between is never read. torch's own zip reader
   (which looks names up ignoring case) lists the entries the checks read, and Python's zipfile (torch's
   fallback reader) must list the same.
2. **Sizes first.** Before any entry is inflated its zip header is checked: its bytes lie inside the file, a
   stored entry is as long as its data, a compressed one inflates to at most :data:`MAX_INFLATED`, a JSON
   entry is at most :data:`MAX_JSON` and an extra file :data:`MAX_EXTRA` (torch reads every extra file);
   compressed entries together, and extra files together, at most :data:`MAX_HELD`.
3. **Names.** One root folder, printable ASCII, no two names equal ignoring case, and every entry one that
   ``torch.export.save`` writes for a single program: the program's JSON, weight and tensor-constant files,
   their configs, the sample inputs, extra files and the format markers. Anything else is refused.
4. **Payloads.** Every config entry is a tensor (``use_pickle`` false, a tensor description, a tensor file of
   the archive); the sample inputs load with ``weights_only=True`` here, their own archive checked as in rule 2.
5. **Expressions.** Each ``expr_str`` is arithmetic on size symbols with the functions torch's serializer
   writes (:data:`SYMPY_NAMES`): no attribute access, subscripts or strings, small exponents.
6. **Trusted files.** ``trusted=True`` (CLI ``--trust-pickle``), which only the user can type, skips rules 3-5:
   torch then reads the file as ``torch.export.load`` does, pickles included.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import stat
import zipfile
from typing import Any, Iterator

from .errors import InputError, first_line

log = logging.getLogger(__name__)

MAX_INFLATED = 64 << 20  # a compressed entry (torch.export.save stores every entry uncompressed)
MAX_JSON = 256 << 20  # the program's JSON and the payload configs: parsing takes several times this
MAX_EXTRA = 16 << 20  # each extra file: torch reads every one into memory
MAX_HELD = 256 << 20  # all compressed entries, and all extra files, together: torch holds them at once
MAX_DEPTH = 64  # JSON nesting amppass accepts in an entry it reads itself
MAX_EXPRESSION = 4096  # characters of one symbolic-size expression
TRUST_HINT = ("If you trust the file's author, load it with amppass.load(path, trusted=True) "
              "(CLI: --trust-pickle), which lets torch run what the file holds")

_FIXED = {"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id",
          "models/model.json", "data/weights/model_weights_config.json",
          "data/constants/model_constants_config.json", "data/sample_inputs/model.pt"}
_PATTERNS = [re.compile(p) for p in (r"data/weights/weight_\d+", r"data/constants/tensor_\d+",
                                     r"extra/[A-Za-z0-9._-]+")]
_CONFIGS = {"data/weights/model_weights_config.json": ("data/weights/", "weight_"),
            "data/constants/model_constants_config.json": ("data/constants/", "tensor_")}
_SAMPLE_INPUTS = "data/sample_inputs/model.pt"
_JSON_NAMES = {"models/model.json", *_CONFIGS, "archive_format", "archive_version", "byteorder", ".data/version",
               ".data/serialization_id"}

# names a symbolic-size expression may call or name besides size symbols: the functions torch's deserializer
# gives sympify (GraphModuleDeserializer.sympy_functions) and the sympy classes srepr() writes for sizes
SYMPY_NAMES = frozenset({
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "Mod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv",
    "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv", "IsNonOverlappingAndDenseIndicator",
    "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "Identity",
    "Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Max", "Min", "Abs", "floor", "ceiling",
    "Equality", "Unequality", "StrictLessThan", "LessThan", "StrictGreaterThan", "GreaterThan", "Eq", "Ne", "Lt",
    "Le", "Gt", "Ge", "And", "Or", "Not", "Piecewise", "ExprCondPair", "ITE", "sqrt", "oo", "zoo", "nan", "true",
    "false", "Half", "One", "Zero", "NegativeOne", "Infinity", "NegativeInfinity", "NaN", "BooleanTrue",
    "BooleanFalse",
})
_KEYWORDS = frozenset({"positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite",
                       "infinite", "zero", "nonzero", "even", "odd", "rational", "extended_real", "commutative",
                       "precision", "evaluate"})
_SYMBOL = re.compile(r"[a-z]+\d+")
_NUMBER_TEXT = re.compile(r"[-+]?\d{1,40}(\.\d{0,40})?(e[-+]?\d{1,3})?")
_POWERS = ("Pow", "PowByNatural", "FloatPow")
# sympy evaluates numbers as it parses: a numeric exponent at most MAX_EXPONENT, at most MAX_POWERS powers and
# MAX_DIGITS digits a number keep the largest value it can build near 10**160000
MAX_EXPONENT, MAX_POWERS, MAX_DIGITS = 16, 3, 40


class Pt2Archive:
    """An open .pt2 file, checked (module docstring), that torch then reads from the same open file.

    Use as a context manager; ``entries`` are the names under the archive's root folder.
    """

    def __init__(self, path: str | os.PathLike, trusted: bool = False):
        self.path = os.fspath(path)
        self.handle = _open_regular(self.path)
        try:
            self._zip = self._python_zip()
            self._check_headers(self._zip, self.path)
            self.root, self.entries = self._names()
            self._reader = self._torch_reader()
            if not trusted:
                self._check_manifest()
        except BaseException:
            self.handle.close()
            raise

    def __enter__(self) -> "Pt2Archive":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handle.close()

    def has(self, name: str) -> bool:
        return name in self.entries

    def read(self, name: str, limit: int) -> bytes:
        """Entry ``name`` as torch reads it, refused when its header says more than ``limit`` bytes."""
        size = self.entries[name].file_size
        if size > limit:
            raise InputError(f"{self.path}: entry {name!r} would inflate to {size:,} bytes, more than the "
                             f"{limit:,} amppass reads there; the file is damaged or crafted: save the model again")
        data = self._reader.get_record(name)
        if len(data) > limit:  # torch's reader disagrees with the header Python read
            raise InputError(f"{self.path}: entry {name!r} holds more than its header says; the file is crafted")
        return data

    def read_json(self, name: str, limit: int) -> Any:
        """Entry ``name`` parsed as JSON (bounded, at most :data:`MAX_DEPTH` deep); InputError naming it."""
        return parse_json(self.read(name, limit), f"{self.path}: entry {name!r}")

    def load(self, extra_files: dict[str, str] | None = None) -> Any:
        """The ``ExportedProgram`` torch reads from the checked file."""
        import torch

        self.handle.seek(0)
        with _torch_log_as_debug() as records:
            try:
                program = torch.export.load(self.handle, extra_files=extra_files)
            except Exception as err:  # noqa: BLE001 - any failure of torch's reader on a damaged archive
                cause = records[0].exc_info[1] if records and records[0].exc_info else err
                raise InputError(f"{self.path}: torch.export.load cannot read it ({type(cause).__name__}: "
                                 f"{first_line(cause, 300)}); give a .pt2 file torch.export.save or amppass.save "
                                 "wrote, read with the torch version that wrote it") from cause
        return program

    # -- checks ----------------------------------------------------------------------------------------

    def _python_zip(self) -> zipfile.ZipFile:
        try:
            return zipfile.ZipFile(self.handle)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as err:
            raise InputError(f"{self.path}: not a torch.export program file (not a zip archive: {first_line(err, 300)}); "
                             "give a .pt2 file torch.export.save or amppass.save wrote") from None

    def _check_headers(self, archive: zipfile.ZipFile, where: str) -> None:
        """Rule 2 on every entry of ``archive``, before anything is inflated."""
        archive.fp.seek(0, os.SEEK_END)
        total = archive.fp.tell()
        held = {"compressed entries": 0, "extra files": 0}
        for info in archive.infolist():
            problem = None
            if info.flag_bits & 0x1:
                problem = "is encrypted"
            elif info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                problem = f"uses compression method {info.compress_type}, which torch's reader does not read"
            elif info.header_offset + info.compress_size > total:
                problem = "claims more bytes than the file holds"
            elif info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
                problem = "is stored uncompressed with two different sizes"
            elif info.compress_type != zipfile.ZIP_STORED and info.file_size > MAX_INFLATED:
                problem = f"would inflate to {info.file_size:,} bytes (at most {MAX_INFLATED:,} for a compressed entry)"
            if problem is None:
                name = info.filename.partition("/")[2]
                limit = MAX_JSON if name in _JSON_NAMES else MAX_EXTRA if name.startswith("extra/") else None
                if limit is not None and info.file_size > limit:
                    problem = f"would inflate to {info.file_size:,} bytes, more than the {limit:,} read there"
                held["compressed entries"] += info.file_size * (info.compress_type != zipfile.ZIP_STORED)
                held["extra files"] += info.file_size * name.startswith("extra/")
                many = next((kind for kind, size in held.items() if size > MAX_HELD), None)
                if problem is None and many:
                    problem = f"brings its {many} past {MAX_HELD:,} bytes in all"
            if problem:
                name = info.filename.partition("/")[2] or info.filename
                raise InputError(f"{where}: entry {name!r} {problem}; the file is damaged or crafted: "
                                 "save the model again")

    def _names(self) -> tuple[str, dict[str, zipfile.ZipInfo]]:
        """The root folder and the entries under it, by name (rule 3's form checks)."""
        infos = self._zip.infolist()
        if not infos:
            raise InputError(f"{self.path}: an empty zip archive, not a torch.export program")
        root = infos[0].filename.partition("/")[0]
        entries, folded = {}, set()
        for info in infos:
            name = info.filename
            head, slash, rest = name.partition("/")
            if not name.isascii() or not name.isprintable() or head != root or not slash or not rest:
                raise InputError(f"{self.path}: entry {name!r} is not a file under the archive's folder {root!r}; "
                                 f"torch.export.save writes every entry there. {TRUST_HINT}")
            if name.lower() in folded:
                raise InputError(f"{self.path}: entry {name!r} is in the archive twice (names compared ignoring "
                                 "case, as torch's reader looks them up); the file is crafted: save the model again")
            folded.add(name.lower())
            entries[rest] = info
        return root, entries

    def _torch_reader(self) -> Any:
        import torch

        self.handle.seek(0)
        try:
            reader = torch._C.PyTorchFileReader(self.handle)
            listed = set(reader.get_all_records())
        except Exception as err:  # noqa: BLE001 - torch's reader refuses the zip
            raise InputError(f"{self.path}: torch cannot read it as an archive ({first_line(err, 300)}); give a .pt2 "
                             "file torch.export.save or amppass.save wrote") from None
        if listed != set(self.entries):
            differ = sorted(listed.symmetric_difference(self.entries))[:3]
            raise InputError(f"{self.path}: torch's zip reader and Python's list different entries ({differ}); "
                             "the file is crafted: save the model again")
        return reader

    def _check_manifest(self) -> None:
        """Rules 3-5: only entries torch.export.save writes, tensors only, plain size expressions."""
        for name in self.entries:
            if name not in _FIXED and not any(p.fullmatch(name) for p in _PATTERNS):
                why = ("holds a compiled AOTInductor library that torch would load and run"
                       if name.startswith("data/aotinductor/") else "is not an entry amppass can vouch for")
                raise InputError(f"{self.path}: entry {name!r} {why}; amppass reads only programs as "
                                 f"torch.export.save writes them. {TRUST_HINT}")
        for config, (folder, prefix) in _CONFIGS.items():
            if self.has(config):
                self._check_payloads(config, folder, prefix)
        if self.has(_SAMPLE_INPUTS) and self.entries[_SAMPLE_INPUTS].file_size:
            self._check_sample_inputs()
        if self.has("models/model.json"):
            for text in _expressions(self.read_json("models/model.json", MAX_JSON)):
                check_expression(text, f"{self.path}: entry 'models/model.json'")

    def _check_payloads(self, config: str, folder: str, prefix: str) -> None:
        where = f"{self.path}: entry {config!r}"
        payloads = self.read_json(config, MAX_JSON)
        table = payloads.get("config") if isinstance(payloads, dict) else None
        if not isinstance(table, dict):
            raise InputError(f"{where} is not a payload config (an object with a 'config' object); the file is "
                             "damaged: save the model again")
        for fqn, meta in table.items():
            path = meta.get("path_name") if isinstance(meta, dict) else None
            if not isinstance(path, str):
                raise InputError(f"{where}: {str(fqn)[:80]!r} names no payload file; the file is damaged")
            if meta.get("use_pickle") is not False or not path.startswith(prefix):
                raise InputError(f"{where}: {str(fqn)[:80]!r} is stored as a pickle ({folder}{path[:80]}), "
                                 f"which torch would unpickle with weights_only=False and so run code the file "
                                 f"holds; amppass loads tensors only. {TRUST_HINT}")
            if not isinstance(meta.get("tensor_meta"), dict) or not self.has(folder + path):
                raise InputError(f"{where}: {str(fqn)[:80]!r} has no tensor description or no file "
                                 f"{folder}{path[:80]!r} in the archive; the file is damaged: save the model again")

    def _check_sample_inputs(self) -> None:
        import torch

        data = self.read(_SAMPLE_INPUTS, MAX_JSON)
        where = f"{self.path}: entry {_SAMPLE_INPUTS!r}"
        try:
            nested = zipfile.ZipFile(io.BytesIO(data))
        except (zipfile.BadZipFile, ValueError, EOFError) as err:
            raise InputError(f"{where} is not a torch.save archive ({first_line(err, 300)}); the file is damaged") from None
        self._check_headers(nested, where)
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception as err:  # noqa: BLE001 - torch would retry this with weights_only=False
            named = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
            what = f"it names {named.group(1)}" if named else f"{type(err).__name__}"
            raise InputError(f"{where} holds objects other than tensors ({what}), which torch would unpickle with "
                             f"weights_only=False. {TRUST_HINT}") from None


def parse_json(data: bytes, where: str) -> Any:
    """``data`` as UTF-8 JSON at most :data:`MAX_DEPTH` deep; InputError naming ``where`` otherwise."""
    try:
        value = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise InputError(f"{where} is not UTF-8 JSON ({type(err).__name__}: {first_line(err, 80)}); the file is "
                         "damaged or was edited: save the model again") from None
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if depth > MAX_DEPTH:
            raise InputError(f"{where} nests deeper than {MAX_DEPTH} levels; the file is damaged or crafted")
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        pending.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return value


def check_expression(text: str, where: str) -> None:
    """Rule 5: ``text`` is arithmetic sympify may evaluate; InputError naming it otherwise.

    The text is parsed (never run) as a Python expression: calls of :data:`SYMPY_NAMES` with size symbols,
    numbers (strings only for a symbol's name or a number) and operators; no attribute access, subscripts,
    other names or big exponents.
    """
    import ast

    def refuse(why: str) -> InputError:
        return InputError(f"{where}: symbolic size {text[:80]!r} {why}; torch would evaluate it as Python "
                          f"(sympy.sympify). {TRUST_HINT}")

    if len(text) > MAX_EXPRESSION:
        raise refuse(f"is longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise refuse("is not an expression") from None
    operators = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Compare, ast.BoolOp, ast.Tuple, ast.operator,
                 ast.unaryop, ast.cmpop, ast.boolop, ast.Load)
    powers = 0
    for node in ast.walk(tree):
        powers += (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow)) or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _POWERS)
        if powers > MAX_POWERS:
            raise refuse(f"holds more than {MAX_POWERS} powers")
        if isinstance(node, ast.Name):
            if node.id not in SYMPY_NAMES and not _SYMBOL.fullmatch(node.id):
                raise refuse(f"names {node.id!r}, neither a size symbol nor a function torch's serializer writes")
        elif isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name):
                raise refuse("calls something other than a named function")
            for keyword in node.keywords:
                if keyword.arg not in _KEYWORDS or not isinstance(keyword.value, ast.Constant):
                    raise refuse(f"passes {keyword.arg!r}=..., not a symbol assumption")
            if node.func.id in _POWERS and len(node.args) == 2 and not _small_exponent(node.args[1]):
                raise refuse(f"raises to a power beyond {MAX_EXPONENT}")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow) and not _small_exponent(node.right):
            raise refuse(f"raises to a power beyond {MAX_EXPONENT}")
        elif isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, str):
                if not (_SYMBOL.fullmatch(value) or _NUMBER_TEXT.fullmatch(value)):
                    raise refuse(f"holds the text {value[:40]!r}, neither a symbol's name nor a number")
            elif not isinstance(value, (bool, int, float)) or len(str(value)) > MAX_DIGITS:
                raise refuse(f"holds the constant {str(value)[:40]!r}")
        elif not isinstance(node, (*operators, ast.keyword)):
            raise refuse(f"holds Python syntax other than arithmetic ({type(node).__name__})")


def _small_exponent(node: Any) -> bool:
    """Whether an exponent is symbolic, or a number at most :data:`MAX_EXPONENT` in size (``Integer(n)`` too)."""
    import ast

    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("Integer", "Float") \
            and len(node.args) == 1:
        node = node.args[0]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    if isinstance(node, ast.Constant):
        try:
            return abs(float(node.value)) <= MAX_EXPONENT
        except (TypeError, ValueError, OverflowError):
            return False
    return not any(isinstance(n, ast.Constant) and not isinstance(n.value, str) for n in ast.walk(node)) or \
        isinstance(node, ast.Name)


def _expressions(tree: Any) -> Iterator[str]:
    """Every ``expr_str`` string in a parsed ``models/model.json``."""
    pending = [tree]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                if key == "expr_str" and isinstance(value, str):
                    yield value
                elif isinstance(value, (dict, list)):
                    pending.append(value)
        elif isinstance(item, list):
            pending.extend(v for v in item if isinstance(v, (dict, list)))


def _open_regular(path: str) -> io.BufferedReader:
    """``path`` opened for reading without blocking (a FIFO does not hang), if it is a regular file."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file; give the .pt2 file") from None
    except OSError as err:
        raise InputError(f"{path}: cannot be opened ({err.strerror}); check the path and its permissions") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InputError(f"{path}: not a regular file (a folder, device or pipe); give the .pt2 file")
    return os.fdopen(fd, "rb")


@contextlib.contextmanager
def _torch_log_as_debug() -> Iterator[list[logging.LogRecord]]:
    """torch.export.load logs its first failure with a full traceback before trying an older layout: the
    records are kept (the caller names the first failure) and logged at debug level instead."""
    records: list[logging.LogRecord] = []

    def keep(record: logging.LogRecord) -> bool:
        records.append(record)
        log.debug("torch.export: %s", record.getMessage(), exc_info=record.exc_info)
        return False

    logger = logging.getLogger("torch.export")
    logger.addFilter(keep)
    try:
        yield records
    finally:
        logger.removeFilter(keep)
