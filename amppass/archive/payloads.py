"""The payloads of a .pt2 archive: tensors only, each as large as its bytes, and sample inputs that are small.

torch reads a weight or constant file flagged ``use_pickle`` with ``torch.load(weights_only=False)``; it builds
a tensor of a file with no bytes as ``torch.zeros`` of the size the config declares (a 20 KB file asking for
16 GiB); and it walks the sample inputs as a tree, where a pickle's memo lets a 1.4 KB file describe 8**10
leaves. So:

1. Every config entry is a tensor (``use_pickle`` false, a tensor description, a tensor file of the archive).
2. Every tensor's declared extent (sizes, strides, storage offset, element size) fits in its file's bytes, and
   a file with no bytes holds only empty tensors.
3. The sample inputs are a ``torch.save`` zip read once by both zip readers (the archive's own layout rules,
   :func:`amppass.archive.layout.read_zip`), whose pickle ``data.pkl`` is at most :data:`MAX_PICKLE` bytes and,
   read opcode by opcode (``pickletools.genops``) before any unpickler runs, uses only the opcodes
   ``torch.save`` writes for tensors, numbers, strings, tuples, lists and dicts, and names only the globals
   those need (:func:`pickle_globals`). torch's weights-only unpickler allows more, some of which allocate what
   their argument says (``bytearray(N)``, ``torch.Tensor(N)``, quantized tensors of any size); the ones left
   either allocate nothing or check their size against the bytes of a record of the zip.
4. They then load with ``weights_only=True``; their tree has at most :data:`MAX_VALUES` values and
   :data:`MAX_DEPTH` levels, counted with every shared branch counted again (as torch walks it), and their
   keys and strings are plain text (torch pastes them into the guards' source).
"""

from __future__ import annotations

import functools
import io
import pickletools
import re
from typing import Any, Callable

from ..errors import InputError, first_line
from .layout import read_zip
from .program import TRUST_HINT, check_text

MAX_DIMS = 64  # dimensions of one tensor description
MAX_VALUES = 100_000  # values (containers and leaves) of the sample inputs' tree, shared branches counted each time
MAX_DEPTH = 64  # nesting of the sample inputs' tree, and of JSON amppass reads itself
MAX_PICKLE = 4 << 20  # bytes of the sample inputs' pickle (the tensors' bytes are records of their own)
# rule 3: the opcodes torch.save (pickle protocol 2) writes for tensors, numbers, strings and containers
_PICKLE_OPCODES = frozenset({
    "PROTO", "STOP", "MARK", "GLOBAL", "REDUCE", "BINPERSID", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET",
    "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_LIST", "APPEND", "APPENDS", "EMPTY_DICT",
    "SETITEM", "SETITEMS", "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT",
    "BINUNICODE"})


def check_config(payloads: Any, where: str, prefix: str, folder: str, size_of: Callable[[str], int | None]) -> None:
    """Rules 1 and 2 for a parsed payload config; ``size_of(entry)`` is an archive entry's size, None if absent."""
    table = payloads.get("config") if isinstance(payloads, dict) else None
    if not isinstance(table, dict):
        raise InputError(f"{where} is not a payload config (an object with a 'config' object); the file is "
                         "damaged: save the model again")
    for fqn, meta in table.items():
        name = repr(str(fqn)[:80])
        path = meta.get("path_name") if isinstance(meta, dict) else None
        if not isinstance(path, str):
            raise InputError(f"{where}: {name} names no payload file; the file is damaged")
        if meta.get("use_pickle") is not False or not path.startswith(prefix):
            raise InputError(f"{where}: {name} is stored as a pickle ({folder}{path[:80]}), which torch would "
                             "unpickle with weights_only=False and so run code the file holds; amppass loads "
                             f"tensors only. {TRUST_HINT}")
        size = size_of(folder + path)
        if not isinstance(meta.get("tensor_meta"), dict) or size is None:
            raise InputError(f"{where}: {name} has no tensor description or no file {folder}{path[:80]!r} in the "
                             "archive; the file is damaged: save the model again")
        problem = _extent_problem(meta["tensor_meta"], size)
        if problem:
            raise InputError(f"{where}: {name} {problem} ({folder}{path[:80]} holds {size:,} bytes); the file is "
                             "damaged or crafted: save the model again")


def _extent_problem(tensor: dict, size: int) -> str | None:
    """Why a tensor description does not fit in a file of ``size`` bytes, or None (rule 2)."""
    import torch
    from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE

    dtypes = {int(code): dtype for code, dtype in _SERIALIZE_TO_TORCH_DTYPE.items()}
    code = tensor.get("dtype")
    dtype = dtypes.get(code) if type(code) is int else None
    sizes, strides = _ints(tensor.get("sizes")), _ints(tensor.get("strides"))
    offset = _ints([tensor.get("storage_offset")])
    if dtype is None or sizes is None or strides is None or offset is None or len(sizes) != len(strides) \
            or len(sizes) > MAX_DIMS or any(v < 0 for v in sizes + strides + offset):
        return (
            "has a tensor description amppass cannot read (a dtype, and non-negative integer sizes, strides and offset)"
        )
    item = torch.empty((), dtype=dtype).element_size()
    if size % item:
        return f"is {str(dtype).replace('torch.', '')}, whose {item}-byte elements do not divide its file"
    extent = 0 if 0 in sizes else offset[0] + 1 + sum((n - 1) * s for n, s in zip(sizes, strides, strict=False))
    if extent * item > size:
        return f"declares {extent:,} elements of {item} bytes, more than its file holds"
    return None


