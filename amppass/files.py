"""Writing a user's files so that nothing they had is lost and no half-written file is left behind.

Every file amppass writes goes through a :class:`Staged` set of writes:

1. Each output is first written to a temporary file beside its final path (same folder, so the final
   rename cannot cross filesystems), flushed and fsynced.
2. Only when every output of the set is complete are the temporaries renamed over their final paths, and
   the folders fsynced. If any write fails, every temporary is removed and the user's existing files are
   exactly as they were; the error names the file that failed.
3. New files get the permissions the user's umask gives any new file (0666 & ~umask); a file that is
   replaced keeps its mode. A caller that names a ``mode`` gets exactly that (the timing cache writes its
   tables for the user alone).
4. While temporaries exist, a SIGTERM sent to the main thread unwinds through the clean-up (it becomes
   ``SystemExit(143)``) instead of killing the process with the temporaries on disk. The handler is only
   installed where none is (SIG_DFL), and restored afterwards.
5. An output path is checked before any work (:func:`check_writable`): an existing path there must be a
   regular file (or a link to one). A FIFO, device or socket is refused, never opened: reading a FIFO
   (the save looks into the model it replaces) blocks until someone writes to it, and renaming a file over
   a device node replaces it.
6. An output path that is a symbolic link is followed: the file it points to is replaced (through a temporary
   beside that file, so atomically) and the link stays as it was, as a shell's ``>`` would leave it
   (:func:`resolved`). amppass's own files (the timing cache) pass ``follow_links=False``: a link there is
   replaced, never written through. Two outputs of one set that name one file once links are followed are refused before
   anything is written (:meth:`Staged.open` raises at the second, and the set aborts).
7. Every failure to write names the file it could not write (the final path, never a temporary).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import signal
import stat
import threading
from types import FrameType
from typing import Any, BinaryIO, Callable, Iterator

from .errors import InputError

TEMP_PREFIX = ".amppass-"


class WriteError(InputError, OSError):
    """An output file could not be written; the message names it. Nothing the user had was changed.

    Also an ``OSError``, so callers that catch the operating system's error keep working."""


