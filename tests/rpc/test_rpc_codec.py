"""Frames and payloads: round trips, tensors as raw bytes, refusals that name the path, malformed frames."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.agent.rpc.codec import Blobs, decode_frame, decode_payload, encode_frame, encode_payload, header_json
from stalwart.agent.rpc.errors import PayloadError
from stalwart.api.rpc import Envelope


def roundtrip(value: Any) -> Any:
    blobs = Blobs()
    payload = encode_payload(value, blobs, None)
    head = header_json(kind="req", type="call", id=1, src="w0", inc="i", epoch=3, fn="f", payload=payload,
                       blobs=blobs.meta)
    frame = decode_frame(encode_frame(head, blobs))
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
    head = json.dumps(header).encode()
    return struct.pack(">I", len(head)) + head + body


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
