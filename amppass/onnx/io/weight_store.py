"""Weight payloads held outside the ONNX proto while a conversion works on it.

Protobuf copies a tensor's bytes whenever they are copied, assigned or serialised, and shape inference
serialises the whole model. A conversion that carried BERT-base's 440 MB of weights through its copy,
two shape inferences and the rewrite spent most of its time moving bytes. Instead the conversion works on
a *skeleton*: a copy of the model in which every large tensor carries no bytes, only an external-data
reference (location :data:`LOCATION`) to an entry of a :class:`WeightStore`. Shape inference, the view and
the rewrite read and write the skeleton; the store hands out numpy views of the payloads, converts them
(torch does the rounding) and, at the end, :meth:`WeightStore.materialize` writes the bytes of the tensors
that are left into the model, once, or :meth:`WeightStore.write` streams them to an external-data file.

An entry starts as the caller's own tensor, only read, and is read once when its values are first needed;
a weight that is never looked at is copied once, at the end. Tensors that already live in external files
(models over 2 GB) stay references to those files and are read through a memory map, so a conversion holds
the fp32 tensors it reads and the converted result, never a second copy of the model.
"""

from __future__ import annotations

import math
import warnings
from typing import BinaryIO

import numpy as np
import onnx
import torch
from onnx import TensorProto, external_data_helper, numpy_helper

from ...dtypes import LowType
from ...errors import InputError
from ..view import tensors
from . import validate
from .external_data import RESERVED, ExternalFiles, info

LOCATION = RESERVED  # the external-data location that names an in-memory store entry
LIFT_BYTES = 1024  # smaller tensors stay in the proto: shape inference reads shapes and axes from them
_SERIAL_CHUNK = 1 << 15  # torch's parallel grain size (at::internal::GRAIN_SIZE): smaller copies run serially


