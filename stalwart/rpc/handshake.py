"""The handshake that opens every RPC connection: a challenge and response on the job's token.

Authentication is a challenge and response on the RPC key ``K`` derived from the job's token
(``STALWART_RPC_TOKEN``; HKDF for the purpose "rpc", :mod:`stalwart.api.keys`), both ways, before a single
frame is parsed; neither token nor key ever travels, and a recorded handshake is worth nothing later (every
connection has fresh nonces):

1. the caller writes the magic ``b"STWRPC2\n"`` and a random 16-byte nonce ``cn``;
2. the callee answers with its own random nonce ``sn`` and ``HMAC-SHA256(K, "callee" | cn | sn)``, which
   proves it holds the token (so a caller never sends its frames to an impostor);
3. the caller checks that proof (in constant time) and writes ``HMAC-SHA256(K, "caller" | sn | cn)``,
   then its frames;
4. the callee checks the caller's proof with :func:`hmac.compare_digest` before it reads anything more:
   on a mismatch it answers one refusal byte ``0x00`` and closes, so an unauthenticated peer gets nothing
   and none of its bytes is ever parsed; on a match it answers ``0x01``.

A peer that does not complete its part within :data:`HELLO_TIMEOUT` seconds is disconnected. The handshake
authenticates; it does not encrypt (frames travel in clear text on the pod network).
"""

from __future__ import annotations

import functools
import hashlib
import hmac

from stalwart.api.keys import purpose_key

MAGIC = b"STWRPC2\n"
NONCE_BYTES = 16
PROOF_BYTES = 32
#: Seconds each side of a new connection has to do its part of the handshake before it is closed.
HELLO_TIMEOUT = 10.0
ACCEPTED = b"\x01"
REFUSED = b"\x00"


def proof(token: str, role: bytes, first: bytes, second: bytes) -> bytes:
    """``HMAC-SHA256(K, role | first | second)``: what each side of the handshake shows. ``K`` is the RPC
    key derived from the token (:func:`~stalwart.api.keys.purpose_key`), never the token itself: a proof made
    for another of the token's purposes (a drill request's signature) proves nothing here."""
    return hmac.new(rpc_key(token), role + first + second, hashlib.sha256).digest()


@functools.lru_cache(maxsize=8)
def rpc_key(token: str) -> bytes:
    return purpose_key(token.encode(), "rpc")


def callee_proof(token: str, caller_nonce: bytes, callee_nonce: bytes) -> bytes:
    return proof(token, b"callee", caller_nonce, callee_nonce)


def caller_proof(token: str, caller_nonce: bytes, callee_nonce: bytes) -> bytes:
    return proof(token, b"caller", callee_nonce, caller_nonce)

