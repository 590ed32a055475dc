"""Finding 2 of issue 31: ``stalwart drill`` never sends a job's etcd login in plaintext, and logs in as the job.

A fake etcd (a bare TCP server) records every byte that reaches it: a job that says ``tls: true`` and whose
Secret has no ``ca.crt`` must make the drill refuse with an error naming the key before it opens a connection
(before the fix the drill fell back to an insecure channel and sent the password there).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from stalwart.api import naming
from stalwart.drill.login import drill_credentials, wants_tls
from stalwart.drill.session import DrillError, DrillSession
from stalwart.etcd.client import CredentialsError


class Recorder:
    """A TCP server that accepts and records what arrives (and answers nothing)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.received = bytearray()
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.settimeout(0.2)
            with conn:
                while not self._stop.is_set():
                    try:
                        data = conn.recv(65536)
                    except OSError:
                        continue
                    if not data:
                        break
                    self.received += data

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


@pytest.fixture
def fake_etcd() -> Iterator[Recorder]:
    r = Recorder()
    yield r
    r.close()


LOGIN = {"username": b"trainer", "password": b"s3cret-password"}


def _session(endpoint: str, spec: dict[str, Any], secrets: dict[str, dict[str, bytes]]) -> DrillSession:
    session = DrillSession.__new__(DrillSession)  # no Kubernetes client: the job and its Secrets are given
    session.namespace, session.job, session.etcd_endpoints = "ns", "j", [endpoint]
    session.store, session.uid, session.token, session.etcd_tls = None, "", b"", False
    body = {"metadata": {"uid": "u-1"}, "spec": spec}
    session.get_job = lambda: body  # type: ignore[method-assign]
    session.secret_data = lambda name: secrets[name]  # type: ignore[method-assign]
    return session


def test_a_tls_job_without_ca_is_refused_and_no_byte_reaches_etcd(fake_etcd: Recorder) -> None:
    spec = {"rendezvous": {"endpoints": [fake_etcd.endpoint], "tls": True, "secretRef": {"name": "creds"}}}
    session = _session(fake_etcd.endpoint, spec, {"creds": dict(LOGIN)})
    with pytest.raises(DrillError, match=r"Secret creds: ca\.crt: required with TLS"):
        session.connect()
    assert session.store is None
    assert fake_etcd.connections == 0 and bytes(fake_etcd.received) == b""


def test_the_drill_takes_the_jobs_own_login_from_the_jobs_secret(fake_etcd: Recorder) -> None:
    # A per-job user (--job-etcd-users): no secretRef; the login and CA are in the job's own Secret, so TLS
    # follows from its ca.crt -- and a Secret whose CA is garbage fails the handshake, the password unsent.
    own = {**LOGIN, "ca.crt": b"not a certificate"}
    session = _session(fake_etcd.endpoint, {"rendezvous": {}}, {naming.secret_name("j"): own})
    with pytest.raises(DrillError):
        session.connect()
    assert b"s3cret-password" not in bytes(fake_etcd.received)


@pytest.mark.parametrize(("spec", "endpoints", "secret", "force", "tls"), [
    ({}, ["e:1"], {}, False, False),
    ({"rendezvous": {"tls": True}}, ["e:1"], {}, False, True),
    ({}, ["https://e:1"], {}, False, True),
    ({}, ["e:1"], {"ca.crt": b"CA"}, False, True),
    ({}, ["e:1"], {}, True, True),
])
def test_wants_tls(spec: dict[str, Any], endpoints: list[str], secret: dict[str, bytes], force: bool,
                   tls: bool) -> None:
    assert wants_tls(spec, endpoints, secret, force_tls=force) is tls


def test_drill_credentials_name_the_secret_and_key() -> None:
    with pytest.raises(CredentialsError, match=r"^Secret s: ca\.crt: required with TLS"):
        drill_credentials({"rendezvous": {"tls": True}}, ["e:1"], "s", dict(LOGIN))
    creds = drill_credentials({}, ["e:1"], "s", {**LOGIN, "ca.crt": b"CA"})
    assert creds.tls and creds.user == "trainer" and creds.ca_cert == b"CA"
