"""The timing cache ($AMPPASS_CACHE) read as untrusted: nothing hangs or crashes, nothing outside is touched.

The folder may be shared, or a folder of the user's own that they pointed AMPPASS_CACHE at: a table that is
deeply nested, huge, a FIFO or a link, a lock that is a link out of the folder, and the user's own files
older than the clean-up age must each leave the conversion running and everything else as it was.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from amppass.targets import timing_cache
from amppass.targets.timing_cache import TimingCache

FOUND = {"device": "cpu", "cpu": "test", "torch": "2.13.0"}


def table(folder: Path) -> Path:
    return TimingCache(FOUND, folder).path


def read_within(folder: Path, seconds: float = 20.0) -> TimingCache:
    """TimingCache(FOUND, folder), failing if reading the table takes longer than ``seconds``."""
    done: list[TimingCache] = []
    reader = threading.Thread(target=lambda: done.append(TimingCache(FOUND, folder)), daemon=True)
    reader.start()
    reader.join(seconds)
    assert done, f"reading the cache did not finish in {seconds} s"
    return done[0]


def test_a_deeply_nested_table_reads_as_empty_with_one_warning(tmp_path, caplog):
    table(tmp_path).write_text("[" * 200_000 + "]" * 200_000)
    with caplog.at_level(logging.WARNING, logger="amppass"):
        for _ in range(3):
            assert TimingCache(FOUND, tmp_path).entries == {}
    assert caplog.text.count("unreadable") == 1 and "treated as empty" in caplog.text
    TimingCache(FOUND, tmp_path).add({"k": 1e-6})
    assert TimingCache(FOUND, tmp_path).entries == {"k": 1e-6}


@pytest.mark.parametrize("content", [b"\xff\xfe\x00", b'{"fingerprint": ' * 5000, b"null", b"[]", b'"text"'],
                         ids=["not-utf8", "cut-deep", "null", "list", "text"])
def test_a_table_that_is_not_ours_reads_as_empty(tmp_path, content):
    table(tmp_path).write_bytes(content)
    assert TimingCache(FOUND, tmp_path).entries == {}


def test_a_fifo_in_place_of_the_table_does_not_hang(tmp_path):
    os.mkfifo(table(tmp_path))
    assert read_within(tmp_path).entries == {}
    cache = TimingCache(FOUND, tmp_path)
    cache.add({"k": 1e-6})  # the FIFO is replaced by a table (renamed over it), never opened for writing
    assert TimingCache(FOUND, tmp_path).entries == {"k": 1e-6}


def test_a_huge_table_is_read_only_up_to_its_bound(tmp_path):
    with open(table(tmp_path), "wb") as handle:  # sparse: 600 MB of zeros on almost no disk
        handle.truncate(600 << 20)
    tracemalloc.start()
    try:
        cache = read_within(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert cache.entries == {} and peak < 3 * timing_cache.MAX_BYTES, f"{peak:,} bytes read"


def test_links_are_never_followed_for_the_table_or_the_lock(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    folder = tmp_path / "cache"
    folder.mkdir()
    secret = outside / "secret.json"
    secret.write_text(json.dumps({"fingerprint": FOUND, "entries": {"stolen": 1.0}}))
    table(folder).symlink_to(secret)
    assert TimingCache(FOUND, folder).entries == {}  # not read through the link
    lock = table(folder).with_suffix(".lock")
    lock.symlink_to(outside / "created-by-the-lock")
    TimingCache(FOUND, folder).add({"k": 1e-6})
    assert not (outside / "created-by-the-lock").exists()
    assert json.loads(secret.read_text())["entries"] == {"stolen": 1.0}


def test_clean_up_deletes_only_old_tables_amppass_wrote(tmp_path):
    """A folder of the user's own: their files, even old and named like ours, stay; an old table of
    another device that amppass wrote goes."""
    long_ago = time.time() - (timing_cache.STALE_DAYS + 1) * 86400
    old = TimingCache({**FOUND, "torch": "1.0.0"}, tmp_path)
    old.add({"k": 1.0})
    notes, lookalike, linked = (tmp_path / "notes.json", tmp_path / f"{timing_cache.PREFIX}0123456789abcdef.json",
                                tmp_path / f"{timing_cache.PREFIX}fedcba9876543210.json")
    notes.write_text('{"my": "notes"}')
    lookalike.write_text('{"fingerprint": {}, "entries": {}}')
    linked.symlink_to(old.path)
    (tmp_path / "notes.lock").write_text("")
    for path in (old.path, notes, lookalike, tmp_path / "notes.lock"):
        os.utime(path, (long_ago, long_ago))
    TimingCache(FOUND, tmp_path).add({"k": 2.0})
    assert not old.path.exists() and not old.path.with_suffix(".lock").exists()
    assert notes.read_text() == '{"my": "notes"}' and lookalike.exists() and (tmp_path / "notes.lock").exists()
    assert linked.is_symlink()


# -- entries and places amppass does not trust ------------------------------------------------------------

def _stored(folder: Path, entries: dict) -> Path:
    path = table(folder)
    path.write_text(json.dumps({"format": timing_cache.FORMAT, "fingerprint": FOUND, "entries": entries}))
    os.chmod(path, 0o600)
    return path


def test_an_entry_too_large_for_a_float_is_dropped_and_the_rest_read(tmp_path):
    """10**400 raised OverflowError from every conversion that opened the cache."""
    path = table(tmp_path)
    path.write_text('{"fingerprint": %s, "entries": {"ok": 2e-06, "huge": 1%s, "neg_huge": -1%s}}'
                    % (json.dumps(FOUND), "0" * 400, "0" * 400))
    cache = TimingCache(FOUND, tmp_path)
    assert cache.entries == {"ok": 2e-6}
    cache.add({"k": 1e-6})
    assert TimingCache(FOUND, tmp_path).entries == {"ok": 2e-6, "k": 1e-6}


OTHER = 54321  # a user id that is not this process's


def _owned_by_another(monkeypatch, path: Path) -> None:
    """``path`` owned by user OTHER: really (chown) as root; through os.stat/lstat/fstat's answers otherwise."""
    if os.geteuid() == 0:
        os.chown(path, OTHER, OTHER)
        return
    inode = os.lstat(path).st_ino

    def faked(real):
        def call(*args, **kwargs):
            found = real(*args, **kwargs)
            if found.st_ino != inode:
                return found
            fields = list(found)
            fields[4] = OTHER  # st_uid
            return os.stat_result(fields)
        return call

    for name in ("stat", "lstat", "fstat"):
        monkeypatch.setattr(os, name, faked(getattr(os, name)))


