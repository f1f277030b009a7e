"""A zip archive written byte by byte, so a test can build what no zip library writes: two zip64 extras in one
header, entries that share bytes, a central directory that names another local header (compressed, in one
directory only), a torn file."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

ZIP64 = 0xFFFFFFFF


@dataclass
class Entry:
    """One stored entry: its name, its bytes, and what its central-directory record says."""

    name: str
    data: bytes
    central_extra: bytes = b""  # extra fields of the central-directory record
    central_sizes: tuple[int, int] | None = None  # (compressed, uncompressed) the record claims; None: the data's
    header_offset: int | None = None  # where the record says the local header is; None: where it was written
    local: bool = True  # write a local header and the data (False: the record points at another's)
    points_at: str | None = None  # the record points at the local header written for this other name
    method: int = 0  # the compression method the record names (8: deflate; the local header says stored)


def zip64_extra(uncompressed: int, compressed: int) -> bytes:
    """A zip64 extended-information extra field with both sizes."""
    return struct.pack("<HHQQ", 0x0001, 16, uncompressed, compressed)


def write(entries: list[Entry], torch_view: list[Entry] | None = None) -> bytes:
    """The archive's bytes: each entry's local header and data in order, then the central directory.

    With ``torch_view``, a second central directory too, with a zip64 end record of its own: the zip64 locator
    points at that record (where torch's reader looks), while Python's zipfile reads the record just before the
    locator, which describes ``entries``.
    """
    out = bytearray()
    offsets = {}
    for entry in entries:
        if not entry.local:
            continue
        offsets[entry.name] = len(out)
        name = entry.name.encode()
        out += struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, 0, 0, 0, zlib.crc32(entry.data),
                           len(entry.data), len(entry.data), len(name), 0)
        out += name + entry.data
    if torch_view is None:
        start, size = _directory(out, entries, offsets)
        out += struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(entries), len(entries), size, start, 0)
        return bytes(out)
    theirs = _directory(out, torch_view, offsets)
    their_record = len(out)
    out += _zip64_end(len(torch_view), *theirs)
    ours = _directory(out, entries, offsets)
    out += _zip64_end(len(entries), *ours)
    out += struct.pack("<4sIQI", b"PK\x06\x07", 0, their_record, 1)
    out += struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, ZIP64, ZIP64, 0)
    return bytes(out)


def _directory(out: bytearray, entries: list[Entry], offsets: dict[str, int]) -> tuple[int, int]:
    """Append a central directory for ``entries`` to ``out``: (its start, its size)."""
    start = len(out)
    for entry in entries:
        name = entry.name.encode()
        compressed, uncompressed = entry.central_sizes or (len(entry.data), len(entry.data))
        offset = (
            entry.header_offset if entry.header_offset is not None else offsets.get(entry.points_at or entry.name, 0)
        )
        out += struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, entry.method, 0, 0,
                           zlib.crc32(entry.data), compressed, uncompressed, len(name), len(entry.central_extra),
                           0, 0, 0, 0, offset)
        out += name + entry.central_extra
    return start, len(out) - start


def _zip64_end(count: int, start: int, size: int) -> bytes:
    """A zip64 end-of-central-directory record (56 bytes)."""
    return struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, size, start)


def entries_of(path) -> list[Entry]:
    """The entries of an ordinary zip file, as :class:`Entry` values to edit and :func:`write` again."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        return [Entry(info.filename, archive.read(info)) for info in archive.infolist()]


def deflated(data: bytes) -> bytes:
    """``data`` as a zip entry's raw deflate stream."""
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    return packer.compress(data) + packer.flush()
