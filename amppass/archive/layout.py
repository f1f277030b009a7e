"""The zip layout of a .pt2 archive, checked before any entry is inflated: sizes, and one reading of them.

torch reads the archive with its own zip reader (miniz), amppass's checks with Python's ``zipfile``. A file
crafted so that the two read it differently (two zip64 extras in one header, a second zip64 end record,
entries whose bytes overlap) passes checks made on one reading and inflates past them on the other. The same
holds for the zip torch reads inside the archive (the sample inputs, a ``torch.save`` file). So, for every zip
amppass lets torch read, at any depth (:func:`read_zip`):

1. **Bounded.** Each entry's bytes lie inside the file; a stored entry is as long as its data; a compressed one
   inflates to at most :data:`MAX_INFLATED`; a JSON entry is at most :data:`MAX_JSON` and an extra file
   :data:`MAX_EXTRA` (torch reads every extra file); compressed entries together inflate to at most
   :data:`MAX_DEFLATED` (a 1 MB file holds the archive's and its nested zip's: 256 MiB), extra files together
   at most :data:`MAX_HELD`; compressed JSON entries together at most :data:`MAX_COMPRESSED_JSON` (parsing
   costs about 60 times the text: torch.export.save stores JSON uncompressed, so an honest large program's
   JSON is bounded by the file's own bytes instead).
2. **One reading.** For every entry torch's reader gives the same size, header offset and data offset as
   Python's, and the local header names the entry the central directory names.
3. **No overlap.** No two entries share a byte, and none reaches into the central directory: each byte of the
   file is inflated once at most, so what torch holds is bounded by the file's size.
4. **Names.** One root folder, printable ASCII, no two names equal ignoring case (torch's reader looks names up
   ignoring case), and torch's reader lists the same names as Python's.
5. **Every byte an entry's.** The entries and the directory hold the whole file but :data:`MAX_SLACK` bytes.

Before the file is copied (:func:`check_file`), its size is at most :func:`file_limit` (``$AMPPASS_MAX_PT2_BYTES``
raises it), it has few holes (a sparse file's holes read as zeros: 4 GiB of them take 20 KB of disk, and
as much memory and temporary space as real bytes once read), and rule 5 holds on its directory: the copy
costs what the file's bytes on disk cost.
"""

from __future__ import annotations

import errno
import itertools
import os
import struct
import zipfile
from dataclasses import dataclass
from typing import Any, BinaryIO

from ..errors import InputError, first_line
from ..limits import env_cap
from .program import TRUST_HINT

MAX_INFLATED = 64 << 20  # a compressed entry (torch.export.save stores every entry uncompressed)
MAX_JSON = 256 << 20  # the program's JSON and the payload configs: parsing takes several times this
MAX_EXTRA = 16 << 20  # each extra file: torch reads every one into memory
MAX_HELD = 256 << 20  # all extra files together: torch holds them at once
MAX_DEFLATED = 128 << 20  # all compressed entries, inflated, together: with the nested zip's, under 500 MB in all
MAX_COMPRESSED_JSON = 1 << 20  # compressed JSON entries, inflated, together: 1 MiB parses in about a second
MAX_SLACK = 1 << 20  # bytes of a file that neither an entry nor the directory holds (torch.save leaves none)
MAX_FILE = 64 << 30  # bytes of a .pt2 file amppass copies and reads (a 30B-parameter model in bf16 is 60 GB)
ENV_MAX_FILE = "AMPPASS_MAX_PT2_BYTES"  # the environment variable that sets another cap

JSON_NAMES = frozenset({"models/model.json", "data/weights/model_weights_config.json",
                        "data/constants/model_constants_config.json", "archive_format", "archive_version",
                        "byteorder", ".data/version", ".data/serialization_id"})
_STORE_JSON = ", inflated (torch.export.save stores JSON uncompressed, however large)"
_COPY_HINT = "copy it whole (cp --sparse=never) or save the model again"
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, then (at 26) the name's and the extra field's lengths
_LOCAL_SIGNATURE = b"PK\x03\x04"


@dataclass
class ZipReading:
    """A zip read once by both readers: Python's ``archive``, torch's ``reader``, the ``root`` folder and the
    ``entries`` under it by name (the names torch's reader takes)."""

    archive: zipfile.ZipFile
    reader: Any
    root: str
    entries: dict[str, zipfile.ZipInfo]