def _said(caplog, path: Path) -> int:
    """How many records name ``path``."""
    return sum(str(path) in record.getMessage() for record in caplog.records)


@pytest.fixture
def warnings(caplog):
    timing_cache._WARNED.clear()
    timing_cache._DISTRUSTED.clear()
    with caplog.at_level(logging.WARNING, logger="amppass"):
        yield caplog


def test_a_table_another_user_owns_is_not_read(tmp_path, monkeypatch, warnings):
    """A table planted in a shared folder (the user's AMPPASS_CACHE in /tmp): its times decided which regions
    stayed fp32. Not read (one warning saying how to fix it); amppass's own next table replaces it."""
    path = _stored(tmp_path, {"planted": 9.0})
    _owned_by_another(monkeypatch, path)
    for _ in range(3):
        assert TimingCache(FOUND, tmp_path).entries == {}
    assert _said(warnings, path) == 1 and f"uid {OTHER}" in warnings.text and "chown" in warnings.text


def test_a_table_others_may_write_is_not_read(tmp_path, warnings):
    path = _stored(tmp_path, {"planted": 9.0})
    os.chmod(path, 0o666)
    assert TimingCache(FOUND, tmp_path).entries == {}
    assert str(path) in warnings.text and "chmod go-w" in warnings.text
    os.chmod(path, 0o644)
    assert TimingCache(FOUND, tmp_path).entries == {"planted": 9.0}


