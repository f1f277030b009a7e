"""Saving ONNX models: streamed, atomic, and never leaving a graph that reads another save's data.

A model is written from a skeleton and the :class:`~amppass.onnx.io.weight_store.WeightStore` holding its payloads
(:mod:`amppass.onnx.io.stream_write`), so no second copy of the model is built in memory, inline or not. Models over
protobuf's 2 GB limit (or with ``external_data=True``) keep their tensors in a data file beside the model.

The model and its data switch in one step: the data goes to a fresh file, ``<name>.<random>.data``, that only
the new model names; the model itself replaces the old one by a rename once both are written and fsynced
(:class:`amppass.files.Staged`). A crash at any moment leaves either the old model reading its old data or
the new model reading its new data. Data files the replaced model named (amppass's own, by their names) are
removed after the switch.
"""

from __future__ import annotations

import os
import re
import secrets
import stat

import onnx

from ...files import Staged, check_writable, resolved
from . import stream_write
from .weight_store import WeightStore, tensors

PROTOBUF_LIMIT = 2 * 1024**3
_OLD_MODEL_READ_LIMIT = 256 * 1024**2  # a model file with external data is small; larger ones are inline


def save(model: onnx.ModelProto, path: str | os.PathLike, external_data: bool | None = None) -> None:
    """Write ``model`` to ``path`` atomically; its weights go to a data file beside it when the model is over
    2 GB (protobuf's limit) or ``external_data`` is True. ``model`` is only read."""
    path = check_writable(path)
    store = WeightStore(where=repr(path))
    skeleton = store.skeleton(model)
    with Staged() as staged:
        stage(staged, skeleton, store, path, external_data)


def stage(staged: Staged, skeleton: onnx.ModelProto, store: WeightStore, path: str,
          external_data: bool | None = None) -> None:
    """Add the model ``skeleton`` (payloads in ``store``) to ``staged`` as ``path`` (see :func:`save`); a link at
    ``path`` is followed, and the data file goes beside the file it names (:func:`amppass.files.resolved`)."""
    path = resolved(path)
    parts = stream_write.pieces(skeleton, store) if external_data is not True else []  # read only when inline
    if external_data is None:
        external_data = stream_write.size(parts) >= PROTOBUF_LIMIT
    old = _old_data_files(path)
    if external_data:
        work = onnx.ModelProto()
        work.CopyFrom(skeleton)  # the store's references become references to the data file
        data_name = f"{os.path.basename(path)}.{secrets.token_hex(4)}.data"
        with staged.create(os.path.join(os.path.dirname(os.path.abspath(path)), data_name)) as out:
            store.write(work, out, data_name)
        old.discard(os.path.join(os.path.dirname(os.path.abspath(path)), data_name))
        with staged.open(path) as out:
            out.write(work.SerializeToString())
    else:
        with staged.open(path) as out:
            stream_write.write(parts, store, out)
    staged.after_commit(lambda: _remove(old))


def _old_data_files(path: str) -> set[str]:
    """Data files the model now at ``path`` names that amppass wrote for it (``<name>.data`` or
    ``<name>.<hex>.data``); read from its proto when it is small enough to hold external data."""
    try:  # opened without blocking and read only if a regular file: a FIFO put there never hangs the save
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as handle:
            found = os.fstat(handle.fileno())
            if not stat.S_ISREG(found.st_mode) or found.st_size > _OLD_MODEL_READ_LIMIT:
                return set()
            old = onnx.ModelProto.FromString(handle.read())
        names = {entry.value for t in tensors(old.graph) for entry in t.external_data if entry.key == "location"}
    except Exception:  # noqa: BLE001 - nothing there, or not a model: nothing of ours to clean up
        return set()
    ours = re.compile(re.escape(os.path.basename(path)) + r"(\.[0-9a-f]{8})?\.data")
    folder = os.path.dirname(os.path.abspath(path))
    return {os.path.join(folder, name) for name in names if ours.fullmatch(name)}


def _remove(paths: set[str]) -> None:
    for path in paths:
        try:
            os.remove(path)
        except OSError:
            pass