def read_zip(handle: BinaryIO, where: str) -> ZipReading:
    """The zip ``handle`` holds, checked by rules 1-5 before any entry is inflated; InputError naming ``where``."""
    archive = open_zip(handle, where)
    check_sizes(archive, where)
    check_extent(archive, where)
    root, entries = _names(archive, where)
    reader = _torch_reader(handle, entries, where)
    check_one_reading(archive, reader, where)
    return ZipReading(archive, reader, root, entries)


def open_zip(handle: BinaryIO, where: str) -> zipfile.ZipFile:
    """Python's reading of the zip's directory (nothing inflated); InputError where it is not a zip."""
    try:
        return zipfile.ZipFile(handle)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as err:
        raise InputError(f"{where}: not a torch.export program file (not a zip archive: {first_line(err, 300)}); "
                         "give a .pt2 file torch.export.save or amppass.save wrote") from None


def file_limit() -> int:
    """The most bytes a .pt2 file may hold: ``$AMPPASS_MAX_PT2_BYTES`` when set, else :data:`MAX_FILE`."""
    return env_cap(ENV_MAX_FILE, MAX_FILE, "the size in bytes of the largest .pt2 file to read", 200_000_000_000)


def check_file(source: BinaryIO, size: int, where: str) -> None:
    """What :mod:`amppass.archive` checks of the user's file before copying it (module docstring): its size, its
    holes and that its entries hold it (rule 5), reading only its directory and local headers."""
    limit = file_limit()
    if size > limit:
        raise InputError(f"{where}: the file holds {size:,} bytes, more than the {limit:,} amppass reads; if the model "
                         f"is that large, raise the cap: set the environment variable {ENV_MAX_FILE} (e.g. "
                         f"{ENV_MAX_FILE}={-(-size // 10**9) * 10**9})")
    holes = _hole_bytes(source.fileno(), size, _max_holes(size))
    if holes > _max_holes(size):
        raise InputError(f"{where}: the file is sparse: at least {holes:,} of its {size:,} bytes are holes the disk "
                         f"does not hold, which amppass would copy and torch read as real bytes; {_COPY_HINT}")
    check_extent(open_zip(source, where), where)


