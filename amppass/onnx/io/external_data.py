"""Reading tensors a model keeps in external-data files, without ever reading outside the model's folder.

A model file can come from anywhere, and its tensors name the files that hold their bytes. An
external-data ``location`` is accepted only when it is a relative path that stays inside the model's
folder once every symbolic link is resolved (as ``onnx.load`` and ``onnx.checker`` require); an absolute
path, one that climbs out with ``..``, a link inside the folder that points outside it, a folder, a device
or a pipe is refused with an :class:`~amppass.errors.InputError` naming the tensor and the location.

Each file is opened once (:class:`ExternalFiles`), and the *opened* file is what is checked: its resolved
path (``/proc/self/fd`` on Linux, else its device and inode against the checked path) must lie inside the
folder and it must be a regular file. Every later read goes through that descriptor's memory map, so a file
swapped for a link after the check cannot be read. Offsets and lengths are whole numbers of at most
:data:`MAX_DIGITS` digits (checked before the text is converted), then checked against the file's size and the
tensor's shape before any byte is read.
"""

from __future__ import annotations

import mmap
import os
import stat
from dataclasses import dataclass

import numpy as np
import onnx

from ...errors import InputError

MAX_DIGITS = 19  # digits of an external-data offset or length: 2**63 bytes has 19
RESERVED = "amppass:weight-store"  # the location amppass's weight store uses internally; never a user's file


def info(tensor: onnx.TensorProto) -> dict[str, str]:
    """The external_data key/value pairs of ``tensor``."""
    return {entry.key: entry.value for entry in tensor.external_data}


def check_location(tensor: onnx.TensorProto, where: str) -> str:
    """``tensor``'s external-data location, if it is a relative path that stays inside its folder by name;
    InputError naming ``where`` (the model), the tensor and the location otherwise. Links are checked when
    the file is opened (:meth:`ExternalFiles.array`)."""
    location = info(tensor).get("location", "")
    problem = ""
    if not location:
        problem = "names no location"
    elif location == RESERVED:
        problem = "is the location amppass reserves for its own weight store"
    elif "\x00" in location:
        problem = "holds a NUL character"
    elif os.path.isabs(location) or os.path.splitdrive(location)[0] or location.startswith(("/", "\\")):
        problem = "is an absolute path"
    elif os.path.normpath(location).replace("\\", "/").split("/")[0] == "..":
        problem = "climbs out of the model's folder"
    if problem:
        raise InputError(f"{where}: tensor {tensor.name!r} keeps its data at {location!r}, which {problem}; an "
                         "external-data location must be a file inside the model's folder, named relative to it. "
                         "The model file may be malicious or damaged: re-export it, or save it with "
                         "onnx.save_model(..., save_as_external_data=True)")
    return location


@dataclass
class _Opened:
    size: int
    buffer: mmap.mmap | bytes