def _ints(values: Any) -> list[int] | None:
    """The integers of a serialised size list (``[{"as_int": 8}]``), or None where one is not an integer."""
    if not isinstance(values, list):
        return None
    found = [v.get("as_int") if isinstance(v, dict) else None for v in values]
    ints = [v for v in found if type(v) is int]
    return ints if len(ints) == len(found) else None


def check_sample_inputs(data: bytes, where: str) -> None:
    """Rules 3 and 4: the sample inputs' bytes are a zip read once, whose pickle names only tensors, and which
    loads with ``weights_only=True`` into a small plain tree."""
    import torch

    if not data.startswith(b"PK\x03\x04"):  # torch.load reads anything else as a legacy pickle
        raise InputError(f"{where} is not a torch.save archive (it does not start as a zip); the file is damaged")
    nested = read_zip(io.BytesIO(data), where)
    pickle = nested.entries.get("data.pkl")
    if pickle is None or pickle.file_size > MAX_PICKLE:
        raise InputError(f"{where}: its pickle 'data.pkl' is missing or over {MAX_PICKLE:,} bytes; the file is damaged "
                         "or crafted: save the model again")
    check_pickle(nested.reader.get_record("data.pkl"), f"{where}: pickle 'data.pkl'")
    try:
        value = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch would retry this with weights_only=False
        named = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
        what = f"it names {named.group(1)}" if named else f"{type(err).__name__}"
        raise InputError(f"{where} holds objects other than tensors ({what}), which torch would unpickle with "
                         f"weights_only=False. {TRUST_HINT}") from None
    _check_tree(value, where)


def check_pickle(data: bytes, where: str) -> None:
    """Rule 3 on a pickle's bytes, read opcode by opcode without building anything; InputError naming ``where``."""
    try:
        for opcode, arg, position in pickletools.genops(data):
            if opcode.name not in _PICKLE_OPCODES:
                problem = f"uses opcode {opcode.name} at byte {position:,}"
            elif opcode.name == "GLOBAL" and arg not in pickle_globals():
                problem = f"names {str(arg).replace(' ', '.')[:100]!r} at byte {position:,}"
            else:
                continue
            raise InputError(f"{where} {problem}, which torch.save does not write for tensors and numbers and which "
                             f"could build other objects than sample inputs. {TRUST_HINT}")
    except ValueError as err:  # a cut or malformed opcode argument
        raise InputError(f"{where} is not a pickle amppass can read ({first_line(err, 200)}); the file is damaged or "
                         "crafted: save the model again") from None


@functools.lru_cache(maxsize=1)
def pickle_globals() -> frozenset[str]:
    """The globals ``torch.save`` names for sample inputs (as ``pickletools`` gives them, "module name"): the
    tensor rebuild function, the storage classes, dtypes, devices, sizes and OrderedDict (a tensor's hooks)."""
    import torch

    dtypes = {str(value).replace(".", " ", 1) for value in vars(torch).values() if isinstance(value, torch.dtype)}
    storages = {f"{cls.__module__} {cls.__name__}" for cls in torch._storage_classes}
    return frozenset({"torch._utils _rebuild_tensor_v2", "collections OrderedDict", "torch device", "torch Size",
                      *dtypes, *storages})


def _check_tree(value: Any, where: str) -> None:
    """At most :data:`MAX_VALUES` values and :data:`MAX_DEPTH` levels, shared branches counted each time;
    dict keys and strings plain text."""
    import torch

    count, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        count += 1
        if count > MAX_VALUES:
            raise InputError(f"{where}: the sample inputs hold more than {MAX_VALUES:,} values once their shared "
                             "parts are counted each time, as torch walks them; the file is crafted")
        if depth > MAX_DEPTH:
            raise InputError(f"{where}: the sample inputs nest deeper than {MAX_DEPTH} levels; the file is crafted")
        if isinstance(item, dict):
            for key in item:
                if not isinstance(key, int):
                    check_text(key, f"{where}: a sample input's key")
            pending.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend((child, depth + 1) for child in item)
        elif isinstance(item, str):
            check_text(item, f"{where}: a sample input")
        elif not isinstance(item, (torch.Tensor, int, float, bool, type(None), torch.dtype, torch.device)):
            raise InputError(f"{where}: a sample input is a {type(item).__name__}, not a tensor or number")
