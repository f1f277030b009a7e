"""amppass.archive.layout and the private copy: one reading of a .pt2 file, bounded, taken once.

The hostile archives here are written byte by byte (tests/helpers/zipbytes.py): a second central directory
that only torch's zip reader finds, entries that share bytes, names cut at a NUL, files cut short anywhere;
and a file rewritten on disk after amppass opened it.
"""

from __future__ import annotations

import copy
import json
import os
import zipfile

import pytest
import torch

import amppass
from amppass import InputError
from amppass.archive import MAX_EXTRA, Pt2Archive
from amppass.archive import layout as archive_layout
from amppass.cli import main
from tests.helpers.pt2_files import X, pickled_weight, rewrite
from tests.helpers.zipbytes import Entry, entries_of, write

PLAN = "extra/amppass.json"


def _named(entries: list[Entry], name: str) -> Entry:
    return next(e for e in entries if e.name.partition("/")[2] == name)


def test_a_second_directory_only_torch_reads_is_refused(saved, tmp_path, monkeypatch):
    """Python's zipfile reads the zip64 end record just before the locator, torch's reader the one the locator
    points at: an extra file of 20 MiB that Python's directory calls 1 KiB would pass the 16 MiB bound. The 20 MiB
    no entry of Python's directory holds refuse it before the copy; with that check off, one reading does."""
    ours = entries_of(saved["converted"])
    root = ours[0].name.partition("/")[0]
    big = Entry(f"{root}/extra/notes.txt", b" " * (MAX_EXTRA + (4 << 20)))
    ours.append(big)
    theirs = copy.deepcopy(ours)
    big.central_sizes = (1024, 1024)
    path = tmp_path / "two-directories.pt2"
    path.write_bytes(write(ours, theirs))
    with zipfile.ZipFile(path) as archive:
        assert archive.getinfo(big.name).file_size == 1024  # what Python's checks would have bounded
    with pytest.raises(InputError, match="20,971,676 bytes of the file belong to no entry of its zip directory"):
        amppass.load(path)
    monkeypatch.setattr(archive_layout, "MAX_SLACK", 1 << 40)
    with pytest.raises(InputError, match="extra/notes.txt' reads as 20,971,520 bytes .* to torch's zip reader and "
                                         "1,024 .* to Python's"):
        amppass.load(path)


def test_entries_that_share_bytes_are_refused(saved, tmp_path):
    """A second directory record pointing inside another entry's data, where a local header for it was
    planted: each byte of the file is read once at most."""
    entries = entries_of(saved["converted"])
    root = entries[0].name.partition("/")[0]
    inner = write([Entry(f"{root}/extra/twin.txt", b"x" * 64)])
    carrier = Entry(f"{root}/extra/carrier.txt", inner)
    entries.insert(0, carrier)
    planted = Entry(f"{root}/extra/twin.txt", b"x" * 64, local=False, header_offset=30 + len(carrier.name))
    entries.append(planted)
    path = tmp_path / "shared.pt2"
    path.write_bytes(write(entries))
    with pytest.raises(InputError, match="shares bytes with entry 'extra/carrier.txt'"):
        amppass.load(path)


def test_a_name_cut_at_a_nul_is_an_input_error(saved, tmp_path):
    entries = entries_of(saved["converted"])
    _named(entries, PLAN).name += "\x00.pickle"
    path = tmp_path / "nul.pt2"
    path.write_bytes(write(entries))
    with pytest.raises(InputError, match=r"\\x00"):
        amppass.load(path)