@pytest.mark.parametrize("mode", [0o777, 0o757, 0o775], ids=["everyone", "others", "group"])
def test_a_folder_others_may_write_is_neither_read_nor_written(tmp_path, monkeypatch, mode, warnings):
    shared = tmp_path / "shared"
    shared.mkdir()
    planted = _stored(shared, {"planted": 9.0})
    os.chmod(shared, mode)
    if mode == 0o775:  # a group with other members
        if os.geteuid() == 0:
            os.chown(shared, 0, OTHER)  # (root's own group, gid 0, has no other members)
        else:
            monkeypatch.setattr(timing_cache, "_private_group", lambda gid: False)
    for _ in range(3):
        cache = TimingCache(FOUND, shared)
        assert cache.entries == {}
        cache.add({"k": 1e-6})
    assert [p.name for p in shared.iterdir()] == [planted.name]  # nothing written, no lock
    assert _said(warnings, shared) == 1 and "chmod go-w" in warnings.text and "AMPPASS_CACHE" in warnings.text
    assert "not used" in cache.describe()


def test_a_folder_only_the_users_own_group_may_write_is_used(tmp_path, monkeypatch, warnings):
    """Distributions that give each user a group of their own set umask 002: such a folder is the user's."""
    monkeypatch.setattr(timing_cache, "_private_group", lambda gid: gid == os.lstat(tmp_path / "mine").st_gid)
    (tmp_path / "mine").mkdir()
    os.chmod(tmp_path / "mine", 0o775)
    TimingCache(FOUND, tmp_path / "mine").add({"k": 1e-6})
    assert TimingCache(FOUND, tmp_path / "mine").entries == {"k": 1e-6} and not warnings.text


def test_a_folder_inside_a_folder_others_may_write_is_not_used(tmp_path, warnings):
    """Whoever may write the folder above may swap the cache folder itself."""
    (tmp_path / "open").mkdir()
    inner = tmp_path / "open" / "cache"
    inner.mkdir()
    _stored(inner, {"planted": 9.0})
    os.chmod(tmp_path / "open", 0o777)
    assert TimingCache(FOUND, inner).entries == {}
    assert str(tmp_path / "open") in warnings.text


def test_a_folder_another_user_owns_is_not_used(tmp_path, monkeypatch, warnings):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    _stored(theirs, {"planted": 9.0})
    _owned_by_another(monkeypatch, theirs)
    assert TimingCache(FOUND, theirs).entries == {}
    assert str(theirs) in warnings.text and f"uid {OTHER}" in warnings.text


def test_a_sticky_shared_folder_is_used_for_the_users_own_table_only(tmp_path, monkeypatch, warnings):
    """Like /tmp: others may create files there but not replace the user's; each file is checked itself."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    cache = TimingCache(FOUND, sticky)
    cache.add({"k": 1e-6})
    assert TimingCache(FOUND, sticky).entries == {"k": 1e-6} and not warnings.text
    assert stat.S_IMODE(table(sticky).stat().st_mode) & 0o077 == 0  # written for the user alone
    _owned_by_another(monkeypatch, table(sticky))
    assert TimingCache(FOUND, sticky).entries == {}
    assert f"uid {OTHER}" in warnings.text


def test_folders_amppass_creates_are_the_users_alone(tmp_path):
    old = os.umask(0o002)  # a umask that lets the group write new files and folders
    try:
        TimingCache(FOUND, tmp_path / "a" / "b").add({"k": 1e-6})
    finally:
        os.umask(old)
    for made in (tmp_path / "a", tmp_path / "a" / "b"):
        assert stat.S_IMODE(made.stat().st_mode) & 0o022 == 0, oct(made.stat().st_mode)
    assert TimingCache(FOUND, tmp_path / "a" / "b").entries == {"k": 1e-6}
