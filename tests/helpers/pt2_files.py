"""Archives for the .pt2 security tests: a saved model, and the edits an attacker makes to one.

A pickle whose ``__reduce__`` writes a marker file (and then hands back the real tensor, so the model would load
and run as if nothing happened); entries rewritten one by one. The ``saved`` fixture is registered for every test
by the root conftest.py.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path
from typing import Callable

import pytest
import torch
from hypothesis import strategies as st

import amppass

X = (torch.ones(2, 8),)  # the example call of mlp()


def mlp() -> torch.nn.Module:
    """A seeded 8 -> 8 -> 4 MLP in eval mode."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A converted model as amppass.save writes it, and the fp32 program as torch.export.save writes it."""
    folder = tmp_path_factory.mktemp("pt2")
    amppass.save(amppass.convert(mlp(), X, "bf16", plan_for="coverage"), folder / "converted.pt2")
    torch.export.save(torch.export.export(mlp(), X), folder / "plain.pt2")
    return {"converted": folder / "converted.pt2", "plain": folder / "plain.pt2"}


class Payload:
    """Pickled as a call that writes ``marker`` and returns ``value``'s tensor (what a real attack returns)."""

    def __init__(self, marker: Path, sizes: list[int], dtype: str, parameter: bool = False):
        self.marker, self.sizes, self.dtype, self.parameter = marker, sizes, dtype, parameter

    def __reduce__(self):
        tensor = f"__import__('torch').zeros({self.sizes}, dtype=__import__('torch').{self.dtype})"
        if self.parameter:
            tensor = f"__import__('torch').nn.Parameter({tensor}, requires_grad=False)"
        return eval, (f"(__import__('pathlib').Path({str(self.marker)!r}).write_text('ran'), {tensor})[1]",)


