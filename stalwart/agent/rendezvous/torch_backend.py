"""torch elastic's ``RendezvousBackend`` on etcd v3, and its registration for ``torchrun``.

torch's own etcd backends speak etcd's v2 API, which etcd 3.6 removed. :class:`EtcdV3RendezvousBackend` keeps
the one state key of torch's DynamicRendezvousHandler in etcd v3; the fencing token is the key's
``mod_revision`` and ``set_state`` is a single transaction comparing it. Use it from torchrun as::

    torchrun --rdzv-backend=stalwart-etcd --rdzv-endpoint=HOST:PORT[,HOST:PORT...] --rdzv-id=RUN ...

(``--rdzv-conf key_prefix=/some/prefix/`` moves the keys; ``etcd_timeout=SECONDS`` sets each call's deadline;
``hmac_key_file=PATH`` names the file with the run's secret, see below). etcd credentials come from the pod
contract (``STALWART_ETCD_SECRET_DIR``/``STALWART_ETCD_TLS``, :mod:`stalwart.etcd.client`).
The name is registered through the ``torchrun.handlers`` entry point, which torch's registry loads on start,
and by :func:`register` for programs that build handlers themselves.

torch's handler pickles its own state, and unpickles what it reads back: whoever may write the state key could
run code in every torchrun agent. So the state is signed: the envelope carries an HMAC-SHA256 over the key name,
the format, the key's ``version`` once written (how many times it was written since created: an older signed
state put back is at a later version, and refused) and the state bytes, with the torchrun-state key derived
(:func:`stalwart.api.keys.purpose_key`) from the run's secret (``hmac_key_file``, else the job's
``STALWART_RPC_TOKEN``); a record whose MAC does not verify is refused with ``RendezvousStateError`` before torch
sees its bytes. (A state deleted and re-created is at version 1 again: the first state ever written could be put
back after a delete; torch's handler then starts its rendezvous over.)
This module itself never unpickles anything.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import urllib.parse
from pathlib import Path
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousStateError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, create_handler

from stalwart import exits
from stalwart.api import pod_env
from stalwart.api.keys import purpose_key
from stalwart.api.rendezvous import TorchRendezvousState
from stalwart.etcd.client import EtcdCredentials, connect
from stalwart.etcd.store import Compare, Get, KeyValue, Put, Store, StoreError
from stalwart.etcd.torch_store import EtcdTorchStore

BACKEND_NAME = "stalwart-etcd"
STATE_FORMAT = "torch-dynamic-rendezvous/v1"
#: Where torchrun runs keep their keys unless ``key_prefix`` says otherwise (not a job prefix: torchrun
#: runs have no TrainingJob).
DEFAULT_KEY_PREFIX = "/stalwart/torchrun/v1/"


class EtcdV3RendezvousBackend(RendezvousBackend):
    """The state of one torch rendezvous at etcd key ``key``. Honours torch's docstring exactly:

    * ``get_state()`` -> ``(state, token)`` or ``None`` when there is no state;
    * ``set_state(state, token)`` writes only if ``token`` is the key's current ``mod_revision`` (or, with
      ``token=None``, only if the key is absent), and returns ``(state, token, True)``; otherwise it writes
      nothing and returns the current ``(state, token, False)``, or ``None`` if there is no state;
    * a failed connection raises ``RendezvousConnectionError``; a corrupt value ``RendezvousStateError``.
    """

    def __init__(self, store: Store, key: str, *, secret: bytes) -> None:
        if not key or key.endswith("/"):
            raise ValueError(f"key: must be a key name (not a prefix), got {key!r}")
        if len(secret) < 16:
            raise ValueError("secret: the state's signing key needs at least 16 bytes")
        self._store = store
        self._key = key
        self._secret = purpose_key(secret, "torchrun-state")

    def _mac(self, fmt: str, version: int, state: bytes) -> str:
        message = b"\0".join([self._key.encode(), fmt.encode(), str(version).encode(), state])
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    @property
    def name(self) -> str:
        return BACKEND_NAME

    @property
    def key(self) -> str:
        return self._key

    def _decode(self, kv: KeyValue) -> tuple[bytes, Any]:
        try:
            envelope = TorchRendezvousState.from_json_bytes(kv.value)
        except ValueError as e:
            raise RendezvousStateError(f"the rendezvous state at {self._key!r} is corrupt: {e}") from None
        if envelope.format != STATE_FORMAT:
            raise RendezvousStateError(
                f"the rendezvous state at {self._key!r} has format {envelope.format!r}, expected {STATE_FORMAT!r}")
        try:
            state = base64.b64decode(envelope.state, validate=True)
        except (binascii.Error, ValueError) as e:
            raise RendezvousStateError(f"the rendezvous state at {self._key!r} is not valid base64: {e}") from None
        if not hmac.compare_digest(envelope.mac, self._mac(envelope.format, kv.version, state)):
            raise RendezvousStateError(
                f"the rendezvous state at {self._key!r} fails its signature check (written without the run's "
                "secret, altered, or an older state put back); refused before torch reads it")
        return state, kv.mod_revision

    def get_state(self) -> tuple[bytes, Any] | None:
        """See the class docstring."""
        try:
            kv = self._store.get(self._key)
        except StoreError as e:
            raise RendezvousConnectionError(f"the connection to etcd has failed: {e}") from e
        return None if kv is None else self._decode(kv)

    def set_state(self, state: bytes, token: Any | None = None) -> tuple[bytes, Any, bool] | None:
        """See the class docstring."""
        if token is not None and (not isinstance(token, int) or isinstance(token, bool)):
            # Not a token this backend ever handed out: it cannot match.
            current = self.get_state()
            return None if current is None else (*current, False)
        version = 1
        if token is not None:  # the version this write makes: the current one's, plus one
            try:
                kv = self._store.get(self._key)
            except StoreError as e:
                raise RendezvousConnectionError(f"the connection to etcd has failed: {e}") from e
            if kv is None:
                return None
            if kv.mod_revision != token:
                return (*self._decode(kv), False)
            version = kv.version + 1
        envelope = TorchRendezvousState(format=STATE_FORMAT, state=base64.b64encode(state).decode(),
                                        mac=self._mac(STATE_FORMAT, version, state))
        try:
            value = envelope.to_json_bytes()
        except ValueError as e:
            raise RendezvousStateError(f"the rendezvous state is too large for {self._key!r}: {e}") from None
        guard = Compare(self._key, "create", "==", 0) if token is None else Compare(self._key, "mod", "==", token)
        try:
            res = self._store.txn([guard], [Put(self._key, value)], [Get(self._key)])
        except StoreError as e:
            raise RendezvousConnectionError(f"the connection to etcd has failed: {e}") from e
        if res.succeeded:
            return state, res.revision, True
        existing = res.responses[0]
        if not existing:
            return None
        return (*self._decode(existing[0]), False)


def _endpoints(params: RendezvousParameters) -> list[str]:
    endpoints = [e.strip() for e in (params.endpoint or "").split(",") if e.strip()]
    if not endpoints:
        raise ValueError("rdzv_endpoint: the stalwart-etcd backend needs HOST:PORT of etcd (comma-separated)")
    return [e if ":" in e else f"{e}:2379" for e in endpoints]


def _secret(params: RendezvousParameters) -> bytes:
    path = params.get("hmac_key_file", None)
    if path:
        try:
            secret = Path(str(path)).read_bytes().strip()
        except OSError as e:
            raise ValueError(f"rdzv_conf hmac_key_file: cannot read {path!r}: {e}") from None
    else:
        secret = os.environ.get(pod_env.RPC_TOKEN, "").encode()
    if len(secret) < 16:
        raise ValueError("rdzv_conf hmac_key_file: the stalwart-etcd backend signs torch's rendezvous state (torch "
                         "unpickles it); give a file holding a secret of at least 16 bytes shared by the run's "
                         "agents (in a TrainingJob's pods, STALWART_RPC_TOKEN is used)")
    return secret


def create_backend(params: RendezvousParameters) -> tuple[EtcdV3RendezvousBackend, EtcdTorchStore]:
    """The backend and the torch Store (both on etcd v3) for torchrun's parameters.

    ``rdzv_conf`` keys: ``key_prefix`` (default ``/stalwart/torchrun/v1/``), ``etcd_timeout`` (seconds per
    etcd call, default 10), ``store_timeout`` (seconds for the Store's waits, default 300), ``hmac_key_file``
    (the run's secret that signs the state; default: the job's ``STALWART_RPC_TOKEN``).
    """
    secret = _secret(params)
    prefix = str(params.get("key_prefix", DEFAULT_KEY_PREFIX))
    if not prefix.endswith("/"):
        prefix += "/"
    etcd_timeout = float(params.get("etcd_timeout", 10))
    store_timeout = float(params.get("store_timeout", 300))
    run = urllib.parse.quote(params.run_id, safe="")
    # torchrun's own process: its streams are closed before its interpreter finalises, and an exit that
    # overruns the bound leaves its stacks in the log (its agent bounds it, as any rank's).
    exits.guard_exit()
    store = connect(_endpoints(params), EtcdCredentials.from_env(), timeout=etcd_timeout)
    backend = EtcdV3RendezvousBackend(store, f"{prefix}{run}/state", secret=secret)
    return backend, EtcdTorchStore.unfenced(store, f"{prefix}{run}/store/", timeout=store_timeout)


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's DynamicRendezvousHandler over :class:`EtcdV3RendezvousBackend` (torch's usual rdzv_conf
    keys such as ``join_timeout`` and ``last_call_timeout`` apply)."""
    backend, store = create_backend(params)
    return create_handler(store, backend, params)


def handler_factory() -> Any:
    """The ``torchrun.handlers`` entry point: torch calls it and registers what it returns."""
    return create_rdzv_handler


def register() -> None:
    """Register ``stalwart-etcd`` with torch's rendezvous handler registry (idempotent)."""
    rendezvous_handler_registry.register(BACKEND_NAME, create_rdzv_handler)
