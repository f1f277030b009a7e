"""amppass.files: a set of outputs lands whole or not at all, never twice on one file, and names what failed."""

from __future__ import annotations

import errno
import os

import pytest

from amppass import InputError, files
from amppass.files import Staged, WriteError, write_atomic


def test_two_outputs_of_one_set_that_name_one_file_are_refused(tmp_path):
    (tmp_path / "a.json").write_text("mine")
    os.symlink("a.json", tmp_path / "b.json")
    with pytest.raises(InputError, match=r"two outputs name one file, '.*b\.json' \(through a link, '.*a\.json'\)"):
        with Staged() as staged:
            staged.write(tmp_path / "a.json", "first")
            staged.write(tmp_path / "b.json", "second")
    assert (tmp_path / "a.json").read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["a.json", "b.json"]


def test_a_link_is_followed_and_its_target_replaced(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "r.json").write_text("old")
    os.chmod(tmp_path / "real" / "r.json", 0o640)
    os.symlink(os.path.join("real", "r.json"), tmp_path / "r.json")
    write_atomic(tmp_path / "r.json", "new")
    assert os.path.islink(tmp_path / "r.json") and (tmp_path / "real" / "r.json").read_text() == "new"
    assert os.stat(tmp_path / "real" / "r.json").st_mode & 0o777 == 0o640
    assert sorted(os.listdir(tmp_path / "real")) == ["r.json"]


def test_a_write_that_fails_without_a_file_name_names_the_output(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full)
    with pytest.raises(WriteError) as caught:
        write_atomic(tmp_path / "r.json", "text")
    assert str(caught.value).startswith(f"cannot write {tmp_path / 'r.json'}: No space left on device")
    assert os.listdir(tmp_path) == []


def test_amppass_own_files_replace_a_link_instead_of_writing_through_it(tmp_path):
    (tmp_path / "target.json").write_text("theirs")
    os.symlink("target.json", tmp_path / "cache.json")
    write_atomic(tmp_path / "cache.json", "times", mode=0o600, follow_links=False)
    assert not os.path.islink(tmp_path / "cache.json") and (tmp_path / "cache.json").read_text() == "times"
    assert (tmp_path / "target.json").read_text() == "theirs"
