"""Frames and payloads: round trips, tensors as raw bytes, refusals that name the path, malformed frames."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.api.rpc import Envelope
from stalwart.rpc.codec import (
    BLOB_ALIGN,
    IN_PLACE_FROM,
    Blobs,
    decode_frame,
    decode_payload,
    encode_frame,
    encode_payload,
    header_json,
)
from stalwart.rpc.errors import PayloadError
from stalwart.rpc.transport import joined


def roundtrip(value: Any, *, owned: bool = False) -> Any:
    """Encode, join the parts as the wire would, decode (from a buffer of its own when ``owned``)."""
    blobs = Blobs()
    payload = encode_payload(value, blobs, None)
    head = header_json(kind="req", type="call", id=1, src="w0", inc="i", epoch=3, fn="f", payload=payload,
                       blobs=blobs.meta)
    wire = joined(encode_frame(head, blobs))
    frame = decode_frame(bytearray(wire) if owned else wire)
    assert frame.header.epoch == 3
    return decode_payload(frame.header.payload, frame, None)


scalars = st.none() | st.booleans() | st.integers(-2**62, 2**62) | st.floats(allow_nan=False,
                                                                          allow_infinity=False) | st.text()
keys = st.text() | st.integers(-100, 100) | st.sampled_from(["$t", "$b", "$u", "$x"])
values = st.recursive(
    scalars | st.binary(max_size=64),
    lambda children: st.lists(children, max_size=4) | st.tuples(children, children)
    | st.dictionaries(keys, children, max_size=4),
    max_leaves=20)


@settings(max_examples=150)
@given(values)
def test_payload_round_trip(value: Any) -> None:
    assert roundtrip(value) == value


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int8, torch.uint8, torch.bool, torch.complex64])
def test_tensors_travel_as_raw_bytes(dtype: torch.dtype) -> None:
    t = (torch.arange(24).reshape(2, 3, 4) % 3).to(dtype)
    out = roundtrip({"t": t, "view": t[:, 1], "empty": torch.empty(0, 5, dtype=dtype)})
    assert out["t"].dtype == dtype and torch.equal(out["t"], t)
    assert torch.equal(out["view"], t[:, 1])  # non-contiguous views are sent as their values
    assert out["empty"].shape == (0, 5)
    out["t"].add_(1) if dtype != torch.bool else None  # the received tensor owns writable memory


def test_a_frame_with_its_own_buffer_lends_it_to_large_tensors_aligned() -> None:
    big = torch.arange(IN_PLACE_FROM // 8 + 3, dtype=torch.float64)
    small = torch.arange(5, dtype=torch.int16)
    blobs = Blobs()
    payload = encode_payload([b"odd", small, big, big[1:]], blobs, None)
    parts = encode_frame(header_json(kind="req", type="call", id=1, src="w0", inc="i", epoch=1, payload=payload,
                                     blobs=blobs.meta), blobs)
    assert isinstance(parts, list)
    # the tensors' own memory is among the parts: sent without a copy
    assert any(isinstance(p, memoryview) and p.nbytes == big.nbytes for p in parts)
    wire = bytearray(joined(parts))
    frame = decode_frame(wire)
    base = ctypes_address(memoryview(wire))
    assert [(ctypes_address(b) - base) % BLOB_ALIGN for b in frame.blobs] == [0, 0, 0, 0]
    got = decode_payload(frame.header.payload, frame, None)
    assert got[0] == b"odd" and torch.equal(got[1], small) and torch.equal(got[2], big)
    assert torch.equal(got[3], big[1:])
    # the large tensor is a view of the frame's buffer; the small one a copy
    assert base <= got[2].data_ptr() < base + len(wire)
    assert not base <= got[1].data_ptr() < base + len(wire)
    got[2].add_(1)  # writable, and still correct after the frame object is gone
    del frame, wire
    assert torch.equal(got[2], big + 1)


def ctypes_address(view: memoryview) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def test_a_sent_tensor_stays_alive_while_its_parts_do() -> None:
    blobs = Blobs()
    encode_payload([torch.full((1000,), 7.0)], blobs, None)  # no other reference to the tensor
    parts = encode_frame(header_json(kind="req", type="call", id=1, src="w0", inc="i", epoch=1, payload=None,
                                     blobs=blobs.meta), blobs)
    del blobs
    import gc

    gc.collect()
    torch.ones(100_000).add_(1)  # reuse freed memory if the tensor had been freed
    assert torch.equal(torch.frombuffer(bytearray(parts[-1]), dtype=torch.float32), torch.full((1000,), 7.0))


@pytest.mark.parametrize("owned", [False, True])
def test_tensors_round_trip_from_either_kind_of_buffer(owned: bool) -> None:
    values = {"big": torch.randn(300, 300), "c": torch.randn(20000, dtype=torch.complex128), "b": b"x" * 70000}
    out = roundtrip(values, owned=owned)
    assert torch.equal(out["big"], values["big"]) and torch.equal(out["c"], values["c"]) and out["b"] == values["b"]


def test_unsupported_values_are_refused_with_their_path() -> None:
    class Thing:
        pass

    with pytest.raises(PayloadError, match=r"payload\['a'\]\[1\].*Thing"):
        encode_payload({"a": [1, Thing()]}, Blobs(), None)
    with pytest.raises(PayloadError, match="NaN"):
        encode_payload([float("nan")], Blobs(), None)
    with pytest.raises(PayloadError, match="cannot send"):
        encode_payload(lambda: 1, Blobs(), None)  # callables are named, never shipped


def _frame(header: dict[str, Any], body: bytes = b"") -> bytes:
    """A frame by hand: the body (the blobs) starts at the first aligned offset after the header."""
    head = json.dumps(header).encode()
    start = struct.pack(">I", len(head)) + head
    return start + bytes(-len(start) % BLOB_ALIGN if body else 0) + body


GOOD = {"kind": "req", "type": "call", "id": 1, "src": "w0", "inc": "i", "epoch": 1}


@pytest.mark.parametrize(("data", "match"), [
    (b"\x00\x00", "shorter"),
    (struct.pack(">I", 1 << 30) + b"{}", "out of bounds"),
    (_frame({**GOOD, "kind": "evil"}), "invalid message header"),
    (_frame({**GOOD, "extra": 1}), "invalid message header"),
    (_frame({**GOOD, "blobs": [{"nbytes": 10}]}, b"short"), "runs past"),
    (_frame(GOOD, b"trailing"), "after its last blob"),
    (b"\x80\x04\x95" + b"\x00" * 20, "out of bounds|invalid"),  # a pickle is just garbage here
])
def test_malformed_frames_are_rejected(data: bytes, match: str) -> None:
    with pytest.raises(PayloadError, match=match):
        decode_frame(data)


@pytest.mark.parametrize(("payload", "blobs", "body", "match"), [
    ({"$t": 0}, [{"nbytes": 4, "dtype": "float32", "shape": [2]}], b"\x00" * 4, "needs 8 bytes"),
    ({"$t": 0}, [{"nbytes": 4, "dtype": "object", "shape": [1]}], b"\x00" * 4, "accepted dtype"),
    ({"$t": 3}, [], b"", "out of range"),
    ({"$b": 0}, [{"nbytes": 4, "dtype": "int32", "shape": [1]}], b"\x00" * 4, "is a tensor"),
    ({"$zz": 1}, [], b"", "unknown tag"),
    ({"$r": {"owner": "w1"}}, [], b"", "cannot appear"),
    ({"$d": [[1]]}, [], b"", "pairs"),
])
def test_malformed_payloads_are_rejected(payload: Any, blobs: list[Any], body: bytes, match: str) -> None:
    frame = decode_frame(_frame({**GOOD, "payload": payload, "blobs": blobs}, body))
    with pytest.raises(PayloadError, match=match):
        decode_payload(frame.header.payload, frame, None)


def test_envelope_is_the_schema_of_outgoing_headers() -> None:
    head = header_json(kind="rep", type="fork", id=7, src="w1", inc="x", epoch=2, err=None, payload=None)
    assert Envelope.model_validate_json(head).id == 7
