"""A .pt2 archive (a torch.export program) read as untrusted input: nothing in it runs, nothing unbounded inflates.

``torch.export.load`` (torch 2.13, ``torch/export/pt2_archive/_package.py`` and ``torch/_export/serde/``) and
``ExportedProgram.module()`` run code from the file in five ways, and :class:`Pt2Archive` refuses each before
torch reads the file:

- pickles: a weight or tensor constant flagged ``use_pickle`` in ``data/weights/model_weights_config.json`` or
  ``data/constants/model_constants_config.json`` is read with ``torch.load(weights_only=False)``; a constant
  file named ``custom_obj_*`` goes through TorchScript's unpickler and ``opaque_obj_*`` through
  ``pickle.loads``; ``data/sample_inputs/model.pt`` (and the legacy ``data/weights/model.pt``) is read with
  ``weights_only=True`` and, when that fails, again with ``weights_only=False``; so is the torch 2.7 layout
  torch falls back to when an archive does not load.
- native code: ``data/aotinductor/`` holds a shared library that torch loads with the program.
- Python expressions: each symbolic size in ``models/model.json`` (``expr_str``) goes through
  ``sympy.sympify``, which evaluates it.
- Python source: guards, argument names, attribute names and string constants are pasted into the source of
  functions torch generates and runs (:mod:`amppass.archive.program`).
- Python functions by name: a node's target and every operator argument are looked up by ``getattr`` from
  ``torch``, ``math`` or ``operator`` (``torch.os.system`` is :func:`os.system`), and the graph calls them
  (:mod:`amppass.archive.operators`).

Rules:

1. **One private copy.** The file is opened once (without blocking, a regular file only) and its bytes, as many
   as it held when opened, are copied into an unnamed temporary file that nothing else can open; the checks and
   torch both read that copy, so a file rewritten or renamed in between is never read. Before the copy, the
   file's size is capped (``$AMPPASS_MAX_PT2_BYTES``), its holes bounded and its zip directory checked to
   hold its bytes (:func:`amppass.archive.layout.check_file`): a sparse file is not copied whole.
2. **One reading, bounded.** torch's own zip reader (which looks names up ignoring case) and Python's zipfile
   list the same entries, at the same offsets, with the same sizes; no two entries share a byte; every size is
   bounded before anything is inflated (:mod:`amppass.archive.layout`). The zip torch reads inside the
   archive (the sample inputs) is held to the same rule.
3. **Names.** One root folder, printable ASCII, no two names equal ignoring case, and every entry one that
   ``torch.export.save`` writes for a single program: the program's JSON, weight and tensor-constant files,
   their configs, the sample inputs, extra files and the format markers. Anything else is refused.
4. **Payloads.** Every config entry is a tensor that fits in its file's bytes; the sample inputs are tensors
   and numbers in a small tree (:mod:`amppass.archive.payloads`).
5. **Program text.** Every string torch evaluates or pastes into source has the form torch writes, and is
   bounded so that evaluating it is cheap (:mod:`amppass.archive.program`).
6. **Trusted files.** ``trusted=True`` (CLI ``--trust-pickle``), which only the user can type, skips rules 3-5:
   torch then reads the file as ``torch.export.load`` does, pickles included.

The principle behind every rule: each value read from the file passes a validating reader with a size, count
and depth bound (the zip's directory, :func:`amppass.json_input.read_json`, the pickle's opcodes, the program
text) before any library (torch, sympy, json, zipfile) builds anything from it, and every failure is an
:class:`~amppass.errors.InputError` naming the file and the entry.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import stat
import tempfile
from typing import Any, Iterator

from ..errors import InputError, first_line
from ..json_input import read_json
from .layout import MAX_EXTRA, MAX_HELD, MAX_INFLATED, MAX_JSON, check_file, read_zip
from .payloads import MAX_DEPTH, check_config, check_sample_inputs
from .program import TRUST_HINT, check_expression, check_program, spec_types

__all__ = ["MAX_EXTRA", "MAX_HELD", "MAX_INFLATED", "MAX_JSON", "MAX_DEPTH", "TRUST_HINT", "Pt2Archive",
           "check_expression", "parse_json"]

log = logging.getLogger(__name__)

_FIXED = {"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id",
          "models/model.json", "data/weights/model_weights_config.json",
          "data/constants/model_constants_config.json", "data/sample_inputs/model.pt"}
_PATTERNS = [re.compile(p) for p in (r"data/weights/weight_\d+", r"data/constants/tensor_\d+",
                                     r"extra/[A-Za-z0-9._-]+")]
_CONFIGS = {"data/weights/model_weights_config.json": ("data/weights/", "weight_"),
            "data/constants/model_constants_config.json": ("data/constants/", "tensor_")}
_SAMPLE_INPUTS = "data/sample_inputs/model.pt"
_COPY_CHUNK = 8 << 20


class Pt2Archive:
    """An open .pt2 file, copied privately and checked (module docstring), that torch then reads from the copy.

    Use as a context manager; ``entries`` are the names under the archive's root folder.
    """

    def __init__(self, path: str | os.PathLike, trusted: bool = False):
        self.path = os.fspath(path)
        self._program: Any = None
        self.handle = _private_copy(self.path)
        try:
            reading = read_zip(self.handle, self.path)
            self._reader, self.root, self.entries = reading.reader, reading.root, reading.entries
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
        """Whether the archive holds ``name`` under its root folder."""
        return name in self.entries

    def read(self, name: str, limit: int) -> bytes:
        """Entry ``name`` as torch reads it, refused when its header says more than ``limit`` bytes."""
        size = self.entries[name].file_size
        if size > limit:
            raise InputError(f"{self.path}: entry {name!r} would inflate to {size:,} bytes, more than the "
                             f"{limit:,} amppass reads there; the file is damaged or crafted: save the model again")
        try:
            data = self._reader.get_record(name)
        except Exception as err:  # noqa: BLE001 - torch's reader on a damaged entry (a raw RuntimeError)
            raise InputError(f"{self.path}: entry {name!r} cannot be read ({first_line(err, 200)}); the file is "
                             "damaged: save the model again") from None
        if len(data) != size:  # torch's reader disagrees with the header Python read
            raise InputError(f"{self.path}: entry {name!r} holds other bytes than its header says; the file is "
                             "crafted")
        return data

    def read_json(self, name: str, limit: int) -> Any:
        """Entry ``name`` parsed as JSON (bounded, at most :data:`MAX_DEPTH` deep); InputError naming it."""
        return parse_json(self.read(name, limit), f"{self.path}: entry {name!r}")

    def load(self, extra_files: dict[str, str] | None = None) -> Any:
        """The ``ExportedProgram`` torch reads from the checked copy."""
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

    def _check_manifest(self) -> None:
        """Rules 3-5: only entries torch.export.save writes, tensors that fit their bytes, plain program text."""
        for name in self.entries:
            if name not in _FIXED and not any(p.fullmatch(name) for p in _PATTERNS):
                why = ("holds a compiled AOTInductor library that torch would load and run"
                       if name.startswith("data/aotinductor/") else "is not an entry amppass can vouch for")
                raise InputError(f"{self.path}: entry {name!r} {why}; amppass reads only programs as "
                                 f"torch.export.save writes them. {TRUST_HINT}")
        for config, (folder, prefix) in _CONFIGS.items():
            if self.has(config):
                check_config(self.read_json(config, MAX_JSON), f"{self.path}: entry {config!r}", prefix, folder,
                             lambda entry: self.entries[entry].file_size if self.has(entry) else None)
        if self.has(_SAMPLE_INPUTS) and self.entries[_SAMPLE_INPUTS].file_size:
            check_sample_inputs(self.read(_SAMPLE_INPUTS, MAX_JSON), f"{self.path}: entry {_SAMPLE_INPUTS!r}")
        if self.has("models/model.json"):
            check_program(self.program_json(), f"{self.path}: entry 'models/model.json'")

    def program_json(self) -> Any:
        """The program's ``models/model.json``, parsed once."""
        if self._program is None:
            self._program = self.read_json("models/model.json", MAX_JSON)
        return self._program

    def spec_types(self) -> set[str]:
        """The type names the program's input and output specs use (``transformers.modeling_outputs...``)."""
        return spec_types(self.program_json()) if self.has("models/model.json") else set()


