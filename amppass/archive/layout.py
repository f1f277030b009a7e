"""The zip layout of a .pt2 archive, checked before any entry is inflated: sizes, and one reading of them.

torch reads the archive with its own zip reader (miniz), amppass's checks with Python's ``zipfile``. A file
crafted so that the two read it differently (two zip64 extras in one header, a second zip64 end record,
entries whose bytes overlap) passes checks made on one reading and inflates past them on the other. So:

1. **Bounded.** Each entry's bytes lie inside the file; a stored entry is as long as its data; a compressed one
   inflates to at most :data:`MAX_INFLATED`; a JSON entry is at most :data:`MAX_JSON` and an extra file
   :data:`MAX_EXTRA` (torch reads every extra file); compressed entries together, and extra files together,
   at most :data:`MAX_HELD`.
2. **One reading.** For every entry torch's reader gives the same size, header offset and data offset as
   Python's, and the local header names the entry the central directory names.
3. **No overlap.** No two entries share a byte, and none reaches into the central directory: each byte of the
   file is inflated once at most, so what torch holds is bounded by the file's size.
"""

from __future__ import annotations

import os
import struct
import zipfile
from typing import Any

from ..errors import InputError

MAX_INFLATED = 64 << 20  # a compressed entry (torch.export.save stores every entry uncompressed)
MAX_JSON = 256 << 20  # the program's JSON and the payload configs: parsing takes several times this
MAX_EXTRA = 16 << 20  # each extra file: torch reads every one into memory
MAX_HELD = 256 << 20  # all compressed entries, and all extra files, together: torch holds them at once

JSON_NAMES = frozenset({"models/model.json", "data/weights/model_weights_config.json",
                        "data/constants/model_constants_config.json", "archive_format", "archive_version",
                        "byteorder", ".data/version", ".data/serialization_id"})
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, then (at 26) the name's and the extra field's lengths
_LOCAL_SIGNATURE = b"PK\x03\x04"


def check_sizes(archive: zipfile.ZipFile, where: str) -> None:
    """Rule 1 on every entry of ``archive``, before anything is inflated."""
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
            limit = MAX_JSON if name in JSON_NAMES else MAX_EXTRA if name.startswith("extra/") else None
            if limit is not None and info.file_size > limit:
                problem = f"would inflate to {info.file_size:,} bytes, more than the {limit:,} read there"
            held["compressed entries"] += info.file_size * (info.compress_type != zipfile.ZIP_STORED)
            held["extra files"] += info.file_size * name.startswith("extra/")
            many = next((kind for kind, size in held.items() if size > MAX_HELD), None)
            if problem is None and many:
                problem = f"brings its {many} past {MAX_HELD:,} bytes in all"
        if problem:
            raise _damaged(where, info.filename, problem)


def check_one_reading(archive: zipfile.ZipFile, reader: Any, where: str) -> None:
    """Rules 2 and 3: torch's ``reader`` and Python's ``archive`` read each entry at the same place with the
    same size, and no two entries share a byte."""
    spans = []
    for info in archive.infolist():
        name = info.filename.partition("/")[2]
        start = _data_offset(archive, info, where)
        try:
            theirs = (reader.get_record_size(name), reader.get_record_header_offset(name),
                      reader.get_record_offset(name))
        except Exception:  # noqa: BLE001 - torch's reader refuses the entry (a raw RuntimeError)
            raise _damaged(where, info.filename, "cannot be read by torch's zip reader") from None
        if theirs != (info.file_size, info.header_offset, start):
            raise _damaged(where, info.filename, f"reads as {theirs[0]:,} bytes at {theirs[2]:,} to torch's zip "
                                                 f"reader and {info.file_size:,} at {start:,} to Python's")
        spans.append((info.header_offset, start + info.compress_size, info.filename))
    spans.sort()
    for (_, end, name), (start, _, following) in zip(spans, spans[1:]):
        if start < end:
            raise _damaged(where, following, f"shares bytes with entry {_short(name)}")
    if spans and spans[-1][1] > archive.start_dir:
        raise _damaged(where, spans[-1][2], "runs into the archive's directory")


def _data_offset(archive: zipfile.ZipFile, info: zipfile.ZipInfo, where: str) -> int:
    """Where the entry's data starts, read from its local header, which must name the entry."""
    archive.fp.seek(info.header_offset)
    head = archive.fp.read(_LOCAL_HEADER.size)
    if len(head) < _LOCAL_HEADER.size:
        raise _damaged(where, info.filename, "has its local header past the end of the file")
    signature, name_length, extra_length = _LOCAL_HEADER.unpack(head)
    if signature != _LOCAL_SIGNATURE or archive.fp.read(name_length) != info.orig_filename.encode(
            "utf-8" if info.flag_bits & 0x800 else "cp437", "replace"):
        raise _damaged(where, info.filename, "has a local header that does not name it")
    return info.header_offset + _LOCAL_HEADER.size + name_length + extra_length


def _short(name: str) -> str:
    return repr(name.partition("/")[2] or name)[:100]


def _damaged(where: str, name: str, problem: str) -> InputError:
    return InputError(f"{where}: entry {_short(name)} {problem}; the file is damaged or crafted: save the "
                      "model again")