def pickled(value) -> bytes:
    """``value`` as torch.save writes it."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def rewrite(source: Path, target: Path, edit: Callable[[dict[str, bytes]], None],
            compress: tuple[str, ...] = ()) -> Path:
    """``source`` with its entries (names under the archive's folder -> bytes) changed by ``edit``."""
    with zipfile.ZipFile(source) as archive:
        root = archive.namelist()[0].partition("/")[0]
        entries = {i.filename.partition("/")[2]: archive.read(i) for i in archive.infolist()}
    edit(entries)
    with zipfile.ZipFile(target, "w") as archive:
        for name, data in entries.items():
            archive.writestr(f"{root}/{name}", data,
                             zipfile.ZIP_DEFLATED if name in compress else zipfile.ZIP_STORED)
    return target


def config_of(entries: dict[str, bytes], which: str) -> dict:
    """The config entry of an archive's ``which`` folder (weights, constants), parsed."""
    return json.loads(entries[f"data/{which}/model_{which}_config.json"])


def set_config(entries: dict[str, bytes], which: str, config: dict) -> None:
    """Write ``config`` back as the config entry of ``which``."""
    entries[f"data/{which}/model_{which}_config.json"] = json.dumps(config).encode()


def pickled_weight(marker: Path) -> Callable[[dict[str, bytes]], None]:
    """The first weight flagged use_pickle, its file a pickle that writes the marker, then returns the weight."""
    def edit(entries):
        config = config_of(entries, "weights")
        fqn, meta = next(iter(config["config"].items()))
        meta["use_pickle"] = True
        sizes = [s["as_int"] for s in meta["tensor_meta"]["sizes"]]
        dtype = {13: "bfloat16", 7: "float32"}[meta["tensor_meta"]["dtype"]]
        entries[f"data/weights/{meta['path_name']}"] = pickled(Payload(marker, sizes, dtype, parameter=True))
        set_config(entries, "weights", config)
    return edit


# -- the attacks: edits of a saved archive's entries -----------------------------------------------------------
def constant(marker: Path, path_name: str, use_pickle: bool = True) -> Callable[[dict[str, bytes]], None]:
    """An extra constant whose file torch unpickles (tensor_* with use_pickle, custom_obj_*, opaque_obj_*)."""
    import pickle

    def edit(entries):
        config = config_of(entries, "constants")
        config["config"]["evil"] = {"path_name": path_name, "is_param": False, "use_pickle": use_pickle,
                                    "tensor_meta": None}
        payload = Payload(marker, [1], "float32")
        entries[f"data/constants/{path_name}"] = pickled(payload) if path_name.startswith("tensor_") \
            else pickle.dumps(payload)
        set_config(entries, "constants", config)
    return edit


def sample_inputs(marker: Path) -> Callable[[dict[str, bytes]], None]:
    """Sample inputs weights_only=True refuses: torch retries them with weights_only=False."""
    def edit(entries):
        entries["data/sample_inputs/model.pt"] = pickled(((Payload(marker, [2, 8], "float32"),), {}))
    return edit


def legacy_weights(marker: Path) -> Callable[[dict[str, bytes]], None]:
    """The legacy single weights file, which torch prefers to the config and reads as sample inputs are."""
    def edit(entries):
        entries["data/weights/model.pt"] = pickled({"0.weight": Payload(marker, [8, 8], "bfloat16")})
    return edit


def sympy_code(marker: Path) -> Callable[[dict[str, bytes]], None]:
    """A symbolic size whose text is Python: torch hands it to sympy.sympify, which evaluates it."""
    def edit(entries):
        text = entries["models/model.json"].decode()
        symbol = text[text.index('"expr_str": "') + 13:]
        symbol = symbol[:symbol.index('"')]
        entries["models/model.json"] = text.replace(
            f'"{symbol}"', json.dumps(f"open({str(marker)!r}, 'w').write('ran')"), 1).encode()
    return edit


def aoti(marker: Path) -> Callable[[dict[str, bytes]], None]:
    def edit(entries):
        entries["data/aotinductor/model/model.so"] = b"\x7fELF not really"
    return edit


MODEL_JSON = "models/model.json"


def edit_program(change: Callable[[dict], None]) -> Callable[[dict[str, bytes]], None]:
    """An archive edit that rewrites the parsed ``models/model.json`` with ``change``."""
    def edit(entries):
        tree = json.loads(entries[MODEL_JSON])
        change(tree)
        entries[MODEL_JSON] = json.dumps(tree).encode()
    return edit


def guard_with_statements(marker: Path) -> Callable[[dict], None]:
    """The guard closes torch's assert on its second line and runs its own statement on the third; the ``#``
    hides both from the copy torch parses for the message."""
    def change(tree):
        guard = tree["guards_code"][0]
        tree["guards_code"][0] = (f"{guard} #\n, '')\n  __import__('pathlib').Path({str(marker)!r}).write_text('x') "
                                  "or torch._assert(1")
    return change


def empty_weight(entries: dict[str, bytes]) -> None:
    """The first weight's file emptied, its config declaring 2**29 elements."""
    config = json.loads(entries["data/weights/model_weights_config.json"])
    meta = next(iter(config["config"].values()))
    entries[f"data/weights/{meta['path_name']}"] = b""
    meta["tensor_meta"]["sizes"] = [{"as_int": 1 << 29}]
    meta["tensor_meta"]["strides"] = [{"as_int": 1}]
    entries["data/weights/model_weights_config.json"] = json.dumps(config).encode()


def shared_branches(entries: dict[str, bytes]) -> None:
    """A billion laughs as sample inputs: each level a list of 8 references to the level below, 8**7 leaves."""
    level: list = [torch.ones(2)]
    for _ in range(7):
        level = [level] * 8
    entries["data/sample_inputs/model.pt"] = pickled(((level,), {}))


def calling_node(target: str, operator: str, command: str) -> Callable[[dict], None]:
    """A first node ``target`` (a higher-order op) whose first argument names ``operator`` as the callable it
    calls with ``command``: ``wrap(torch.os.system, "touch marker")`` runs the command when the graph runs."""
    def change(tree):
        graph = tree["graph_module"]["graph"]
        graph["tensor_values"]["evil"] = next(iter(graph["tensor_values"].values()))
        graph["nodes"].insert(0, {"target": target, "name": "evil", "metadata": {}, "is_hop_single_tensor_return": True,
                                  "inputs": [{"name": "", "arg": {"as_operator": operator}, "kind": 1},
                                             {"name": "", "arg": {"as_string": command}, "kind": 1}],
                                  "outputs": [{"as_tensor": {"name": "evil"}}]})
    return change


# guard arithmetic: atoms and the ways torch's printer (or an attacker) combines them
GUARD_ATOMS = ["L['input'].size()[0]", "L['input'].size()[1]", "L['input'].numel()", "L['input'].size()", "L['input']",
               "0", "2", "16", "99", "10**9", "9**9**9", "1e-999999999", "'x'", "'1' * 5000", "math.inf"]
GUARD_CALLS = ["math.log", "int", "float", "round", "abs", "math.sqrt", "math.floor", "torch.sym_float"]
GUARD_OPERATORS = [" + ", " - ", " * ", " ** ", " // ", " % ", " << ", " / "]


@st.composite
def guards(draw) -> str:
    """A guard of sizes, constants and text combined by arithmetic and the functions torch's printer writes."""
    def term(depth: int) -> str:
        shape = draw(st.sampled_from(["atom", "call", "binary"] if depth < 3 else ["atom"]))
        if shape == "atom":
            return draw(st.sampled_from(GUARD_ATOMS))
        if shape == "call":
            return f"{draw(st.sampled_from(GUARD_CALLS))}({term(depth + 1)})"
        return f"({term(depth + 1)}{draw(st.sampled_from(GUARD_OPERATORS))}{term(depth + 1)})"

    return f"{term(0)} {draw(st.sampled_from(['!=', '>=', '==']))} {draw(st.sampled_from(GUARD_ATOMS))}"


# -- containers: what torch reads inside the archive, and the file itself ---------------------------------------
SAMPLES = "data/sample_inputs/model.pt"


class Allocation:
    """Pickled as ``bytearray(size)``: torch's weights-only unpickler allows the call."""

    def __init__(self, size: int):
        self.size = size

    def __reduce__(self):
        return bytearray, (self.size,)


def bytearray_samples(size: int) -> Callable[[dict[str, bytes]], None]:
    """Sample inputs whose pickle asks for a ``size``-byte bytearray beside the real input."""
    def edit(entries):
        entries[SAMPLES] = pickled(((X[0],), {"pad": Allocation(size)}))
    return edit


def nested_bomb(inflated: int) -> Callable[[dict[str, bytes]], None]:
    """Sample inputs as two directories: Python's lists the honest records and a small ``extra.bin``; the one torch's
    reader finds says the first tensor's record (``data/0``) is that stream deflated, ``inflated`` bytes of it."""
    from tests.helpers.zipbytes import Entry, deflated, write

    def edit(entries):
        honest = zipfile.ZipFile(io.BytesIO(entries[SAMPLES]))
        ours = [Entry(info.filename, honest.read(info)) for info in honest.infolist()]
        root = ours[0].name.partition("/")[0]
        stream = deflated(bytes(inflated))
        ours.append(Entry(f"{root}/extra.bin", stream))
        theirs = [Entry(e.name, stream, central_sizes=(len(stream), inflated), method=8,
                        points_at=f"{root}/extra.bin") if e.name == f"{root}/data/0" else e for e in ours]
        entries[SAMPLES] = write(ours, theirs)
    return edit


def json_padding(name: str, values: int) -> Callable[[dict[str, bytes]], None]:
    """JSON entry ``name`` (an object) given one more field: a list of ``values`` empty objects (rewrite it with
    ``compress=(name,)`` and it deflates about 200 to 1)."""
    def edit(entries):
        entries[name] = entries[name].rstrip()[:-1] + b', "pad": [' + b"{}," * (values - 1) + b"{}]}"
    return edit


def sparse_copy(source: Path, target: Path, hole: int) -> Path:
    """``source``'s bytes after a hole of ``hole`` bytes that the disk does not hold (Python's zipfile still finds
    the archive, as it reads a zip with bytes in front of it)."""
    with open(target, "wb") as out:
        out.truncate(hole)
        out.seek(hole)
        out.write(source.read_bytes())
    return target


def stored_name(value, node: int = 0) -> Callable[[dict], None]:
    """The ``node``-th named node's stored ``amppass_name`` (the name it had in the converted graph) set to
    ``value``."""
    def change(tree):
        named = [n for n in tree["graph_module"]["graph"]["nodes"]
                 if "amppass_name" in json.loads(n["metadata"].get("custom", "{}"))]
        custom = json.loads(named[node]["metadata"]["custom"])
        custom["amppass_name"] = value
        named[node]["metadata"]["custom"] = json.dumps(custom)
    return change


def stored_names(entries: dict[str, bytes]) -> list[str]:
    """The ``amppass_name`` of every named node of an archive, in graph order."""
    tree = json.loads(entries[MODEL_JSON])
    return [json.loads(n["metadata"]["custom"])["amppass_name"] for n in tree["graph_module"]["graph"]["nodes"]
            if "amppass_name" in json.loads(n["metadata"].get("custom", "{}"))]
