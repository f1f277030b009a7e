"""Property: a hostile .pt2 archive or timing-cache file gives a working model / table or an AmpPassError,
and never runs code from the file.

Hypothesis edits an archive amppass.save wrote the ways tests/guarantees/test_fuzz_hostile.py edits ONNX files: its
program (a node handed a Python function or an op that is not torch's to call, guards of costly arithmetic), its
manifest (payload configs flagged as pickles, payload files renamed to the prefixes torch unpickles, tensor
descriptions missing), its entries (pickles that write a marker file, compiled-code and legacy entries, names
that differ only in case, climb out or are not ASCII, compressed entries), its JSON (cut short, nested deep,
bytes that are not text, symbolic sizes that are Python, padded with values and deflated) and the plan entry;
the zip inside it (sample inputs whose pickle allocates, a second directory naming a deflated record, a name
twice ignoring case, an entry before the honest one of the same name); and its zip structure byte by
byte (a second directory only torch's reader finds, records that share bytes, contradicting zip64 sizes, NULs
in names, flipped bytes, a cut). Whatever comes out,
``amppass.load`` returns a module whose report renders, or raises :class:`amppass.AmpPassError`, and the
marker file never appears. Cache files get the same treatment: any content or kind of file reads as a table
of finite times (often empty) and updates without raising or touching anything outside the folder.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pickle
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import amppass
from amppass import AmpPassError
from amppass.reporting.terminal import render_text
from amppass.targets.timing_cache import TimingCache
from tests.helpers.pt2_files import (
    SAMPLES,
    Payload,
    X,
    bytearray_samples,
    calling_node,
    guards,
    json_padding,
    mlp,
    nested_bomb,
    pickled,
    rewrite,
)
from tests.helpers.zipbytes import ZIP64, Entry, entries_of, write, zip64_extra

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
CONFIGS = ["data/weights/model_weights_config.json", "data/constants/model_constants_config.json"]
PATH_NAMES = ["weight_0", "weight_1", "tensor_0", "opaque_obj_0", "custom_obj_0", "../weight_0", "missing", 7]
ADDED = ["data/aotinductor/model/model.so", "data/weights/model.pt", "data/constants/model.pt",
         "DATA/weights/weight_0", "data/weights/WEIGHT_0", "extra/other.json", "models/other.json",
         "data/constants/opaque_obj_0", "data/constants/custom_obj_0", "data/executorch/x", "../escape", "données"]
EXPRESSIONS = ["open({marker!r}, 'w').write('x')", "__import__('os').system('touch {marker}')",
               "Symbol('s0', positive=True, integer=True)", "s0 + 1", "Pow(Integer(9), Integer(9999))", "", "(((",
               "().__class__"]
JSONS = ["models/model.json", *CONFIGS, "extra/amppass.json"]
# a node inserted first: (its target, the operator it is handed); torch resolves both by name
TARGETS = ["torch.ops.higher_order.wrap", "torch.ops.higher_order.cond", "torch.ops.higher_order.map_impl",
           "torch.ops.higher_order.call_torchbind", "torch.os.system", "builtins.eval", "_operator.add", "#x:y"]
OPERATORS = ["torch.os.system", "math.os.system", "_operator.attrgetter", "torch.ops.aten.relu.default",
             "torch.ops.aten.from_file.default", "torch.ops.aten.__class__.__init__", "torch.ops.load_library",
             "torch.ops.higher_order.wrap", "torch._C._get_tracing_state", "eval"]


@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fuzz") / "converted.pt2"
    amppass.save(amppass.convert(mlp(), X, "bf16", plan_for="coverage"), path)
    return path


@st.composite
def edits(draw):
    config = {"which": draw(st.sampled_from(CONFIGS)),
              "use_pickle": draw(st.sampled_from([False, True, "false", 1, None])),
              "path_name": draw(st.sampled_from(PATH_NAMES)),
              "tensor_meta": draw(st.sampled_from(["keep", None, "x"]))} if draw(st.booleans()) else None
    added = draw(st.lists(st.tuples(st.sampled_from(ADDED), st.sampled_from(["pickle", "junk", "empty"])),
                          max_size=2))
    damaged = (draw(st.sampled_from(JSONS)), draw(st.sampled_from(["cut", "deep", "bytes", "list"]))) \
        if draw(st.booleans()) else None
    expression = draw(st.sampled_from(EXPRESSIONS)) if draw(st.booleans()) else None
    samples = draw(st.sampled_from([None, "pickle", "junk", "empty", "bytearray", "nested-bomb", "nested-case-twin",
                                    "nested-junk"]))
    compress = draw(st.lists(st.sampled_from(JSONS + ["data/weights/weight_0", SAMPLES]), max_size=2))
    operator = (draw(st.sampled_from(TARGETS)), draw(st.sampled_from(OPERATORS))) if draw(st.booleans()) else None
    guard = draw(guards()) if draw(st.booleans()) else None
    padding = (draw(st.sampled_from(JSONS)), draw(st.sampled_from([10, 1000, 400_000]))) \
        if draw(st.booleans()) else None
    return config, added, damaged, expression, samples, compress, operator, guard, padding


def _apply(entries: dict[str, bytes], case, marker: Path) -> None:
    config, added, damaged, expression, samples, _, operator, guard, padding = case
    evil = pickled(Payload(marker, [8, 8], "bfloat16"))
    if config is not None:
        table = json.loads(entries[config["which"]])
        if not table["config"]:
            table["config"]["x"] = {"path_name": "tensor_0", "is_param": False, "use_pickle": False,
                                    "tensor_meta": {}}
        meta = next(iter(table["config"].values()))
        meta.update(use_pickle=config["use_pickle"], path_name=config["path_name"])
        if config["tensor_meta"] != "keep":
            meta["tensor_meta"] = config["tensor_meta"]
        if isinstance(config["path_name"], str):
            folder = config["which"].rsplit("/", 1)[0]
            entries[f"{folder}/{config['path_name']}"] = pickle.dumps(Payload(marker, [1], "float32")) \
                if "obj" in config["path_name"] else evil
        entries[config["which"]] = json.dumps(table).encode()
    for name, content in added:
        entries[name] = {"pickle": evil, "junk": b"\x00junk", "empty": b""}[content]
    if expression is not None:
        text = entries["models/model.json"].decode()
        start = text.find('"expr_str": "')
        if start >= 0:
            end = text.index('"', start + 13)
            text = text[:start + 12] + json.dumps(expression.format(marker=str(marker))) + text[end + 1:]
        entries["models/model.json"] = text.encode()
    if operator is not None or guard is not None:
        tree = json.loads(entries["models/model.json"])
        if operator is not None:
            calling_node(*operator, f"touch {marker}")(tree)
        if guard is not None:
            tree["guards_code"].append(guard)
        entries["models/model.json"] = json.dumps(tree).encode()
    if damaged is not None:
        name, how = damaged
        data = entries[name]
        entries[name] = {"cut": data[:len(data) // 2], "deep": b"[" * 50_000 + b"]" * 50_000,
                         "bytes": b"\xff\xfe\xfa" + data, "list": b"[]"}[how]
    if padding is not None and entries.get(padding[0], b"").rstrip().endswith(b"}"):
        json_padding(*padding)(entries)  # deflated too when compress names it: JSON that inflates
    if samples in ("bytearray", "nested-bomb"):
        (bytearray_samples(64 << 20) if samples == "bytearray" else nested_bomb(64 << 20))(entries)
    elif samples in ("nested-case-twin", "nested-junk"):
        inner = entries_of(io.BytesIO(entries[SAMPLES]))
        extra = "DATA.PKL" if samples == "nested-case-twin" else "data/0"
        inner.insert(0, Entry(f"{inner[0].name.partition('/')[0]}/{extra}", pickled(Payload(marker, [1], "float32"))))
        entries[SAMPLES] = write(inner)
    elif samples is not None:
        entries[SAMPLES] = {"pickle": pickled(((Payload(marker, [2, 8], "float32"),), {})),
                            "junk": b"PK\x03\x04junk", "empty": b""}[samples]


@SETTINGS
@given(case=edits())
def test_hostile_archives_load_validly_or_raise_amppass_errors(archive, case):
    with tempfile.TemporaryDirectory() as folder:
        marker = Path(folder) / "marker"
        path = rewrite(archive, Path(folder) / "hostile.pt2", lambda e: _apply(e, case, marker),
                       compress=tuple(case[5]))
        try:
            loaded = amppass.load(path)
        except AmpPassError:
            loaded = None
        assert not marker.exists(), f"code from the file ran: {case}"
        if loaded is not None:
            with torch.no_grad(), contextlib.suppress(AmpPassError):  # a guard the call fails: a mismatch
                loaded(X[0])
            assert not marker.exists(), f"code from the file ran: {case}"
            render_text(amppass.report(loaded), width=80)


@st.composite
def zip_tricks(draw):
    """Byte-level edits of the archive: a second directory only torch's reader finds, a record pointing into
    another entry, sizes a zip64 extra contradicts, a NUL in a name, a byte flipped, the file cut short."""
    return draw(st.lists(st.tuples(st.sampled_from(["second-directory", "overlap", "zip64-sizes", "nul", "flip",
                                                    "cut"]),
                                   st.integers(0, 1 << 20), st.integers(0, 1 << 20)), min_size=1, max_size=3))


def _zip_bytes(archive: Path, tricks, marker: Path) -> bytes:
    entries = entries_of(archive)
    weights = next(e for e in entries if e.name.endswith("model_weights_config.json"))
    config = json.loads(weights.data)
    meta = next(iter(config["config"].values()))
    evil = pickled(Payload(marker, [8, 8], "bfloat16", parameter=True))
    theirs, flips, cut = None, [], None
    for trick, a, b in tricks:
        victim = entries[a % len(entries)]
        if trick == "second-directory":  # torch's reader sees the weights config and first weight as pickles
            evil_config = json.loads(weights.data)
            next(iter(evil_config["config"].values()))["use_pickle"] = True
            root = weights.name.partition("/")[0]
            decoys = {weights.name: Entry(f"{root}/extra/decoy.json", json.dumps(evil_config).encode()),
                      f"{root}/data/weights/{meta['path_name']}": Entry(f"{root}/extra/payload.bin", evil)}
            entries += decoys.values()
            theirs = [Entry(e.name, decoys[e.name].data, points_at=decoys[e.name].name) if e.name in decoys else e
                      for e in entries]
        elif trick == "overlap":
            entries.append(Entry(victim.name + "_twin", victim.data, local=False, header_offset=b % 4096))
        elif trick == "zip64-sizes":
            victim.central_sizes = (ZIP64, ZIP64)
            victim.central_extra = zip64_extra(len(victim.data), len(victim.data)) + zip64_extra(b, b)
        elif trick == "nul":
            victim.name += "\x00x"
        elif trick == "flip":
            flips.append((a, b % 256))
        else:
            cut = a
    data = bytearray(write(entries, theirs))
    for at, value in flips:
        data[at % len(data)] = value
    return bytes(data[:cut % len(data)] if cut else data)


@SETTINGS
@given(tricks=zip_tricks())
def test_zip_level_tricks_load_validly_or_raise_amppass_errors(archive, tricks):
    with tempfile.TemporaryDirectory() as folder:
        marker = Path(folder) / "marker"
        path = Path(folder) / "tricked.pt2"
        path.write_bytes(_zip_bytes(archive, tricks, marker))
        try:
            loaded = amppass.load(path)
        except AmpPassError:
            loaded = None
        assert not marker.exists(), f"code from the file ran: {tricks}"
        if loaded is not None:
            with torch.no_grad():
                loaded(X[0])


CONTENTS = st.one_of(
    st.binary(max_size=64),
    st.recursive(st.none() | st.booleans() | st.floats(allow_nan=True) | st.integers() | st.text(max_size=4),
                 lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                 max_leaves=8).map(lambda v: json.dumps(v).encode()),
    st.integers(1, 5000).map(lambda n: b'{"entries": ' * n),
    st.sampled_from([b"[" * 100_000, b'{"fingerprint": null, "entries": {"k": 1e999}}']),
)


@SETTINGS
@given(kind=st.sampled_from(["file", "folder", "fifo", "link-out", "dangling", "lock-link"]), content=CONTENTS,
       with_fingerprint=st.booleans())
def test_hostile_cache_files_read_as_a_table_of_times(kind, content, with_fingerprint):
    found = {"device": "cpu", "fuzz": 1}
    with tempfile.TemporaryDirectory() as root:
        folder, outside = Path(root) / "cache", Path(root) / "outside"
        folder.mkdir(), outside.mkdir()
        path = TimingCache(found, folder).path
        if with_fingerprint and content[:1] == b"{":
            content = json.dumps({"fingerprint": found, "entries": {"k": content.decode("latin-1")}}).encode()
        target = outside / "target.json"
        target.write_bytes(content)
        if kind == "file":
            path.write_bytes(content)
        elif kind == "folder":
            path.mkdir()
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "link-out":
            path.symlink_to(target)
        elif kind == "dangling":
            path.symlink_to(outside / "nothing")
        else:
            path.with_suffix(".lock").symlink_to(outside / "lock")
        cache = TimingCache(found, folder)
        assert all(isinstance(v, float) and math.isfinite(v) and v >= 0 for v in cache.entries.values())
        cache.add({"new": 1e-6})
        assert sorted(p.name for p in outside.iterdir()) == ["target.json"]
        assert target.read_bytes() == content
