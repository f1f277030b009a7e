"""A persistent timing cache per device, so that a plan measured once is not measured again.

TensorRT keeps a timing cache and inductor an autotune cache on disk for the same reason: a kernel's time
on a device does not change between builds, and measuring it again on a busy machine gives another
answer. amppass keeps the times profitability (:mod:`amppass.analysis.profitability`) measured, and the device probe
(:func:`amppass.targets.measure.probe`), in one JSON file per device fingerprint:

1. **Where**: ``$AMPPASS_CACHE`` if set, else ``$XDG_CACHE_HOME/amppass/timings``, else
   ``~/.cache/amppass/timings``. ``AMPPASS_CACHE=off`` (or ``0``, ``false``, ``no``, ``none``) disables
   it: nothing is read or written, and only the times measured in this process are reused.
2. **Keyed by the device**: the file is ``amppass-timings-<digest>.json``, the digest of the fingerprint
   (:func:`amppass.targets.device.fingerprint`: CPU model and ISA flags, torch capability, torch and oneDNN
   versions, thread count). The file also holds the fingerprint itself and is used only if it equals the
   current one, so a changed device, library or thread count never reads another's times. What the
   fingerprint cannot see (a BIOS setting, a new power limit) is forgotten by deleting the file or the
   folder: the next conversion measures again.
3. **Safe to share**: an update takes an exclusive lock (``fcntl.flock`` on ``amppass-timings-<digest>.lock``),
   reads the file again, merges its new entries in and replaces the file atomically
   (:func:`amppass.files.write_atomic`): a reader sees the old table or the new one, never half a file, and
   processes converting at once keep each other's entries. A file that cannot be read or parsed is treated
   as empty (and replaced by the next update), and an entry that is not a finite time in seconds (a hand
   edit: ``Infinity``, ``true``, a negative number, an integer too large for a float) is dropped, the others
   kept; a folder that cannot be written is logged once per
   process, and the conversions go on without it.
4. **Bounded**: a file keeps the :data:`MAX_ENTRIES` entries written last (an entry measured again counts
   as new; a BERT-base plan writes about 200), and every write deletes the folder's other device files not
   written for :data:`STALE_DAYS` days (an older torch's, a retired machine's).
5. **Read as untrusted**: the folder may be shared or the user's own. The table and the lock are opened
   without following a symbolic link and without blocking (a FIFO or device never hangs a conversion), used
   only if they are regular files, and the table is read only up to :data:`MAX_BYTES`; anything else, and
   any parse failure (deep nesting included), is an empty table with one warning per file and process.
   Clean-up deletes only files named as amppass names its own (:data:`PREFIX`) that are regular files
   holding an amppass table (:data:`FORMAT`): never another file in the folder.
6. **Only the user's own** (the rule of ssh's StrictModes): another user's times must not decide which
   regions stay fp32. The folder, and every folder above it (as written and with links followed), must be
   owned by the user or root and writable by no one else: neither by all users nor by a group, unless the
   folder has the sticky bit (like /tmp: others may add files there but not replace or rename the user's) or
   the group is the user's own (named after the user, their primary group, no other members: the group
   distributions that set umask 002 give each user). A folder that fails is not used at all, neither read nor
   written, with one warning per folder and process naming it and the fix (chmod, chown, or another
   ``AMPPASS_CACHE``). Each table and lock file, checked on the open file, must be owned by the user or root
   and (a table) writable by no one else; a table that fails reads as empty (rule 5's warning names why).
   amppass creates missing folders 0700 and writes its tables and locks 0600, whatever the umask. (Where the
   platform has no user ids, Windows, the ownership rules do not apply.)
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import stat
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

from ..files import write_atomic
from .device import digest

log = logging.getLogger(__name__)

ENV = "AMPPASS_CACHE"
OFF = ("off", "0", "false", "no", "none")
_UNWRITABLE: set[Path] = set()  # cache files this process failed to write: a warning the first time, then debug
MAX_ENTRIES = 20_000  # per device file, about 1.4 MB of JSON (rule 4)
STALE_DAYS = 90  # a device file not written for this long is deleted by the next write into its folder
MAX_BYTES = 16 << 20  # a table file read at most (MAX_ENTRIES entries take about 1.4 MB)
PREFIX = "amppass-timings-"  # the name of every file amppass writes in the folder (rule 5)
FORMAT = "amppass-timings-1"  # the "format" field of every table amppass writes (rule 5)
_PRIVATE = 0o600  # the mode of every table and lock amppass writes (rule 6)
_OWN = re.compile(re.escape(PREFIX) + r"[0-9a-f]{16}\.json")
_WARNED: set[Path] = set()  # table files this process warned were unreadable (rule 5)
_DISTRUSTED: set[Path] = set()  # folders this process warned it does not use (rule 6)


def folder() -> Path | None:
    """The cache folder (rule 1), or None where ``AMPPASS_CACHE`` disables the cache."""
    chosen = os.environ.get(ENV, "").strip()
    if chosen.lower() in OFF:
        return None
    if chosen:
        return Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or Path.home() / ".cache"
    return Path(base) / "amppass" / "timings"


class TimingCache:
    """The timing table of one device fingerprint (module docstring). ``entries`` maps a cost key to
    seconds; :meth:`add` stores new ones."""

    def __init__(self, found: dict[str, Any], where: Path | None = None):
        self.fingerprint = found
        self.folder = where if where is not None else folder()
        self.path = None if self.folder is None else self.folder / f"{PREFIX}{digest(found)}.json"
        self.refused: str | None = None  # why the folder is not used (rule 6)
        if self.folder is not None:
            self._refuse(_distrusted_folder(self.folder))
        self.entries: dict[str, float] = self._read()

    @property
    def enabled(self) -> bool:
        """Whether timings are read and stored (a folder is set and not refused)."""
        return self.path is not None

    def describe(self) -> str:
        """Where the cache is, for the report: its file, or why there is none."""
        if self.refused is not None:
            return f"{self.folder} not used: {self.refused}"
        return str(self.path) if self.path is not None else f"off ({ENV}={os.environ.get(ENV)})"

    def _refuse(self, reason: str | None) -> None:
        """Rule 6: stop using the folder (warned once per folder and process) when ``reason`` says why."""
        if reason is None or self.folder is None:
            return
        self.refused, self.path = reason, None
        said = self.folder in _DISTRUSTED
        _DISTRUSTED.add(self.folder)
        log.log(logging.DEBUG if said else logging.WARNING, "timing cache folder %s not used, neither read nor "
                "written, as another user could change the times in it: %s", self.folder, reason)

    def add(self, entries: Mapping[str, float]) -> None:
        """Merge ``entries`` into the cache file (rule 3); a cache that cannot be written is skipped."""
        if self.path is None or not entries:
            return
        self.entries.update(entries)
        try:
            _make_folder(self.path.parent)
            self._refuse(_distrusted_folder(self.path.parent))  # changed since the cache was opened
            if self.path is None:
                return
            with _locked(self.path.with_suffix(".lock")):
                merged = {k: v for k, v in self._read().items() if k not in entries}
                merged.update(entries)  # written last, kept longest (rule 4)
                merged = dict(list(merged.items())[-MAX_ENTRIES:])
                write_atomic(self.path, json.dumps({"format": FORMAT, "fingerprint": self.fingerprint,
                                                    "entries": merged}, indent=0), mode=_PRIVATE,
                             follow_links=False)  # a link planted in the folder is replaced, never written through
            self.entries = merged
            _delete_stale(self.path)
        except OSError as error:
            said = self.path in _UNWRITABLE
            _UNWRITABLE.add(self.path)
            log.log(logging.DEBUG if said else logging.WARNING,
                    "timing cache %s not written (%s); set %s to a writable folder, or to 'off'", self.path, error, ENV)
            self.path = None

    def _read(self) -> dict[str, float]:
        if self.path is None:
            return {}
        stored = _load(self.path)
        if not isinstance(stored, dict) or stored.get("fingerprint") != self.fingerprint:
            return {}  # another device (a digest collision) or an older format: not this device's times
        entries = stored.get("entries")
        if not isinstance(entries, dict):
            return {}
        times = ((str(k), _seconds(v)) for k, v in entries.items())
        return {k: v for k, v in times if v is not None}


def _seconds(value: Any) -> float | None:
    """A stored entry as a time in seconds, or None when it is not one (rule 3): not a number, a bool, not
    finite, negative, or an integer no float holds (JSON's integers have no bound: ``10**400``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        seconds = float(value)
    except OverflowError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _load(path: Path) -> Any:
    """The JSON of a table file (rule 5), or None when there is none or it cannot be used (warned once)."""
    try:
        with _open(path, os.O_RDONLY) as handle:
            data = handle.read(MAX_BYTES + 1)
        if len(data) > MAX_BYTES:
            raise ValueError(f"larger than {MAX_BYTES:,} bytes")
        return json.loads(data.decode("utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        said = path in _WARNED
        _WARNED.add(path)
        log.log(logging.DEBUG if said else logging.WARNING, "timing cache %s unreadable (%s); treated as empty, "
                "and replaced by the next update", path, str(error)[:200] or type(error).__name__)
        return None


def _delete_stale(kept: Path) -> None:
    """Rule 4: delete amppass's device files beside ``kept`` (and their locks) not written for STALE_DAYS days;
    rule 5: only regular files named and marked as amppass's."""
    oldest = time.time() - STALE_DAYS * 86400
    for other in kept.parent.glob(f"{PREFIX}*.json"):
        try:
            info = other.lstat()
            if other == kept or not _OWN.fullmatch(other.name) or not stat.S_ISREG(info.st_mode) or \
                    info.st_mtime >= oldest:
                continue
            stored = _load(other)
            if not isinstance(stored, dict) or stored.get("format") != FORMAT:
                continue  # named like ours but not a table amppass wrote: not ours to delete
            other.unlink()
            lock = other.with_suffix(".lock")
            if lock.is_symlink() or lock.is_file():
                lock.unlink()
            log.info("timing cache %s deleted: not written for %d days", other, STALE_DAYS)
        except OSError as error:  # another process deleted it first, or it is not ours to delete
            log.debug("timing cache %s not deleted (%s)", other, error)


def _make_folder(folder: Path) -> None:
    """Create ``folder`` and the folders above it that are missing, for the user alone (rule 6)."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for place in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it at once
            os.mkdir(place, 0o700)


def _distrusted_folder(chosen: Path) -> str | None:
    """Rule 6: why ``chosen``, or a folder above it, may be changed by another user; None when none may."""
    if not hasattr(os, "geteuid"):
        return None
    absolute = Path(os.path.abspath(chosen))
    try:
        resolved = absolute.resolve()
    except (OSError, RuntimeError):  # a link loop: the open fails later, and is logged then
        resolved = absolute
    seen = set()
    for place in (absolute, *absolute.parents, resolved, *resolved.parents):
        if place in seen:
            continue
        seen.add(place)
        try:
            info = os.lstat(place)
        except (FileNotFoundError, NotADirectoryError):
            continue  # created 0700 by the first write (which fails, logged, under a file)
        except OSError as error:
            return f"{place} cannot be checked ({error.strerror or error}); point {ENV} at a folder of your own"
        reason = _untrusted(info, "it" if place == absolute else str(place))
        if reason is not None:
            return reason
    return None


def _untrusted(info: os.stat_result, what: str) -> str | None:
    """Rule 6 for one file or folder: why someone other than the user and root may change it, with the fix."""
    if not hasattr(os, "geteuid"):
        return None
    me = os.geteuid()
    elsewhere = f"or point {ENV} at a folder of your own (or set it to 'off')"
    if info.st_uid not in (me, 0):
        return f"{what} is owned by uid {info.st_uid}, not by you (uid {me}) or root: chown it to yourself, {elsewhere}"
    mode = info.st_mode
    if stat.S_ISLNK(mode) or (stat.S_ISDIR(mode) and mode & stat.S_ISVTX):
        return None  # a link's own bits mean nothing; in a sticky folder others cannot replace the user's files
    sticky = " (or chmod +t it, a folder shared on purpose)" if stat.S_ISDIR(mode) else ""
    if mode & stat.S_IWOTH:
        return f"{what} is writable by every user: chmod go-w it{sticky}, {elsewhere}"
    if mode & stat.S_IWGRP and not _private_group(info.st_gid):
        return f"{what} is writable by group {info.st_gid}: chmod go-w it{sticky}, {elsewhere}"
    return None


def _private_group(gid: int) -> bool:
    """Whether group ``gid`` is the user's own: their primary group, named after them, with no other members."""
    try:
        import grp
        import pwd

        user, group = pwd.getpwuid(os.geteuid()), grp.getgrgid(gid)
    except (ImportError, KeyError, OSError):
        return False
    return gid == user.pw_gid and group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}


@contextlib.contextmanager
def _open(path: Path, flags: int) -> Iterator[Any]:
    """``path`` opened without following a link or blocking, if it is a regular file (rule 5) that only the user
    (or root) may change (rule 6); an OSError saying why otherwise. Created for the user alone."""
    flags |= getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, _PRIVATE)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path} is not a regular file")
        reason = _untrusted(info, "it")
        if reason is not None:
            raise OSError(reason)
        handle = os.fdopen(fd, "rb" if flags & os.O_ACCMODE == os.O_RDONLY else "r+b")
    except BaseException:
        os.close(fd)
        raise
    with handle:
        yield handle


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` for the block (advisory; no lock where the platform has no flock). The
    lock file is opened as a table is (rule 5): a link or a FIFO there is an OSError, never followed."""
    try:
        import fcntl
    except ImportError:  # Windows: os.replace alone keeps the file whole; concurrent merges may lose entries
        yield
        return
    with _open(path, os.O_RDWR | os.O_CREAT) as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
