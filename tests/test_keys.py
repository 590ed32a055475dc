"""One key per purpose from the job's secret: HKDF-SHA256 as RFC 5869 has it (issue 31, finding 9), and each
channel keyed by its own: a drill signature or RPC proof made with the token itself or another purpose's key
is refused."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from stalwart.api.drill import DrillRequest
from stalwart.api.keys import PURPOSES, hkdf_sha256, purpose_key
from stalwart.rpc.handshake import caller_proof


def test_hkdf_matches_rfc_5869_test_case_1() -> None:
    okm = hkdf_sha256(bytes([0x0B] * 22), salt=bytes(range(13)), info=bytes(range(0xF0, 0xFA)), length=42)
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"
                         "34007208d5b887185865")


def test_each_purpose_has_its_own_key() -> None:
    keys = {p: purpose_key(b"the-job-token-0123456789", p) for p in PURPOSES}
    assert len(set(keys.values())) == len(PURPOSES) and all(len(k) == 32 for k in keys.values())
    assert b"the-job-token-0123456789" not in keys.values()
    with pytest.raises(ValueError, match="purpose: expected one of"):
        purpose_key(b"x", "etcd")  # type: ignore[arg-type]


def test_a_drill_request_signed_with_the_token_itself_or_another_purposes_key_is_refused() -> None:
    token = b"the-job-token-0123456789"
    req = DrillRequest(id="ab" * 16, job_uid="uid-1", node_id="job-worker-1", local_rank=0, kind="rank-kill",
                       issued=1.0, expires=100.0)
    assert req.signed(token).verify(token)
    for key in (token, purpose_key(token, "rpc"), purpose_key(token, "torchrun-state")):
        forged = req.model_copy(update={"signature": hmac.new(key, req.payload(), hashlib.sha256).hexdigest()})
        assert not forged.verify(token)


def test_an_rpc_proof_is_keyed_by_the_rpc_key_not_the_token() -> None:
    token, first, second = "the-job-token-0123456789", b"n" * 16, b"m" * 16
    shown = caller_proof(token, first, second)
    assert shown == hmac.new(purpose_key(token.encode(), "rpc"), b"caller" + second + first, hashlib.sha256).digest()
    assert shown != hmac.new(token.encode(), b"caller" + second + first, hashlib.sha256).digest()
