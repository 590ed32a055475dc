"""One key per purpose, derived from the job's secret (HKDF-SHA256, RFC 5869, over the standard library).

The job's Secret holds one random token. Each use of it derives its own key, so that a key learned or misused
in one channel (say, a drill request's signature) is no key for another (the torchrun state's MAC, RPC):
:func:`purpose_key` with one of the :data:`PURPOSES`.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Final, Literal

__all__ = ["PURPOSES", "Purpose", "hkdf_sha256", "purpose_key"]

Purpose = Literal["rpc", "drill-signing", "torchrun-state"]
PURPOSES: Final[tuple[Purpose, ...]] = ("rpc", "drill-signing", "torchrun-state")
_SALT: Final = b"stalwart/v1"
_HASH_LEN: Final = 32


def hkdf_sha256(ikm: bytes, *, salt: bytes, info: bytes, length: int = _HASH_LEN) -> bytes:
    """RFC 5869: extract with ``salt``, then expand to ``length`` bytes for ``info``."""
    if not 0 < length <= 255 * _HASH_LEN:
        raise ValueError(f"length: expected 1..{255 * _HASH_LEN} bytes, got {length}")
    prk = hmac.new(salt or bytes(_HASH_LEN), ikm, hashlib.sha256).digest()
    out, block = b"", b""
    for i in range(1, -(-length // _HASH_LEN) + 1):
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        out += block
    return out[:length]


def purpose_key(secret: bytes, purpose: Purpose) -> bytes:
    """The 32-byte key for ``purpose`` derived from the job's ``secret``."""
    if purpose not in PURPOSES:
        raise ValueError(f"purpose: expected one of {PURPOSES}, got {purpose!r}")
    return hkdf_sha256(secret, salt=_SALT, info=b"stalwart " + purpose.encode())