class WeightStore:
    """Payloads of the large tensors of one conversion, keyed by the index in their external reference.

    ``base_dir`` is the folder the source model's own external-data files are found in (None for a model
    given as a proto with every tensor inline); ``where`` names the model in error messages; with
    ``owns_source`` (a model amppass read from a file itself) a source tensor gives up its bytes once they
    are read, so they are held once, not twice. Every tensor of
    the source is checked as the skeleton is built (:func:`amppass.onnx.io.validate.check_tensor`, raw lengths),
    and external files are read only through :class:`~amppass.onnx.io.external_data.ExternalFiles`.
    """

    def __init__(self, base_dir: str | None = None, where: str = "the model", owns_source: bool = False):
        self.where, self.owns_source = where, owns_source
        self._files = ExternalFiles(base_dir, where) if base_dir is not None else None
        # an entry is the caller's tensor itself until its bytes are first read, then those bytes
        self._payloads: list[bytes | onnx.TensorProto] = []
        self._absmax: dict[int, float] = {}
        self._lowered: dict[tuple[int, int], tuple[int, int]] = {}  # (entry, dtype) -> (entry, clamped)

    # -- building the skeleton ------------------------------------------------------------------------
    def skeleton(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """A copy of ``model`` whose large raw tensors reference this store; ``model`` is only read."""
        work = onnx.ModelProto()
        for field, value in model.ListFields():
            if field.name == "graph":
                self._graph(value, work.graph)
            else:
                copy_field(work, field, value)
        return work

    def _graph(self, source: onnx.GraphProto, target: onnx.GraphProto) -> None:
        for field, value in source.ListFields():
            if field.name == "initializer":
                for tensor in value:
                    self._tensor(tensor, target.initializer.add())
            elif field.name == "node":
                for node in value:
                    self._node(node, target.node.add())
            else:
                copy_field(target, field, value)

    def _node(self, source: onnx.NodeProto, target: onnx.NodeProto) -> None:
        if not any(a.type in NESTED for a in source.attribute):
            target.CopyFrom(source)
            return
        for field, value in source.ListFields():
            if field.name != "attribute":
                copy_field(target, field, value)
                continue
            for attr in value:
                copy = target.attribute.add()
                for afield, avalue in attr.ListFields():
                    if afield.name == "t":
                        self._tensor(avalue, copy.t)
                    elif afield.name == "g":
                        self._graph(avalue, copy.g)
                    elif afield.name == "graphs":
                        for body in avalue:
                            self._graph(body, copy.graphs.add())
                    else:
                        copy_field(copy, afield, avalue)

    def _tensor(self, source: onnx.TensorProto, target: onnx.TensorProto) -> None:
        validate.check_tensor(source, self.where)
        inline = source.HasField("raw_data") and source.data_location != TensorProto.EXTERNAL
        if not inline or _nbytes(source) <= LIFT_BYTES:
            target.CopyFrom(source)
            if inline:
                validate.check_raw_length(source, len(target.raw_data), _itemsize(source), self.where)
            return
        for field in source.DESCRIPTOR.fields:  # every field but the payload, which reading would copy
            value = getattr(source, field.name) if field.name != "raw_data" else None
            if hasattr(value, "extend") or (value is not None and source.HasField(field.name)):
                copy_field(target, field, value)
        held = _raw_held(source, target.ByteSize(), _nbytes(source))
        validate.check_raw_length(source, held, _itemsize(source), self.where)
        _point(target, LOCATION, self._add(source), _nbytes(source))

    # -- reading --------------------------------------------------------------------------------------
    def array(self, tensor: onnx.TensorProto) -> np.ndarray:
        """``tensor``'s values as a read-only numpy array (a view of the payload where one exists)."""
        entry = _entry(tensor)
        if entry is not None:
            return np.frombuffer(self._bytes(entry), _numpy_type(tensor)).reshape(tuple(tensor.dims))
        if external_data_helper.uses_external_data(tensor):
            return self._mapped(tensor)
        if tensor.HasField("raw_data"):
            return np.frombuffer(tensor.raw_data, _numpy_type(tensor)).reshape(tuple(tensor.dims))
        try:
            return numpy_helper.to_array(tensor)
        except (ValueError, TypeError) as err:
            raise InputError(f"{self.where}: tensor {tensor.name!r} cannot be read ({err}); the model file is "
                             "damaged: re-export it") from err

    def absmax(self, tensor: onnx.TensorProto) -> float:
        """Largest finite magnitude in ``tensor`` (0 for an empty one), computed once per entry."""
        entry = _entry(tensor)
        if entry is not None and entry in self._absmax:
            return self._absmax[entry]
        values = self.array(tensor)
        result = 0.0
        if values.size:
            result = max(-float(values.min()), float(values.max()))  # no temporaries; NaN or inf: slow way
            if not math.isfinite(result):
                finite = values[np.isfinite(values)]
                result = float(np.abs(finite).max()) if finite.size else 0.0
        if entry is not None:
            self._absmax[entry] = result
        self.done_with(tensor)
        return result

    # -- writing --------------------------------------------------------------------------------------
    def lower(self, tensor: onnx.TensorProto, low: LowType, target: onnx.TensorProto) -> int:
        """Make ``target`` hold ``tensor``'s float32 values rounded to ``low`` (fp16 or bf16).

        ``target`` may be ``tensor`` itself (conversion in place) or a new tensor; its name is kept.
        fp16 values beyond 65504 are clamped, infinities and NaN kept; returns how many were clamped.
        Converting the same store entry twice reuses the first result.
        """
        entry = _entry(tensor)
        if entry is not None and (entry, low) in self._lowered:
            done, clamped = self._lowered[(entry, low)]
        else:
            values = _torch(self.array(tensor))
            clamped = 0
            if not low.wide_range and self.absmax(tensor) > low.max:
                beyond = torch.isfinite(values) & (values.abs() > low.max)
                clamped = int(beyond.sum())
                values = torch.where(beyond, values.clamp(-low.max, low.max), values)
            done = self._add(_rounded(values, low.torch).view(torch.int16).numpy().tobytes())
            if entry is not None:
                self._lowered[(entry, low)] = (done, clamped)
            del values
            self.done_with(tensor)
        name, dims = target.name or tensor.name, list(tensor.dims)
        target.Clear()
        target.name, target.data_type = name, low.onnx
        target.dims.extend(dims)
        _point(target, LOCATION, done, int(np.prod(dims, dtype=np.int64)) * 2)
        return clamped

    def materialize(self, model: onnx.ModelProto) -> None:
        """Write the payload of every tensor of ``model`` that references a store entry or an external
        file into the tensor itself, so ``model`` is a self-contained proto."""
        for tensor in tensors(model.graph):
            entry = _entry(tensor)
            if entry is not None and isinstance(self._payloads[entry], onnx.TensorProto):
                name = tensor.name
                tensor.CopyFrom(self._payloads[entry])  # never read: one copy, straight from the source
                tensor.name = name
            elif entry is not None or external_data_helper.uses_external_data(tensor):
                payload = self._bytes(entry) if entry is not None else self._mapped(tensor).tobytes()
                del tensor.external_data[:]
                tensor.ClearField("data_location")
                tensor.raw_data = payload

    def write(self, model: onnx.ModelProto, out: BinaryIO, location: str) -> None:
        """Write the payload of every tensor of ``model`` that references this store (or an external file)
        to ``out``, one tensor at a time, and point the tensor at ``location`` (the name ``out`` will have
        beside the saved model). Memory stays at one tensor, however large the model."""
        for tensor in tensors(model.graph):
            if not self.references(tensor):
                continue
            offset = out.tell()
            out.write(self.payload(tensor))
            self.done_with(tensor)
            _point(tensor, location, offset, out.tell() - offset)

    def release(self, model: onnx.ModelProto) -> None:
        """Drop the payloads no tensor of ``model`` references any more (fp32 originals a conversion replaced
        with their low-precision values), so a converted model holds only what it will write."""
        kept = {_entry(t) for t in tensors(model.graph)}
        for entry in range(len(self._payloads)):
            if entry not in kept:
                self._payloads[entry] = b""

    def references(self, tensor: onnx.TensorProto) -> bool:
        """Whether ``tensor``'s bytes are held outside the proto: by this store or in an external file."""
        return tensor.data_location == TensorProto.EXTERNAL

    def payload(self, tensor: onnx.TensorProto) -> bytes | np.ndarray:
        """The bytes of a tensor that :meth:`references` this store or an external file (a caller's tensor
        never read before is read now, without being kept)."""
        entry = _entry(tensor)
        if entry is None:
            return self._mapped(tensor)
        held = self._payloads[entry]
        return held.raw_data if isinstance(held, onnx.TensorProto) else held

    def done_with(self, tensor: onnx.TensorProto) -> None:
        """A tensor read from a memory-mapped file: let its pages go (see :meth:`ExternalFiles.release`)."""
        if self._files is not None and _entry(tensor) is None and tensor.data_location == TensorProto.EXTERNAL:
            self._files.release(tensor)

    def payload_size(self, tensor: onnx.TensorProto) -> int:
        """Bytes :meth:`payload` returns for ``tensor``, known from its shape and type."""
        return _nbytes(tensor)

    # -- internals ------------------------------------------------------------------------------------
    def _add(self, payload: bytes | onnx.TensorProto) -> int:
        self._payloads.append(payload)
        return len(self._payloads) - 1

    def _bytes(self, entry: int) -> bytes:
        """The payload of ``entry``, read from the caller's tensor the first time (protobuf copies it)."""
        payload = self._payloads[entry]
        if isinstance(payload, onnx.TensorProto):
            source = payload
            payload = self._payloads[entry] = source.raw_data
            if self.owns_source:  # a model amppass read itself: its copy of the bytes is not needed twice
                source.ClearField("raw_data")
        return payload

    def _mapped(self, tensor: onnx.TensorProto) -> np.ndarray:
        """A read-only view of a tensor stored in an external file beside the source model (checked and
        opened once by :class:`~amppass.onnx.io.external_data.ExternalFiles`)."""
        if self._files is None:
            raise InputError(f"tensor {tensor.name!r} keeps its data in the external file "
                             f"{info(tensor).get('location')!r}, but the model was passed as a proto; pass the .onnx "
                             "path so its data can be found")
        dtype = np.dtype(_numpy_type(tensor))
        count = math.prod(tensor.dims)
        return self._files.array(tensor, dtype, count).reshape(tuple(tensor.dims))


# attribute types that hold a tensor or a graph: a node with one is copied field by field
NESTED = frozenset({onnx.AttributeProto.TENSOR, onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS})


def copy_field(target: object, field: object, value: object) -> None:
    """Copy one set field of a protobuf message onto ``target`` (repeated, message or scalar)."""
    if hasattr(value, "extend"):  # repeated field: protobuf's own container types
        getattr(target, field.name).extend(value)
    elif field.type == field.TYPE_MESSAGE:
        getattr(target, field.name).CopyFrom(value)
    else:
        setattr(target, field.name, value)


def _nbytes(tensor: onnx.TensorProto) -> int:
    """Size of ``tensor``'s raw payload from its shape and type (reading ``raw_data`` would copy it)."""
    return math.prod(tensor.dims) * _itemsize(tensor)


def _itemsize(tensor: onnx.TensorProto) -> int:
    try:
        return np.dtype(_numpy_type(tensor)).itemsize
    except InputError:
        return 1


def _raw_held(tensor: onnx.TensorProto, header: int, expected: int) -> int:
    """Bytes in ``tensor.raw_data``, from serialised sizes (reading the field would copy it): ``header`` is the
    size of ``tensor`` without its payload, and the payload field adds one tag byte, its length as a varint
    and the bytes themselves. Where that does not give ``expected`` (unknown fields also count in the size),
    the field itself is measured."""
    rest = tensor.ByteSize() - header - 1
    if rest - _varint_width(expected) == expected:
        return expected
    return len(tensor.raw_data)


def _varint_width(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def _point(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """Make ``tensor`` an external-data reference: ``offset`` is a store entry for :data:`LOCATION`."""
    del tensor.external_data[:]
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        tensor.external_data.add(key=key, value=value)


def _rounded(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` rounded to ``dtype`` (nearest, ties to even), flattened, on the calling thread only.

    The conversion is memory-bound, so one thread is as fast as several; and on a busy machine a parallel
    copy waits for descheduled workers at every call (a BERT-base conversion went from 0.1 s to 0.5 s).
    Chunks below torch's grain size run serially.
    """
    flat = values.reshape(-1)
    out = torch.empty(flat.numel(), dtype=dtype)
    for start in range(0, flat.numel(), _SERIAL_CHUNK):
        out[start:start + _SERIAL_CHUNK].copy_(flat[start:start + _SERIAL_CHUNK])
    return out


def _torch(array: np.ndarray) -> torch.Tensor:
    """A float32 torch view of a read-only numpy array; amppass never writes through it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.asarray(array, np.float32))


def _entry(tensor: onnx.TensorProto) -> int | None:
    """The store entry ``tensor`` references, or None (a source tensor naming the reserved location is refused
    when the skeleton is built, so only the store's own references get here)."""
    if tensor.data_location != TensorProto.EXTERNAL:
        return None
    fields = info(tensor)
    return int(fields["offset"]) if fields.get("location") == LOCATION else None


def _numpy_type(tensor: onnx.TensorProto) -> type:
    if tensor.data_type == TensorProto.BFLOAT16:
        return np.uint16
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    except KeyError as err:
        raise InputError(f"tensor {tensor.name!r} has ONNX element type {tensor.data_type}, which amppass cannot "
                         "read; re-export the model with standard tensor types") from err
