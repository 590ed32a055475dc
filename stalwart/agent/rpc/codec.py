"""Frames and payloads: JSON for structure, raw bytes for tensors and ``bytes`` values; never pickle.

A frame is ``u32 header length (big-endian) | Envelope JSON | blob 0 | blob 1 | ...``. A payload is any tree
of ``None``, ``bool``, ``int``, ``float``, ``str``, ``list``, ``tuple``, ``dict``, ``bytes``, CPU
``torch.Tensor`` and RRef; a value of any other type is refused with :class:`PayloadError` naming its path
(``args[1]['w']``). In the JSON tree, blobs, tuples, RRefs and dicts that JSON cannot hold directly (a key
that is not a string, or starts with ``$``) become one-key objects tagged ``$t`` (tensor), ``$b`` (bytes),
``$u`` (tuple), ``$r`` (RRef) and ``$d`` (a list of key/value pairs), so the decoding is unambiguous.
A received frame is checked before anything is built from it: the header is validated by
:class:`~stalwart.api.rpc.Envelope`, blob sizes must add up to the frame, a tensor's size must match its
dtype and shape, and only plain numeric dtypes are accepted.
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
import sys
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from stalwart.agent.rpc.errors import PayloadError
from stalwart.api.rpc import MAX_HEADER_BYTES, BlobMeta, Envelope, RRefWire

_LEN = struct.Struct(">I")

#: Tensor dtypes a frame may carry (plain numeric data; no quantized or opaque types).
TENSOR_DTYPES = frozenset({
    "float64", "float32", "float16", "bfloat16", "complex64", "complex128",
    "int64", "int32", "int16", "int8", "uint8", "bool",
})

#: Encodes an RRef found in a payload as a new fork for the destination (supplied by the RRef layer).
RRefEncoder = Callable[[Any], RRefWire]
#: Builds the receiver's RRef handle from a fork (supplied by the RRef layer).
RRefDecoder = Callable[[RRefWire], Any]


class Blobs:
    """The raw parts of a payload being encoded: metadata for the header and buffers for the frame."""

    __slots__ = ("buffers", "keep", "meta")

    def __init__(self) -> None:
        self.meta: list[BlobMeta] = []
        self.buffers: list[Any] = []
        self.keep: list[Any] = []  # tensors whose memory the buffers point into

    def add_bytes(self, data: bytes | bytearray | memoryview) -> int:
        self.meta.append(BlobMeta(nbytes=len(data) if not isinstance(data, memoryview) else data.nbytes))
        self.buffers.append(data)
        return len(self.meta) - 1

    def add_tensor(self, tensor: Any, path: str) -> int:
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        name = str(tensor.dtype).removeprefix("torch.")
        if name not in TENSOR_DTYPES or str(tensor.layout) != "torch.strided" or tensor.is_quantized:
            raise PayloadError(f"{path}: tensors of dtype {name} / layout {tensor.layout} cannot be sent")
        tensor = tensor.detach().contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        self.meta.append(BlobMeta(nbytes=nbytes, dtype=name, shape=list(tensor.shape)))
        if nbytes:
            self.buffers.append(memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())))
            self.keep.append(tensor)
        else:
            self.buffers.append(b"")
        return len(self.meta) - 1


def encode_payload(value: Any, blobs: Blobs, rref_encoder: RRefEncoder | None, path: str = "payload") -> Any:
    """The JSON tree for ``value``; blobs go to ``blobs``. Raises :class:`PayloadError` naming the path."""
    t = type(value)
    if value is None or t is bool or t is int or t is str:
        return value
    if t is float:
        if not math.isfinite(value):
            raise PayloadError(f"{path}: NaN and infinite floats are not JSON; send them in a tensor")
        return value
    if t is list:
        return [encode_payload(v, blobs, rref_encoder, f"{path}[{i}]") for i, v in enumerate(value)]
    if t is tuple:
        return {"$u": [encode_payload(v, blobs, rref_encoder, f"{path}[{i}]") for i, v in enumerate(value)]}
    if t is dict:
        if all(type(k) is str and not k.startswith("$") for k in value):
            return {k: encode_payload(v, blobs, rref_encoder, f"{path}[{k!r}]") for k, v in value.items()}
        return {"$d": [[encode_payload(k, blobs, rref_encoder, f"{path}.key({k!r})"),
                        encode_payload(v, blobs, rref_encoder, f"{path}[{k!r}]")] for k, v in value.items()]}
    if t is bytes or t is bytearray or t is memoryview:
        return {"$b": blobs.add_bytes(value)}
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return {"$t": blobs.add_tensor(value, path)}
    if rref_encoder is not None and getattr(value, "_is_stalwart_rref", False):
        return {"$r": rref_encoder(value).model_dump(mode="json")}
    raise PayloadError(
        f"{path}: cannot send a value of type {t.__module__}.{t.__qualname__}; payloads hold JSON values, "
        "tuples, bytes, CPU tensors and RRefs (register a function and send its arguments instead of objects)")


def header_json(**fields: Any) -> bytes:
    """The JSON of an :class:`Envelope` with these fields, built without a model instance.

    Outgoing headers are made from values the agent itself produced, so they skip pydantic (a measurable
    share of a small call's latency); ``None`` fields are left out. Incoming headers are always validated.
    """
    blobs = fields.pop("blobs", None)
    if blobs:
        fields["blobs"] = [b.model_dump(exclude_none=True) for b in blobs]
    err = fields.get("err")
    if err is not None:
        fields["err"] = err.model_dump()
    return json.dumps({k: v for k, v in fields.items() if v is not None},
                      separators=(",", ":"), allow_nan=False).encode()


def encode_frame(header: Envelope | bytes, blobs: Blobs | None = None) -> bytes:
    """One frame: the header (with the blobs' metadata already in it) then the blobs' bytes."""
    head = header if isinstance(header, bytes) else header.model_dump_json(exclude_defaults=True).encode()
    if len(head) > MAX_HEADER_BYTES:
        raise PayloadError(f"message header is {len(head)} bytes of JSON; the limit is {MAX_HEADER_BYTES} "
                           "(send bulk data as tensors or bytes)")
    if blobs is None or not blobs.buffers:
        return _LEN.pack(len(head)) + head
    return b"".join([_LEN.pack(len(head)), head, *blobs.buffers])


class Frame:
    """A received frame: the validated header and the blob bytes it describes."""

    __slots__ = ("blobs", "header")

    def __init__(self, header: Envelope, blobs: list[memoryview]) -> None:
        self.header = header
        self.blobs = blobs


def decode_frame(data: bytes) -> Frame:
    """Parse and check a frame. Raises :class:`PayloadError` for anything malformed."""
    if len(data) < _LEN.size:
        raise PayloadError("frame shorter than its length prefix")
    (hlen,) = _LEN.unpack_from(data, 0)
    if hlen > MAX_HEADER_BYTES or _LEN.size + hlen > len(data):
        raise PayloadError(f"frame header length {hlen} is out of bounds (frame is {len(data)} bytes)")
    view = memoryview(data)
    try:
        header = Envelope.model_validate_json(bytes(view[_LEN.size:_LEN.size + hlen]))
    except ValidationError as e:
        raise PayloadError(f"invalid message header: {e}") from None
    offset = _LEN.size + hlen
    blobs: list[memoryview] = []
    for i, meta in enumerate(header.blobs):
        end = offset + meta.nbytes
        if end > len(data):
            raise PayloadError(f"blob {i} ({meta.nbytes} bytes) runs past the end of the frame")
        blobs.append(view[offset:end])
        offset = end
    if offset != len(data):
        raise PayloadError(f"frame has {len(data) - offset} bytes after its last blob")
    return Frame(header, blobs)


def _tensor(meta: BlobMeta, raw: memoryview, path: str) -> Any:
    import torch

    if meta.dtype not in TENSOR_DTYPES or meta.shape is None:
        raise PayloadError(f"{path}: blob is not a tensor of an accepted dtype ({meta.dtype!r})")
    dtype = getattr(torch, meta.dtype)
    numel = 1
    for d in meta.shape:
        if d < 0:
            raise PayloadError(f"{path}: negative tensor dimension in shape {meta.shape}")
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    if numel * itemsize != meta.nbytes:
        raise PayloadError(f"{path}: shape {meta.shape} of {meta.dtype} needs {numel * itemsize} bytes, "
                           f"blob has {meta.nbytes}")
    if numel == 0:
        return torch.empty(meta.shape, dtype=dtype)
    # One copy into memory the tensor owns (writable, independent of the frame's lifetime).
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(meta.shape)


def decode_payload(tree: Any, frame: Frame, rref_decoder: RRefDecoder | None, path: str = "payload") -> Any:
    """The value of a JSON tree from ``frame``; the inverse of :func:`encode_payload`."""
    t = type(tree)
    if t is list:
        return [decode_payload(v, frame, rref_decoder, f"{path}[{i}]") for i, v in enumerate(tree)]
    if t is not dict:
        return tree
    if len(tree) == 1:
        ((tag, inner),) = tree.items()
        if tag == "$u":
            if type(inner) is not list:
                raise PayloadError(f"{path}: '$u' must hold a list")
            return tuple(decode_payload(v, frame, rref_decoder, f"{path}[{i}]") for i, v in enumerate(inner))
        if tag == "$d":
            if type(inner) is not list or not all(type(p) is list and len(p) == 2 for p in inner):
                raise PayloadError(f"{path}: '$d' must hold a list of [key, value] pairs")
            out: dict[Any, Any] = {}
            for k, v in inner:
                key = decode_payload(k, frame, rref_decoder, f"{path}.key")
                try:
                    out[key] = decode_payload(v, frame, rref_decoder, f"{path}[{key!r}]")
                except TypeError:
                    raise PayloadError(f"{path}: unhashable dict key {key!r}") from None
            return out
        if tag in ("$b", "$t"):
            if type(inner) is not int or not 0 <= inner < len(frame.blobs):
                raise PayloadError(f"{path}: blob index {inner!r} out of range")
            meta = frame.header.blobs[inner]
            if tag == "$b":
                if meta.dtype is not None:
                    raise PayloadError(f"{path}: blob {inner} is a tensor, not bytes")
                return bytes(frame.blobs[inner])
            return _tensor(meta, frame.blobs[inner], path)
        if tag == "$r":
            if rref_decoder is None:
                raise PayloadError(f"{path}: an RRef cannot appear here")
            try:
                wire = RRefWire.model_validate(inner)
            except ValidationError as e:
                raise PayloadError(f"{path}: invalid RRef: {e}") from None
            return rref_decoder(wire)
        if tag.startswith("$"):
            raise PayloadError(f"{path}: unknown tag {tag!r}")
    for k in tree:
        if k.startswith("$"):
            raise PayloadError(f"{path}: untagged key {k!r} starts with '$'")
    return {k: decode_payload(v, frame, rref_decoder, f"{path}[{k!r}]") for k, v in tree.items()}