def _max_holes(size: int) -> int:
    """Bytes of holes a file of ``size`` bytes may have: a sixteenth of it (a filesystem may store zero blocks of
    an honest file as holes), at least :data:`MAX_SLACK`."""
    return max(MAX_SLACK, size // 16)


def _hole_bytes(fd: int, size: int, bound: int) -> int:
    """Bytes of file ``fd`` that are holes (SEEK_HOLE), counted until they pass ``bound``; 0 where the system
    cannot tell."""
    if not hasattr(os, "SEEK_HOLE"):
        return 0
    holes, at = 0, 0
    try:
        while at < size and holes <= bound:
            try:
                data = os.lseek(fd, at, os.SEEK_DATA)
            except OSError as err:
                if err.errno != errno.ENXIO:
                    raise
                return holes + size - at  # ENXIO: only a hole from here to the end
            holes += data - at
            at = os.lseek(fd, data, os.SEEK_HOLE)
    except OSError:  # a filesystem that cannot tell (EINVAL): the copy is still bounded by the size cap
        return 0
    finally:
        os.lseek(fd, 0, os.SEEK_SET)
    return holes


def check_extent(archive: zipfile.ZipFile, where: str) -> None:
    """Rule 5: the entries (local header, data, data descriptor) and the directory hold every byte of the file
    but :data:`MAX_SLACK`; read from the directory and the local headers, nothing inflated."""
    held = 0
    for info in archive.infolist():
        if info.header_offset < archive.start_dir:  # past the directory: rule 3 refuses it by name
            held += _data_offset(archive, info, where) - info.header_offset + info.compress_size
            held += (24 if info.file_size >= zipfile.ZIP64_LIMIT else 16) if info.flag_bits & 0x8 else 0
    slack = archive.start_dir - held
    if slack > MAX_SLACK:
        raise InputError(f"{where}: {slack:,} bytes of the file belong to no entry of its zip directory (at most "
                         f"{MAX_SLACK:,}); the file is damaged or crafted: save the model again")


def _names(archive: zipfile.ZipFile, where: str) -> tuple[str, dict[str, zipfile.ZipInfo]]:
    """Rule 4's form checks: the root folder and the entries under it, by name."""
    infos = archive.infolist()
    if not infos:
        raise InputError(f"{where}: an empty zip archive, not a torch.export program")
    root = infos[0].filename.partition("/")[0]
    entries, folded = {}, set()
    for info in infos:
        name = info.orig_filename  # Python's zipfile cuts a name at a NUL; torch's reader does not
        head, slash, rest = name.partition("/")
        if not name.isascii() or not name.isprintable() or head != root or not slash or not rest:
            raise InputError(f"{where}: entry {name[:100]!r} is not a file under the archive's folder "
                             f"{root[:100]!r}; torch writes every entry there. {TRUST_HINT}")
        if name.lower() in folded:
            raise InputError(f"{where}: entry {name[:100]!r} is in the archive twice (names compared ignoring case, "
                             "as torch's reader looks them up); the file is crafted: save the model again")
        folded.add(name.lower())
        entries[rest] = info
    return root, entries


def _torch_reader(handle: BinaryIO, entries: dict[str, zipfile.ZipInfo], where: str) -> Any:
    """torch's zip reader of ``handle``, refused where it lists other names than ``entries`` (rule 4)."""
    import torch

    handle.seek(0)
    try:
        reader = torch._C.PyTorchFileReader(handle)
        listed = set(reader.get_all_records())
    except Exception as err:  # noqa: BLE001 - torch's reader refuses the zip
        raise InputError(f"{where}: torch cannot read it as an archive ({first_line(err, 300)}); give a .pt2 file "
                         "torch.export.save or amppass.save wrote") from None
    if listed != set(entries):
        differ = sorted(listed.symmetric_difference(entries))[:3]
        raise InputError(f"{where}: torch's zip reader and Python's list different entries ({differ}); the file is "
                         "crafted: save the model again")
    return reader


def _is_json(name: str) -> bool:
    """Whether amppass or torch parses entry ``name`` as JSON."""
    return name in JSON_NAMES or name.endswith(".json")


def check_sizes(archive: zipfile.ZipFile, where: str) -> None:
    """Rule 1 on every entry of ``archive``, before anything is inflated."""
    fp = archive.fp
    assert fp is not None  # an open archive
    fp.seek(0, os.SEEK_END)
    total = fp.tell()
    held = {"compressed entries": 0, "extra files": 0, "compressed JSON entries": 0}
    bounds = {"compressed entries": MAX_DEFLATED, "extra files": MAX_HELD,
              "compressed JSON entries": MAX_COMPRESSED_JSON}
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
            compressed = info.compress_type != zipfile.ZIP_STORED
            held["compressed entries"] += info.file_size * compressed
            held["extra files"] += info.file_size * name.startswith("extra/")
            held["compressed JSON entries"] += info.file_size * (compressed and _is_json(name))
            many = next((kind for kind, size in held.items() if size > bounds[kind]), None)
            if problem is None and many:
                problem = (f"brings its {many} past {bounds[many]:,} bytes in all"
                           + _STORE_JSON * (many == "compressed JSON entries"))
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
    for (_, end, name), (start, _, following) in itertools.pairwise(spans):
        if start < end:
            raise _damaged(where, following, f"shares bytes with entry {_short(name)}")
    if spans and spans[-1][1] > archive.start_dir:
        raise _damaged(where, spans[-1][2], "runs into the archive's directory")


def _data_offset(archive: zipfile.ZipFile, info: zipfile.ZipInfo, where: str) -> int:
    """Where the entry's data starts, read from its local header, which must name the entry."""
    fp = archive.fp
    assert fp is not None  # an open archive
    fp.seek(info.header_offset)
    head = fp.read(_LOCAL_HEADER.size)
    if len(head) < _LOCAL_HEADER.size:
        raise _damaged(where, info.filename, "has its local header past the end of the file")
    signature, name_length, extra_length = _LOCAL_HEADER.unpack(head)
    if signature != _LOCAL_SIGNATURE or fp.read(name_length) != info.orig_filename.encode(
            "utf-8" if info.flag_bits & 0x800 else "cp437", "replace"):
        raise _damaged(where, info.filename, "has a local header that does not name it")
    return info.header_offset + _LOCAL_HEADER.size + name_length + extra_length


def _short(name: str) -> str:
    return repr(name.partition("/")[2] or name)[:100]


def _damaged(where: str, name: str, problem: str) -> InputError:
    return InputError(f"{where}: entry {_short(name)} {problem}; the file is damaged or crafted: save the "
                      "model again")
