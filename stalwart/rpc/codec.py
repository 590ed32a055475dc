"""Frames and payloads: JSON for structure, raw bytes for tensors and ``bytes`` values; never pickle.

A frame is ``u32 header length (big-endian) | Envelope JSON | blob 0 | blob 1 | ...``, where each blob starts
at the next offset (from the frame's start) that is a multiple of :data:`BLOB_ALIGN`, the gap zero-filled: a
tensor received into a frame buffer of its own is then used in place, aligned for any dtype, not copied.
A payload is any tree of ``None``, ``bool``, ``int``, ``float``, ``str``, ``list``, ``tuple``, ``dict``, ``bytes``, CPU
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
import math
import struct
import sys
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from pydantic_core import to_json

from stalwart.api.rpc import MAX_HEADER_BYTES, BlobMeta, Envelope, RRefWire
from stalwart.rpc.errors import PayloadError

_LEN = struct.Struct(">I")

#: Tensor dtypes a frame may carry (plain numeric data; no quantized or opaque types).
TENSOR_DTYPES = frozenset({
    "float64", "float32", "float16", "bfloat16", "complex64", "complex128",
    "int64", "int32", "int16", "int8", "uint8", "bool",
})

#: Blobs start at offsets (from the frame's start) that are multiples of this.
BLOB_ALIGN = 64
#: A tensor blob of at least this many bytes in a frame that owns its buffer is used in place.
IN_PLACE_FROM = 64 * 1024

#: Encodes an RRef found in a payload as a new fork for the destination (supplied by the RRef layer).
RRefEncoder = Callable[[Any], RRefWire]
#: Builds the receiver's RRef handle from a fork (supplied by the RRef layer).
RRefDecoder = Callable[[RRefWire], Any]


class Blobs:
    """The raw parts of a payload being encoded: metadata for the header and buffers for the frame.

    A tensor's buffer is a view of the tensor's own memory (no copy), which keeps the tensor alive for as
    long as the view exists: the transport may still be sending it after the call has ended.
    """

    __slots__ = ("buffers", "meta")

    def __init__(self) -> None:
        self.meta: list[BlobMeta] = []
        self.buffers: list[bytes | bytearray | memoryview] = []

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
            memory = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
            setattr(memory, "_tensor", tensor)  # noqa: B010 -- the view's exporter must own the tensor
            self.buffers.append(memoryview(memory).cast("B"))
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
    # pydantic-core's serializer: the same compact JSON as json.dumps, several times faster
    return to_json({k: v for k, v in fields.items() if v is not None})


def _pad(offset: int) -> int:
    return -offset % BLOB_ALIGN


def encode_frame(header: Envelope | bytes, blobs: Blobs | None = None) -> bytes | list[bytes | bytearray | memoryview]:
    """One frame: the header (with the blobs' metadata already in it) then the blobs' bytes, each aligned.

    Without blobs the frame is one ``bytes``; with blobs it is the list of its parts in order, the blobs'
    own buffers among them (the transport sends them without joining them).
    """
    head = header if isinstance(header, bytes) else header.model_dump_json(exclude_defaults=True).encode()
    if len(head) > MAX_HEADER_BYTES:
        raise PayloadError(f"message header is {len(head)} bytes of JSON; the limit is {MAX_HEADER_BYTES} "
                           "(send bulk data as tensors or bytes)")
    if blobs is None or not blobs.buffers:
        return _LEN.pack(len(head)) + head
    offset = _LEN.size + len(head)
    parts: list[bytes | bytearray | memoryview] = [_LEN.pack(len(head)) + head + bytes(_pad(offset))]
    offset += _pad(offset)
    last = len(blobs.buffers) - 1
    for i, (buf, meta) in enumerate(zip(blobs.buffers, blobs.meta, strict=True)):
        if meta.nbytes:
            parts.append(buf)
        offset += meta.nbytes
        if i < last and _pad(offset):
            parts.append(bytes(_pad(offset)))
            offset += _pad(offset)
    return parts


class Frame:
    """A received frame: the validated header and the blob bytes it describes.

    ``owned``: the frame arrived in a buffer of its own (a ``bytearray`` nobody else holds), so large
    tensors are decoded as views of it instead of copies.
    """

    __slots__ = ("blobs", "header", "owned")

    def __init__(self, header: Envelope, blobs: list[memoryview], owned: bool = False) -> None:
        self.header = header
        self.blobs = blobs
        self.owned = owned


def decode_frame(data: bytes | bytearray) -> Frame:
    """Parse and check a frame. Raises :class:`PayloadError` for anything malformed.

    Pass a ``bytearray`` only when the frame may keep it: its large tensors will share its memory.
    """
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
        offset += _pad(offset)
        end = offset + meta.nbytes
        if end > len(data):
            raise PayloadError(f"blob {i} ({meta.nbytes} bytes) runs past the end of the frame")
        blobs.append(view[offset:end])
        offset = end
    if offset != len(data):
        raise PayloadError(f"frame has {len(data) - offset} bytes after its last blob")
    return Frame(header, blobs, owned=isinstance(data, bytearray))


def _tensor(meta: BlobMeta, raw: memoryview, owned: bool, path: str) -> Any:
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
    if owned and meta.nbytes >= IN_PLACE_FROM and ctypes.addressof(ctypes.c_char.from_buffer(raw)) % itemsize == 0:
        # In place: the tensor keeps the frame's buffer alive; nothing else writes to it.
        return torch.frombuffer(raw, dtype=dtype).reshape(meta.shape)
    # A copy into memory the tensor owns (writable, independent of the frame's lifetime).
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
            return _tensor(meta, frame.blobs[inner], frame.owned, path)
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
