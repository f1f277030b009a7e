"""The payloads of a .pt2 archive: tensors only, each as large as its bytes, and sample inputs that are small.

torch reads a weight or constant file flagged ``use_pickle`` with ``torch.load(weights_only=False)``; it builds
a tensor of a file with no bytes as ``torch.zeros`` of the size the config declares (a 20 KB file asking for
16 GiB); and it walks the sample inputs as a tree, where a pickle's memo lets a 1.4 KB file describe 8**10
leaves. So:

1. Every config entry is a tensor (``use_pickle`` false, a tensor description, a tensor file of the archive).
2. Every tensor's declared extent (sizes, strides, storage offset, element size) fits in its file's bytes, and
   a file with no bytes holds only empty tensors.
3. The sample inputs load with ``weights_only=True``; their tree has at most :data:`MAX_VALUES` values and
   :data:`MAX_DEPTH` levels, counted with every shared branch counted again (as torch walks it), and their
   keys and strings are plain text (torch pastes them into the guards' source).
"""

from __future__ import annotations

import io
import re
import zipfile
from typing import Any, Callable

from ..errors import InputError
from .layout import check_sizes
from .program import TRUST_HINT, check_text

MAX_DIMS = 64  # dimensions of one tensor description
MAX_VALUES = 100_000  # values (containers and leaves) of the sample inputs' tree, shared branches counted each time
MAX_DEPTH = 64  # nesting of the sample inputs' tree, and of JSON amppass reads itself


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
    dtype = dtypes.get(tensor.get("dtype")) if type(tensor.get("dtype")) is int else None
    sizes, strides = _ints(tensor.get("sizes")), _ints(tensor.get("strides"))
    offset = _ints([tensor.get("storage_offset")])
    if dtype is None or sizes is None or strides is None or offset is None or len(sizes) != len(strides) \
            or len(sizes) > MAX_DIMS or any(v < 0 for v in sizes + strides + offset):
        return "has a tensor description amppass cannot read (a dtype, and non-negative integer sizes, strides and offset)"
    item = torch.empty((), dtype=dtype).element_size()
    if size % item:
        return f"is {str(dtype).replace('torch.', '')}, whose {item}-byte elements do not divide its file"
    extent = 0 if 0 in sizes else offset[0] + 1 + sum((n - 1) * s for n, s in zip(sizes, strides))
    if extent * item > size:
        return f"declares {extent:,} elements of {item} bytes, more than its file holds"
    return None


def _ints(values: Any) -> list[int] | None:
    """The integers of a serialised size list (``[{"as_int": 8}]``), or None where one is not an integer."""
    if not isinstance(values, list):
        return None
    found = [v.get("as_int") if isinstance(v, dict) else None for v in values]
    return found if all(type(v) is int for v in found) else None


def check_sample_inputs(data: bytes, where: str) -> None:
    """Rule 3: the sample inputs' bytes load as tensors with ``weights_only=True`` into a small plain tree."""
    import torch

    try:
        nested = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, ValueError, EOFError) as err:
        raise InputError(f"{where} is not a torch.save archive ({str(err)[:300]}); the file is damaged") from None
    check_sizes(nested, where)
    try:
        value = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch would retry this with weights_only=False
        named = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
        what = f"it names {named.group(1)}" if named else f"{type(err).__name__}"
        raise InputError(f"{where} holds objects other than tensors ({what}), which torch would unpickle with "
                         f"weights_only=False. {TRUST_HINT}") from None
    _check_tree(value, where)


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