def test_a_file_cut_short_anywhere_is_an_input_error(saved, tmp_path, capsys):
    data = saved["converted"].read_bytes()
    for cut in sorted({1, 22, 100, len(data) // 3, len(data) // 2, len(data) - 200, len(data) - 23, len(data) - 1}):
        torn = tmp_path / f"torn-{cut}.pt2"
        torn.write_bytes(data[:cut])
        with pytest.raises(InputError, match=str(torn)):
            amppass.load(torn)
        assert main(["report", str(torn)]) == 1
    assert "Traceback" not in capsys.readouterr().err


def test_a_file_rewritten_after_it_was_opened_is_never_read(saved, tmp_path):
    """The checks pass on the clean file; then the same file (same inode) is rewritten in place with a pickle
    both layouts carry. torch reads amppass's private copy, so the pickle never runs."""
    marker = tmp_path / "marker"
    clean = tmp_path / "model.pt2"
    clean.write_bytes(saved["converted"].read_bytes())
    evil = rewrite(saved["converted"], tmp_path / "evil.pt2", pickled_weight(marker)).read_bytes()
    with Pt2Archive(clean) as archive:
        with open(clean, "r+b") as same:
            same.write(evil)
            same.truncate()
        program = archive.load()
    assert not marker.exists()
    assert isinstance(program, torch.export.ExportedProgram)
    assert clean.read_bytes() == evil  # the rewrite did land on disk


def test_the_private_copy_is_unnamed_and_closed_with_the_archive(saved, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    with Pt2Archive(saved["converted"]) as archive:
        assert os.fstat(archive.handle.fileno()).st_nlink == 0 and not list(tmp_path.iterdir())
        archive.handle.seek(0)
        assert archive.handle.read(4) == b"PK\x03\x04"
    assert archive.handle.closed


def test_a_file_that_shrinks_while_it_is_copied_is_an_input_error(saved, monkeypatch):
    import amppass.archive as archive_module

    real = os.fstat

    class Larger:
        def __init__(self, result):
            self.result = result

        def __getattr__(self, name):
            value = getattr(self.result, name)
            return value + 4096 if name == "st_size" else value

    monkeypatch.setattr(archive_module.os, "fstat", lambda fd: Larger(real(fd)))
    with pytest.raises(InputError, match="became shorter while it was read"):
        Pt2Archive(saved["converted"])


def test_archives_torch_and_amppass_write_still_load(saved, tmp_path):
    """The layout checks pass what torch.export.save writes (aligned entries, data descriptors) and what Python's
    zipfile writes when a file is edited and saved again."""
    edited = rewrite(saved["converted"], tmp_path / "edited.pt2", lambda e: None)
    for path in (saved["converted"], saved["plain"], edited):
        program = amppass.load_program(path)
        assert torch.equal(program.module()(*X), torch.export.load(path).module()(*X))
    plan = json.loads(zipfile.ZipFile(saved["converted"]).read(f"archive/{PLAN}"))
    assert plan["dtype"] == "bf16"


def _no_copy(monkeypatch) -> None:
    """Fail the test if amppass makes its private copy."""
    import tempfile

    monkeypatch.setattr(tempfile, "TemporaryFile", lambda *a, **k: pytest.fail("the file was copied"))


def test_bytes_no_entry_holds_are_refused_before_the_copy(saved, tmp_path, monkeypatch):
    """2 MiB of real bytes in front of the archive (Python's zipfile reads past them): no entry holds them."""
    _no_copy(monkeypatch)
    padded = tmp_path / "padded.pt2"
    padded.write_bytes(os.urandom(2 << 20) + saved["converted"].read_bytes())
    with pytest.raises(InputError, match=r"padded.pt2: 2,097,152 bytes of the file belong to no entry of its zip "
                                         r"directory \(at most 1,048,576\)"):
        amppass.load(padded)


def test_holes_inside_an_entry_are_refused_before_the_copy(saved, tmp_path, monkeypatch):
    """An extra file of 12 MiB whose bytes are a hole: the directory holds the file, the disk does not."""
    _no_copy(monkeypatch)
    entries = entries_of(saved["converted"])
    root = entries[0].name.partition("/")[0]
    hole = 12 << 20
    entries.insert(0, Entry(f"{root}/extra/zeros.bin", bytes(hole)))
    data = write(entries)
    start = data.index(bytes(hole))
    path = tmp_path / "holed.pt2"
    with open(path, "wb") as out:
        out.write(data[:start])
        out.seek(start + hole)  # leaves the entry's bytes a hole
        out.write(data[start + hole:])
    assert path.stat().st_size == len(data) and path.stat().st_blocks * 512 < 4 << 20
    with pytest.raises(InputError, match="holed.pt2: the file is sparse: at least 1[12],.* bytes are holes"):
        amppass.load(path)


@pytest.mark.parametrize("trick, words", [
    ("case-twin", "entry 'archive/DATA.PKL' is in the archive twice"),
    ("outside-root", "entry 'other/x' is not a file under the archive's folder"),
    ("shared-bytes", "entry 'twin' has a local header that does not name it"),
], ids=["case-twin", "outside-root", "shared-bytes"])
def test_the_sample_inputs_zip_is_held_to_the_archive_s_rules(saved, tmp_path, trick, words):
    import io

    def edit(entries):
        inner = entries_of(io.BytesIO(entries["data/sample_inputs/model.pt"]))
        root = inner[0].name.partition("/")[0]
        if trick == "case-twin":
            inner.append(Entry(f"{root}/DATA.PKL", b"\x80\x02N."))
        elif trick == "outside-root":
            inner.append(Entry("other/x", b"x"))
        else:
            inner.append(Entry(f"{root}/twin", b"", local=False, points_at=f"{root}/data/0"))
        entries["data/sample_inputs/model.pt"] = write(inner)

    with pytest.raises(InputError, match=f"entry 'data/sample_inputs/model.pt'.*{words}"):
        amppass.load(rewrite(saved["converted"], tmp_path / "inner.pt2", edit))


def test_a_filesystem_that_cannot_tell_holes_reads_the_file(saved, monkeypatch):
    """SEEK_DATA refused (EINVAL, as some network filesystems do): no hole is counted, and the file loads."""
    import errno

    real = os.lseek

    def lseek(fd, at, how):
        if how == os.SEEK_DATA:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, at, how)

    monkeypatch.setattr(archive_layout.os, "lseek", lseek)
    assert isinstance(amppass.load_program(saved["converted"]), torch.export.ExportedProgram)
