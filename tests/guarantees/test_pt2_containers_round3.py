"""The containers of a .pt2 file cost what their bytes cost: the file itself, the zip inside it, its pickle and
its JSON.

Each attack is a file under 1 MB that an earlier amppass read at gigabytes or for a minute: sample inputs whose
pickle asks torch's weights-only unpickler for ``bytearray(N)``; sample inputs whose zip has a second directory
that only torch's reader finds, naming a deflated record of a gigabyte; a deflated JSON entry (the program or
amppass's own plan) of tens of megabytes; a sparse file of 4 GiB that takes 20 KB of disk. Each is refused with
an InputError naming the entry before torch, json or the private copy sees it, and
:func:`test_hostile_containers_stay_within_the_budget` measures each in a fresh process against an honest load:
at most 500 MB more memory and 10 s more CPU (the budget the docs state), with generous margins.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch

import amppass
from amppass import InputError
from amppass.archive import layout
from amppass.cli import main
from tests.helpers.paths import ROOT
from tests.helpers.pt2_files import (
    SAMPLES,
    X,
    bytearray_samples,
    json_padding,
    nested_bomb,
    rewrite,
    sparse_copy,
)

MODEL_JSON, PLAN = "models/model.json", "extra/amppass.json"
ATTACKS = {  # name -> (edit, entries deflated, the entry the error names, words it says)
    "bytearray": (bytearray_samples(1 << 30), (), SAMPLES, "names '__builtin__.bytearray'"),
    "nested-directories": (nested_bomb(960 << 20), (), SAMPLES, "entry 'data/0' reads as 1,006,632,960 bytes"),
    "deflated-program": (json_padding(MODEL_JSON, 11_000_000), (MODEL_JSON,), MODEL_JSON,
                         "compressed JSON entries past 1,048,576 bytes"),
    "deflated-plan": (json_padding(PLAN, 5_000_000), (PLAN,), PLAN, "compressed JSON entries past 1,048,576 bytes"),
}

WEIGHTS = tuple(f"data/weights/weight_{i}" for i in range(4))
LOADED = {  # name -> (edit, entries deflated): files within the bounds, which load, at the most they can cost
    "deflated-payloads": (lambda entries: entries.update({w: bytes(31 << 20) for w in WEIGHTS}), WEIGHTS),
}


def _attack(saved, folder: Path, name: str) -> Path:
    edit, compress = {**ATTACKS, **LOADED}[name][:2]
    path = rewrite(saved["converted"], folder / f"{name}.pt2", edit, compress=compress)
    assert path.stat().st_size < 1 << 20, f"{name}: {path.stat().st_size:,} bytes"
    return path


@pytest.mark.parametrize("name", ATTACKS)
def test_hostile_containers_are_refused_naming_the_entry_on_every_way_in(saved, tmp_path, name, capsys):
    path = _attack(saved, tmp_path, name)
    _, _, entry, words = ATTACKS[name]
    for read in (amppass.load, amppass.load_program):
        with pytest.raises(InputError) as caught:
            read(path)
        assert str(path) in str(caught.value) and entry in str(caught.value) and words in str(caught.value)
    assert main(["report", str(path)]) == 1
    assert main(["convert", str(path), "-o", str(tmp_path / "out.pt2")]) == 1
    err = capsys.readouterr().err
    assert err.count("amppass: error:") == 2 and entry in err and "Traceback" not in err
    assert not (tmp_path / "out.pt2").exists()


def test_a_sparse_file_is_refused_before_it_is_copied(saved, tmp_path, monkeypatch):
    """4 GiB of holes and a 20 KB archive: refused from the holes, and no temporary file is made."""
    made = []
    monkeypatch.setattr(tempfile, "TemporaryFile", lambda *a, **k: made.append(a) or pytest.fail("copied"))
    sparse = sparse_copy(saved["converted"], tmp_path / "sparse.pt2", 4 << 30)
    try:
        assert sparse.stat().st_blocks * 512 < 1 << 20  # what the disk holds
        with pytest.raises(InputError, match=r"sparse\.pt2: the file is sparse: at least 4,294,967,296 of its "
                                             r"4,294,98\d,\d{3} bytes are holes .*cp --sparse=never"):
            amppass.load(sparse)
        assert main(["report", str(sparse)]) == 1
    finally:
        sparse.unlink()
    assert not made


def test_an_honest_file_with_small_compressed_json_entries_still_loads(saved, tmp_path):
    """The JSON bound is on what deflated entries inflate to: an archive rezipped with every entry deflated loads."""
    with zipfile.ZipFile(saved["converted"]) as archive:
        names = tuple(i.filename.partition("/")[2] for i in archive.infolist())
    zipped = rewrite(saved["converted"], tmp_path / "zipped.pt2", lambda e: None, compress=names)
    with torch.no_grad():
        assert torch.equal(amppass.load(zipped)(X[0]), amppass.load(saved["converted"])(X[0]))


_PROBE = """
import resource, sys
import amppass
before = resource.getrusage(resource.RUSAGE_SELF)
try:
    amppass.load(sys.argv[1])
    outcome = "loaded"
except amppass.AmpPassError as err:
    outcome = type(err).__name__
after = resource.getrusage(resource.RUSAGE_SELF)
print(outcome, after.ru_maxrss * 1024, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
"""


def _cost(path: Path) -> tuple[str, int, float]:
    """(outcome, peak resident bytes, CPU seconds of the load) of ``amppass.load(path)`` in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", _PROBE, str(path)], capture_output=True, text=True, timeout=600,
                          env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    outcome, peak, cpu = done.stdout.split()[-3:]
    return outcome, int(peak), float(cpu)


def test_hostile_containers_stay_within_the_budget(saved, tmp_path):
    """Each attack of a file under 1 MB, loaded in a fresh process: at most 500 MB more peak memory and 10 s more
    CPU than loading the honest file it was made from (each took 1 GB or more, or a minute, before); and a file
    that stays within every bound (deflated weights of 124 MiB) loads within the budget too."""
    outcome, honest_peak, honest_cpu = _cost(saved["converted"])
    assert outcome == "loaded"
    for name in [*ATTACKS, *LOADED]:
        outcome, peak, cpu = _cost(_attack(saved, tmp_path, name))
        assert outcome == ("loaded" if name in LOADED else "InputError"), name
        assert peak - honest_peak < 500 << 20, f"{name}: {peak - honest_peak:,} bytes more than an honest load"
        assert cpu - honest_cpu < 10, f"{name}: {cpu - honest_cpu:.1f} s more CPU than an honest load"


def test_the_file_size_cap_is_raised_by_its_environment_variable(saved, monkeypatch):
    size = saved["converted"].stat().st_size
    monkeypatch.setenv(layout.ENV_MAX_FILE, str(size - 1))
    with pytest.raises(InputError, match=f"holds {size:,} bytes, more than the {size - 1:,} amppass reads; .* "
                                         f"set the environment variable AMPPASS_MAX_PT2_BYTES"):
        amppass.load(saved["converted"])
    monkeypatch.setenv(layout.ENV_MAX_FILE, str(size))
    assert isinstance(amppass.load(saved["converted"]), torch.nn.Module)
    monkeypatch.setenv(layout.ENV_MAX_FILE, "lots")
    with pytest.raises(InputError, match="AMPPASS_MAX_PT2_BYTES='lots' is not a whole number"):
        amppass.load(saved["converted"])