class ExternalFiles:
    """The external-data files of one model, each opened once and checked (module docstring)."""

    def __init__(self, folder: str, where: str):
        self.folder = os.path.realpath(folder)
        self.where = where
        self._open: dict[str, _Opened] = {}

    def array(self, tensor: onnx.TensorProto, dtype: np.dtype, count: int) -> np.ndarray:
        """A read-only flat array of ``count`` ``dtype`` items: ``tensor``'s bytes in its external file."""
        location = check_location(tensor, self.where)
        opened = self._file(tensor, location)
        fields = info(tensor)
        offset = self._number(tensor, fields, "offset", 0)
        wanted = count * dtype.itemsize
        length = self._number(tensor, fields, "length", wanted)
        if length != wanted:
            raise InputError(f"{self.where}: tensor {tensor.name!r}: its external data is {length} bytes, but its "
                             f"shape {list(tensor.dims)} needs {wanted}; the model or its data file is damaged")
        if offset + length > opened.size:
            raise InputError(f"{self.where}: tensor {tensor.name!r}: its data would end at byte {offset + length} of "
                             f"{location!r}, which holds {opened.size}; the data file is truncated or belongs to "
                             "another model")
        if not count:
            return np.zeros(0, dtype)
        return np.frombuffer(opened.buffer, dtype, count, offset)

    def release(self, tensor: onnx.TensorProto) -> None:
        """Let the pages of ``tensor``'s bytes go from this process's memory (they stay in the page cache and
        come back if read again): a conversion reads each weight once or twice, never all at the same time."""
        opened = self._open.get(info(tensor).get("location", ""))
        if opened is None or not isinstance(opened.buffer, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
            return
        fields = info(tensor)
        offset, length = _whole(fields.get("offset", "0")), _whole(fields.get("length", "0"))
        if offset is None or length is None:
            return
        page = mmap.PAGESIZE
        start, end = offset // page * page, min(opened.size, offset + length)
        if end > start:
            opened.buffer.madvise(mmap.MADV_DONTNEED, start, end - start)

    def _file(self, tensor: onnx.TensorProto, location: str) -> _Opened:
        if location in self._open:
            return self._open[location]
        path = os.path.join(self.folder, location)
        resolved = os.path.realpath(path)
        if not _inside(resolved, self.folder):
            raise self._outside(tensor, location, resolved)
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(resolved, flags)
        except FileNotFoundError:
            raise InputError(
                f"{self.where}: tensor {tensor.name!r}: its external data file {location!r} is missing "
                "from the model's folder; keep the data file beside the .onnx file it belongs to"
            ) from None
        except OSError as err:
            raise InputError(
                f"{self.where}: tensor {tensor.name!r}: its external data file {location!r} cannot be "
                f"opened ({err.strerror or err}); check that it is a readable file"
            ) from None
        try:
            opened = self._checked(fd, tensor, location, resolved)
        finally:
            os.close(fd)  # the memory map keeps the file itself
        self._open[location] = opened
        return opened

    def _checked(self, fd: int, tensor: onnx.TensorProto, location: str, resolved: str) -> _Opened:
        """The opened file, once it is known to be a regular file inside the folder, memory-mapped."""
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise InputError(f"{self.where}: tensor {tensor.name!r}: {location!r} is not a regular file (a folder, "
                             "device or pipe); an external-data location must name a data file")
        actual = _opened_path(fd)
        if actual is not None and not _inside(actual, self.folder):
            raise self._outside(tensor, location, actual)
        if actual is None:  # no /proc: the file opened must be the file checked
            seen = os.stat(resolved, follow_symlinks=False)
            if (seen.st_dev, seen.st_ino) != (status.st_dev, status.st_ino):
                raise self._outside(tensor, location, resolved)
        if not status.st_size:
            return _Opened(0, b"")
        return _Opened(status.st_size, mmap.mmap(fd, 0, access=mmap.ACCESS_READ))

    def _outside(self, tensor: onnx.TensorProto, location: str, resolved: str) -> InputError:
        return InputError(f"{self.where}: tensor {tensor.name!r} keeps its data at {location!r}, which resolves to "
                          f"{resolved!r}, outside the model's folder {self.folder!r} (a symbolic link?); external data "
                          "must stay inside the model's folder. The model may be malicious: do not convert it, or "
                          "copy the data file into the folder")

    def _number(self, tensor: onnx.TensorProto, fields: dict[str, str], key: str, default: int) -> int:
        text = fields.get(key)
        if text is None:
            return default
        number = _whole(text)
        if number is None:
            shown = text if len(text) <= 40 else f"{text[:40]}… ({len(text):,} characters)"
            raise InputError(
                f"{self.where}: tensor {tensor.name!r}: external-data {key} {shown!r} is not a "
                f"non-negative whole number of at most {MAX_DIGITS} digits; the model file is damaged: re-export it"
            )
        return number


def _whole(text: str) -> int | None:
    """``text`` (from the file) as a non-negative whole number when it is at most :data:`MAX_DIGITS` ASCII digits
    (spaces around them aside), else None: the length is checked before ``int`` sees the text, whose own limit
    is a ValueError after thousands of digits."""
    text = text.strip()
    return int(text) if 0 < len(text) <= MAX_DIGITS and text.isascii() and text.isdigit() else None


def _inside(path: str, folder: str) -> bool:
    try:
        return os.path.commonpath([path, folder]) == folder and path != folder
    except ValueError:  # different drives
        return False


def _opened_path(fd: int) -> str | None:
    """The resolved path of an open file descriptor (Linux), or None where the platform cannot tell."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
