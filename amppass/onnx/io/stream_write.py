"""Streaming a model's protobuf encoding to a file, one tensor payload at a time.

``ModelProto.SerializeToString()`` builds the whole encoding in memory: for a 1 GiB model that is a second
gigabyte on top of the model. The encoding of a message is the concatenation of its fields' encodings, in
any order, and a nested message is written as its field key, its length and its own encoding. So a model
whose tensors reference a :class:`~amppass.onnx.io.weight_store.WeightStore` can be written as a sequence of small
serialised pieces (everything but the payloads) and the payloads themselves, each written straight from the
store; only the lengths must be known in advance, and the store knows every payload's size from its
tensor's shape. The file read back is the model ``store.materialize`` would have made.
"""

from __future__ import annotations

from typing import BinaryIO, Union

import onnx
from onnx import TensorProto

from .weight_store import NESTED, WeightStore, copy_field

_RAW_DATA = TensorProto.DESCRIPTOR.fields_by_name["raw_data"].number
_PAYLOAD_FIELDS = frozenset({"raw_data", "external_data", "data_location"})


class _Payload:
    """A tensor's bytes, still in the store: written when the piece is reached."""

    __slots__ = ("tensor", "nbytes")

    def __init__(self, tensor: onnx.TensorProto, nbytes: int):
        self.tensor, self.nbytes = tensor, nbytes


Piece = Union[bytes, _Payload]


def pieces(model: onnx.ModelProto, store: WeightStore) -> list[Piece]:
    """The encoding of ``model`` with every store-referencing tensor's payload inline, as pieces."""
    return _message(model, store)


def size(parts: list[Piece]) -> int:
    """Bytes the pieces encode to."""
    return sum(p.nbytes if isinstance(p, _Payload) else len(p) for p in parts)


def write(parts: list[Piece], store: WeightStore, out: BinaryIO) -> None:
    """Write the pieces to ``out``, payloads one at a time straight from ``store``."""
    for part in parts:
        if isinstance(part, _Payload):
            out.write(store.payload(part.tensor))
            store.done_with(part.tensor)
        else:
            out.write(part)


def _message(message, store: WeightStore) -> list[Piece]:
    if isinstance(message, TensorProto):
        return _tensor(message, store)
    if not _may_hold_payload(message):
        return [message.SerializeToString()]
    rest = type(message)()
    nested: list[Piece] = []
    for field, value in message.ListFields():
        if field.type != field.TYPE_MESSAGE:
            copy_field(rest, field, value)
            continue
        for item in value if field.is_repeated else [value]:
            inner = _message(item, store)
            nested.append(_key(field.number) + _varint(size(inner)))
            nested.extend(inner)
    return [rest.SerializeToString(), *nested]


def _tensor(tensor: onnx.TensorProto, store: WeightStore) -> list[Piece]:
    if not store.references(tensor):
        return [tensor.SerializeToString()]
    header = TensorProto()
    for field, value in tensor.ListFields():
        if field.name not in _PAYLOAD_FIELDS:
            copy_field(header, field, value)
    nbytes = store.payload_size(tensor)
    return [header.SerializeToString(), _key(_RAW_DATA) + _varint(nbytes), _Payload(tensor, nbytes)]


def _may_hold_payload(message) -> bool:
    """Messages that can contain store-referencing tensors: models, graphs, and nodes and attributes with
    tensors or bodies. Everything else is serialised whole."""
    if isinstance(message, (onnx.ModelProto, onnx.GraphProto)):
        return True
    if isinstance(message, onnx.NodeProto):
        return any(a.type in NESTED for a in message.attribute)
    if isinstance(message, onnx.AttributeProto):
        return message.type in NESTED
    return False


def _key(number: int) -> bytes:
    return _varint(number << 3 | 2)  # wire type 2: length-delimited


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)