class Staged:
    """A set of files written together: all of them land, or none does (module docstring).

    Use as a context manager: ``with Staged() as staged: with staged.open(path) as out: out.write(...)``.
    Leaving the block normally commits; an exception aborts and is re-raised (an ``OSError`` as a
    :class:`WriteError` naming the file).
    """

    def __init__(self, follow_links: bool = True) -> None:
        self._follow = follow_links  # rule 6; amppass's own files (the timing cache) replace a link instead
        self._pending: list[tuple[str, str]] = []  # (temporary, final path), in commit order
        self._named: set[str] = set()  # every final path of the set, links followed (rule 6)
        self._created: list[str] = []  # files written under their final (fresh) name, removed on abort
        self._after: list[Callable[[], None]] = []
        self._signals = _TermGuard()

    def __enter__(self) -> "Staged":
        self._signals.install()
        return self

    def __exit__(self, kind, error, trace) -> None:
        try:
            if kind is None:
                try:
                    self.commit()
                except BaseException as failed:
                    self.abort()
                    if isinstance(failed, OSError) and not isinstance(failed, WriteError):
                        raise WriteError(_describe(failed)) from failed
                    raise
            else:
                self.abort()
        finally:
            self._signals.restore()
        if isinstance(error, OSError) and not isinstance(error, WriteError):
            raise WriteError(_describe(error)) from error

    @contextlib.contextmanager
    def open(self, path: str | os.PathLike, mode: int | None = None) -> Iterator[BinaryIO]:
        """A binary file that becomes ``path`` when the set commits; with the permission bits ``mode`` when
        given (rule 3); a link at ``path`` is followed (rule 6)."""
        final = self._name(path)
        folder, base = os.path.split(final)
        temp = os.path.join(folder, f"{TEMP_PREFIX}{base}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        self._pending.append((temp, final))
        with _naming(final), _create(temp, _mode_for(final) if mode is None else mode) as out:
            yield out

    @contextlib.contextmanager
    def create(self, path: str | os.PathLike) -> Iterator[BinaryIO]:
        """A binary file written directly at a fresh ``path`` that must not exist yet (an external-data file
        only the new model names); removed if the set aborts."""
        final = self._name(path)
        self._created.append(final)
        with _naming(final), _create(final, _mode_for(final)) as out:
            yield out

    def _name(self, path: str | os.PathLike) -> str:
        """The file ``path`` names (:func:`resolved`, or the link itself where links are not followed), refused
        where another output of the set names it too."""
        final = resolved(path) if self._follow else os.path.abspath(os.fspath(path))
        if final in self._named:
            shown = os.fspath(path)
            raise InputError(f"two outputs name one file, {shown!r}" + ("" if final == os.path.abspath(shown) else
                             f" (through a link, {final!r})") + "; nothing was written: give each output its own "
                             "file name")
        self._named.add(final)
        return final

    def write(self, path: str | os.PathLike, data: str | bytes, mode: int | None = None) -> None:
        """Stage ``data`` (text is UTF-8 encoded) for ``path`` (with the permission bits ``mode``, when given)."""
        with self.open(path, mode) as out:
            out.write(data.encode("utf-8") if isinstance(data, str) else data)

    def after_commit(self, action: Callable[[], None]) -> None:
        """Run ``action`` once every file has landed (removing what the old files referenced)."""
        self._after.append(action)

    def commit(self) -> None:
        """Rename every temporary over its final path, then fsync the folders."""
        folders = {os.path.dirname(final) for _, final in self._pending} | {os.path.dirname(p) for p in self._created}
        for folder in folders:  # the fresh files' names must be durable before a model names them
            _fsync_folder(folder)
        while self._pending:
            temp, final = self._pending[0]
            os.replace(temp, final)
            self._pending.pop(0)
            self._created.clear()  # a model that landed may name them: they stay, whatever happens next
        for folder in folders:
            _fsync_folder(folder)
        for action in self._after:
            action()

    def abort(self) -> None:
        """Remove every file this set wrote; the user's own files are untouched."""
        for path in [temp for temp, _ in self._pending] + self._created:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        self._pending.clear()
        self._created.clear()


def write_atomic(path: str | os.PathLike, data: str | bytes, mode: int | None = None,
                 follow_links: bool = True) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder (see :class:`Staged`), with the
    permission bits ``mode`` when given; a link at ``path`` is replaced itself unless ``follow_links``."""
    with Staged(follow_links) as staged:
        staged.write(path, data, mode)


def resolved(path: str | os.PathLike) -> str:
    """The file a write to ``path`` replaces: ``path`` made absolute, its symbolic links followed (rule 6)."""
    return os.path.realpath(os.path.abspath(os.fspath(path)))


_SPECIAL = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
            (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def check_writable(path: str | os.PathLike) -> str:
    """``path`` as a string, if a file can be written there: not a folder, nor anything else that is not a
    regular file (:func:`check_regular`), in a folder that exists and that this process may write to;
    InputError otherwise."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise InputError(f"{path!r} is a folder; give the file name to write to, e.g. "
                         f"{os.path.join(path, 'model.onnx')!r}")
    check_regular(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise InputError(f"cannot write {path!r}: folder {folder!r} does not exist; create it first")
    if not os.access(folder, os.W_OK):
        raise InputError(f"cannot write {path!r}: folder {folder!r} is not writable; choose another folder")
    return path


def check_regular(path: str | os.PathLike) -> None:
    """Rule 5: InputError when ``path`` exists and is a FIFO, device or socket (or a link to one); nothing is
    opened. (A folder there fails at the write, which names it.)"""
    path = os.fspath(path)
    try:
        found = os.stat(path).st_mode  # through a link: its target is what reading the old output opens
    except OSError:
        return
    if not stat.S_ISREG(found) and not stat.S_ISDIR(found):
        kind = next((name for test, name in _SPECIAL if test(found)), "not a file")
        raise InputError(f"cannot write {path!r}: it is {kind}, not a regular file, and amppass never opens one as "
                         "an output (it would block or replace it); remove it or choose another path")


@contextlib.contextmanager
def _naming(final: str) -> Iterator[None]:
    """An ``OSError`` that names no file, or a temporary, while ``final`` is written: a :class:`WriteError`
    naming ``final`` (rule 7)."""
    try:
        yield
    except OSError as error:
        if isinstance(error, WriteError) or (error.filename is not None and
                                             not os.path.basename(str(error.filename)).startswith(TEMP_PREFIX)):
            raise
        raise WriteError(_describe(error, final)) from error


@contextlib.contextmanager
def _create(path: str, mode: int) -> Iterator[BinaryIO]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    with os.fdopen(fd, "wb") as out:
        try:
            os.fchmod(fd, mode)  # os.open's mode is filtered by the umask; a replaced file's mode is kept as is
        except OSError as error:  # filesystems without modes (some mounts) still take the data
            if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EINVAL):
                raise
        yield out
        out.flush()
        os.fsync(out.fileno())


def _mode_for(final: str) -> int:
    """The mode ``final`` keeps if it exists, else what the umask gives a new file."""
    try:
        return stat.S_IMODE(os.stat(final).st_mode)
    except OSError:
        return 0o666 & ~_umask()


_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    """The process umask, read without changing it where the platform allows (Linux's /proc)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _UMASK_LOCK:  # os.umask can only be read by setting it: set it straight back
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def _fsync_folder(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # platforms that cannot open folders (Windows) make renames durable themselves
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _describe(error: OSError, final: str | None = None) -> str:
    """The message of a failed write: the file (``final``, else the error's own, a temporary as its final
    path), why, and that nothing changed."""
    name = final or error.filename or "an output file"
    if isinstance(name, str) and os.path.basename(name).startswith(TEMP_PREFIX):
        name = _final_name(name)
    return (f"cannot write {name}: {error.strerror or error}; nothing was changed (files already there are as "
            "they were). Free space or choose another folder")


def _final_name(temp: str) -> str:
    """The final path a temporary stands for: ``.amppass-<name>.<pid>.<hex>.tmp`` -> ``<name>``."""
    folder, base = os.path.split(temp)
    name = base[len(TEMP_PREFIX):].rsplit(".", 3)[0]
    return os.path.join(folder, name)


class _TermGuard:
    """Turns SIGTERM into SystemExit(143) while staged files exist (module docstring, rule 4)."""

    def __init__(self) -> None:
        # the SIGTERM handler found at install (a function, SIG_DFL, SIG_IGN or None), put back by uninstall
        self._previous: Callable[[int, FrameType | None], Any] | int | None = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                self._previous = signal.signal(signal.SIGTERM, _terminate)
        except (ValueError, OSError):  # an embedding interpreter without signals
            self._previous = None

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
