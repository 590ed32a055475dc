"""One key per purpose from the job's secret: HKDF-SHA256 as RFC 5869 has it (issue 31, finding 9)."""

from __future__ import annotations

import pytest

from stalwart.api.keys import PURPOSES, hkdf_sha256, purpose_key


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
