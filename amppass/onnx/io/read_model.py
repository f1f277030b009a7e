"""An ONNX model read for conversion: from a path (:mod:`.lazy_read`: large tensors stay in the file), or an
``onnx.ModelProto`` given in memory, which is only read; refused where it is not an ONNX model, where its size or
nesting exceed what amppass reads (:mod:`.validate`), and, on request, where ``onnx.checker`` rejects it. The
folder its external data is read from (:mod:`.external_data`) comes with it.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass

import onnx

from ...errors import InputError
from . import lazy_read, validate
from .weight_store import WeightStore


@dataclass(frozen=True)
class Loaded:
    """A model read for conversion: the proto (large payloads not copied), the folder its external data lives
    in (None for a proto given in memory), and how messages name it."""

    model: onnx.ModelProto
    base_dir: str | None
    where: str
    owned: bool = False  # read from a file by amppass: a conversion may take its tensors' bytes


def load(model: str | os.PathLike | onnx.ModelProto, check: bool = False) -> Loaded:
    """Read ``model`` (a path or a proto, which is only read) for
    :func:`amppass.pipelines.convert_onnx.convert_onnx_streamed`, refusing what is not an ONNX model. ``check`` also
    runs
    ``onnx.checker`` on a stand-in of it that holds no weights (:func:`.validate.check_with_onnx`): the command
    line's promise that a file is a valid model, without loading or copying the model a second time."""
    source, base_dir, where = _load(model)
    owned = source is not model
    if check:
        skeleton = WeightStore(base_dir, where).skeleton(source)
        validate.check_order(skeleton, where)
        validate.check_with_onnx(skeleton, where)
    return Loaded(source, base_dir, where, owned)


def _load(model: str | os.PathLike | onnx.ModelProto) -> tuple[onnx.ModelProto, str | None, str]:
    """``model`` as a proto (the caller's own, to be read only, or the one read from the path without its
    weights: :mod:`amppass.onnx.io.lazy_read`), the folder its external data lives in, and how messages name it.
    Nesting and size are checked here, before anything walks the model recursively."""
    if isinstance(model, onnx.ModelProto):
        where = "the onnx.ModelProto passed to convert_onnx"
        _check_has_graph(model, where)
        validate.check_size(model, where)
        validate.check_nesting(model, where)
        return model, None, where
    if not isinstance(model, (str, os.PathLike)):
        raise InputError(f"convert_onnx takes a path to a .onnx file or an onnx.ModelProto, not {type(model).__name__}")
    path = os.fspath(model)
    if os.path.isdir(path):
        raise InputError(f"{path!r} is a folder, not a file; pass the path of the .onnx model inside it")
    if not os.path.isfile(path):
        raise InputError(f"{path!r} is not a file (no such path); pass the path of an .onnx model")
    hint = " (it is a zip archive: a PyTorch checkpoint? use amppass.convert or amppass.export_onnx for torch models)"
    try:
        loaded = lazy_read.load(path)
    except InputError as err:  # the file is damaged: the message names it, the byte and the fix
        if zipfile.is_zipfile(path):
            raise InputError(f"{err}{hint}") from None
        raise
    except OSError as err:
        raise InputError(f"{path!r} cannot be read ({err.strerror or err}); check the file's permissions") from err
    except Exception as err:  # protobuf's DecodeError and friends
        raise InputError(f"{path!r} could not be read as an ONNX model ({err}); is it an .onnx file?"
                         f"{hint if zipfile.is_zipfile(path) else ''}") from err
    _check_has_graph(loaded, repr(path))
    validate.check_size(loaded, repr(path))  # the count lazy_read.load made, exact: what it parsed whole included
    validate.check_nesting(loaded, repr(path))
    return loaded, os.path.dirname(os.path.abspath(path)), repr(path)  # large tensors: references into the file


def _check_has_graph(model: onnx.ModelProto, where: str) -> None:
    """Refuse an empty message: protobuf parses an empty or foreign file as a ModelProto with no graph."""
    if model.ir_version == 0 or not model.HasField("graph"):
        raise InputError(f"{where} is not an ONNX model (it holds no IR version or graph); pass a model written "
                         "by torch.onnx.export or another ONNX exporter")
