"""Reading an .onnx file without its weights: large inline tensors become references into the file itself.

``onnx.load`` reads the whole file into memory and parses it into a second copy: a 1 GiB model costs 2 GiB
before any work starts, and reading a tensor's bytes from the parsed proto copies them once more. Instead
the file is memory-mapped and its protobuf encoding walked field by field. Every message is parsed as
usual, except the large tensors: a TensorProto whose ``raw_data`` is longer than :data:`INLINE_BYTES` is
parsed without it and marked as external data whose ``location`` is the model file itself, at the offset
the bytes sit at. The rest of amppass reads such a tensor like any external-data tensor, through
:class:`~amppass.onnx.io.external_data.ExternalFiles` (memory-mapped, bounds-checked, inside the model's folder).

Only the messages that can hold weights are walked (model, graph, node, attribute, tensor), and only when
they are large enough to; everything else, and every small message, is parsed by protobuf in one call.

A file whose encoding breaks off or contradicts itself (cut short by a copy, damaged on disk) is an
:class:`~amppass.errors.InputError` naming the file, the byte and what is wrong there. The walk's memory
views are released before the mapping closes, whatever stops it, so the error that reaches the user is the
file's (it was a BufferError: "cannot close exported pointers exist").

Nodes and initializers are counted as they are read, and a file holding more than the cap
(:func:`amppass.onnx.io.validate.node_limit`) is refused there, before protobuf builds the rest of it.
"""

from __future__ import annotations

import mmap
import os

import onnx
from onnx import TensorProto

from ...errors import InputError
from . import validate

INLINE_BYTES = 4096  # tensors up to this size stay in the proto (shape inference reads small constants)
_MAX_DEPTH = 100  # protobuf's own parser stops at the same depth

_LENGTH_DELIMITED = 2


class _Broken(ValueError):
    """Where the walk found the encoding wrong (raised inside the walk, reported as an InputError)."""


def load(path: str) -> onnx.ModelProto:
    """The model at ``path`` with its large inline tensors referencing the file itself (module docstring).

    Raises OSError for a file that cannot be read, InputError for one whose encoding breaks off or
    contradicts itself, protobuf's DecodeError for a small message protobuf cannot parse."""
    with open(path, "rb") as handle:
        if not os.fstat(handle.fileno()).st_size:
            handle.read(1)  # a file that reports no size may still refuse reading (/proc): say so
            return onnx.ModelProto()
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            data = memoryview(mapped)
            try:
                model = onnx.ModelProto()
                _message(model, data, 0, len(data), _Walk(os.path.basename(path), _Budget(repr(path))), 0)
                return model
            except _Broken as err:
                broken = str(err)  # the message only: the walk's frames must not outlive this block
            finally:
                data.release()
    raise InputError(f"{path!r} could not be read as an ONNX model ({broken}); the file is cut short or damaged, "
                     "or is not an .onnx file: copy or export it again")


class _Budget:
    """Nodes and initializers read so far, against the cap (:func:`amppass.onnx.io.validate.node_limit`)."""

    def __init__(self, where: str):
        self.where, self.limit = where, validate.node_limit()
        self.held = {"nodes": 0, "initializers": 0}

    def spend(self, nodes: int = 0, initializers: int = 0) -> None:
        for what, more in (("nodes", nodes), ("initializers", initializers)):
            self.held[what] += more
            if self.held[what] > self.limit:
                raise validate.too_large(self.where, what, self.held[what], self.limit, exact=False)


class _Walk:
    """What every level of one file's walk shares: the file's name for external references, and the budget."""

    def __init__(self, location: str, budget: _Budget):
        self.location, self.budget = location, budget


def _message(message, data: memoryview, start: int, end: int, walk_of: _Walk, depth: int) -> None:
    """Fill ``message`` from ``data[start:end]``, walking into the fields that can hold large tensors.

    Each walked sub-message gets its own memory view slices only; nothing is copied but the small fields."""
    if depth > _MAX_DEPTH:
        raise _Broken(f"byte {start}: messages nested more than {_MAX_DEPTH} deep")
    walk = _WALKED.get(type(message))
    if walk is None or end - start <= INLINE_BYTES:
        message.MergeFromString(data[start:end])
        walk_of.budget.spend(*validate.count(message)[:2])  # the bodies a small message holds
        return
    pending: list[memoryview] = []  # fields parsed as they are, merged in one call, in order
    payload: tuple[int, int] | None = None  # a large raw_data: marked external once the tensor is complete
    position = start
    try:
        while position < end:
            field_start = position
            key, position = _varint(data, position, end)
            number, wire = key >> 3, key & 7
            if wire == _LENGTH_DELIMITED:
                length, position = _varint(data, position, end)
                value_start, position = position, position + length
                if position > end:
                    raise _Broken(f"byte {field_start}: a field runs past the end of its message ({length:,} bytes "
                                  f"from byte {value_start:,}, where {end - value_start:,} remain)")
                if number in walk and walk[number] == "raw_data" and length > INLINE_BYTES:
                    payload = (value_start, length)
                    continue
                if number in walk and walk[number] != "raw_data":
                    _flush(message, pending)
                    if isinstance(message, onnx.GraphProto):
                        walk_of.budget.spend(nodes=walk[number] == "node", initializers=walk[number] == "initializer")
                    target = getattr(message, walk[number])
                    child = target.add() if hasattr(target, "add") else target
                    _message(child, data, value_start, position, walk_of, depth + 1)
                    continue
            else:
                position = _skip(data, position, end, wire)
            pending.append(data[field_start:position])
        _flush(message, pending)
    finally:
        pending.clear()  # views into the mapping, released however the walk ends (module docstring)
    if isinstance(message, onnx.ModelProto):
        for function in message.functions:  # parsed with the model's other fields
            walk_of.budget.spend(*validate.count(function)[:2])
    if payload is not None:  # the bytes stay in the file: the tensor points at them
        message.ClearField("raw_data")
        message.data_location = TensorProto.EXTERNAL
        del message.external_data[:]
        for name, value in (("location", walk_of.location), ("offset", str(payload[0])),
                            ("length", str(payload[1]))):
            message.external_data.add(key=name, value=value)


def _flush(message, pending: list[memoryview]) -> None:
    if pending:
        message.MergeFromString(b"".join(pending))
        pending.clear()


def _varint(data: memoryview, position: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if position >= end or shift > 63:
            raise _Broken(f"byte {position}: a number is cut short or longer than 64 bits")
        byte = data[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, position
        shift += 7


def _skip(data: memoryview, position: int, end: int, wire: int) -> int:
    """The position after a field of wire type ``wire`` (not length-delimited) starting at ``position``."""
    if wire == 0:
        return _varint(data, position, end)[1]
    size = {1: 8, 5: 4}.get(wire)
    if size is None:
        raise _Broken(f"byte {position}: wire type {wire} is not used by ONNX")
    if position + size > end:
        raise _Broken(f"byte {position}: a field runs past the end of its message")
    return position + size


def _fields(message_type, *names: str) -> dict[int, str]:
    return {message_type.DESCRIPTOR.fields_by_name[name].number: name for name in names}


# The fields that can lead to a large tensor, by message type: field number -> field name.
_WALKED = {
    onnx.ModelProto: _fields(onnx.ModelProto, "graph"),
    onnx.GraphProto: _fields(onnx.GraphProto, "node", "initializer"),
    onnx.NodeProto: _fields(onnx.NodeProto, "attribute"),
    onnx.AttributeProto: _fields(onnx.AttributeProto, "t", "g", "graphs", "tensors"),
    onnx.TensorProto: _fields(onnx.TensorProto, "raw_data"),
}