def parse_json(data: bytes, where: str) -> Any:
    """``data`` as UTF-8 JSON, bounded as :func:`amppass.json_input.read_json` bounds it; InputError naming
    ``where``."""
    return read_json(data, where, max_bytes=MAX_JSON)


def _private_copy(path: str) -> io.BufferedRandom:
    """Rule 1: the bytes ``path`` holds when opened, copied into an unnamed temporary file read from the start."""
    with _open_regular(path) as source:
        size = os.fstat(source.fileno()).st_size
        check_file(source, size, path)
        source.seek(0)
        copy = tempfile.TemporaryFile(prefix="amppass-pt2-")
        try:
            left = size
            while left:
                chunk = source.read(min(left, _COPY_CHUNK))
                if not chunk:
                    raise InputError(f"{path}: the file became shorter while it was read ({size - left:,} of "
                                     f"{size:,} bytes); read it again once nothing writes to it")
                copy.write(chunk)
                left -= len(chunk)
            copy.seek(0)
        except OSError as err:
            copy.close()
            raise InputError(f"{path}: cannot copy it to a private temporary file ({err.strerror}); free space in "
                             f"{tempfile.gettempdir()} or set TMPDIR to a folder with room") from None
        except BaseException:
            copy.close()
            raise
    return copy


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
