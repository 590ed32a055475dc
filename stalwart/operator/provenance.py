"""Which existing objects this operator made: a mark only the operator can write (issue 31, finding 8).

An owner reference proves nothing about who made an object: whoever may create Secrets in a namespace can write
one naming the job's uid as its controller, before the operator creates the job's Secret, and so hand the job
an RPC token (and an etcd login) of their choosing. So the operator signs what it makes: the annotation
:data:`~stalwart.api.naming.ANNOTATION_MADE_BY` holds ``v1:`` and the hex HMAC-SHA256, under the operator's
adoption key, of the object's kind, namespace, name and the job's uid. Found in place of one it meant to
create, an object is the job's only with its uid as controller *and* a mark that verifies
(:func:`~stalwart.operator.guards.conflict_of`).

The key is the operator's alone: a file from a Secret of the operator's own namespace (the chart makes it and
keeps it across upgrades), read once at start (:func:`load_key`). Without one, the operator draws a key for its
own lifetime and says so: it then cannot adopt what an earlier run of it made.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from pathlib import Path

__all__ = ["KEY_BYTES", "load_key", "mark", "new_key", "verifies"]

#: The least length of an adoption key, in bytes.
KEY_BYTES = 32
_VERSION = "v1"


def mark(key: bytes, kind: str, namespace: str, name: str, uid: str) -> str:
    """The mark of the object ``kind`` ``namespace``/``name`` made for the job of ``uid``."""
    message = "\0".join((kind, namespace, name, uid)).encode()
    return f"{_VERSION}:{hmac.new(key, message, hashlib.sha256).hexdigest()}"


def verifies(key: bytes, kind: str, namespace: str, name: str, uid: str, *, shown: str | None) -> bool:
    """Whether ``shown`` (the object's annotation; None: it has none) is the mark this operator would write."""
    return shown is not None and hmac.compare_digest(shown.encode(), mark(key, kind, namespace, name, uid).encode())


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def load_key(path: str) -> bytes:
    """The adoption key in the file at ``path`` (its bytes, surrounding white space stripped)."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as e:
        raise ValueError(f"--adoption-key-file: cannot read {path}: {e.strerror}") from e
    if len(key) < KEY_BYTES:
        raise ValueError(f"--adoption-key-file: {path} holds {len(key)} bytes; expected at least {KEY_BYTES}")
    return key
