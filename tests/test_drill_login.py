"""Finding 2 of issue 31: ``stalwart drill`` never sends a job's etcd login in plaintext, and logs in as the job.

A fake etcd (a bare TCP server) records every byte that reaches it: a job that says ``tls: true`` and whose
Secret has no ``ca.crt`` must make the drill refuse with an error naming the key before it opens a connection
(before the fix the drill fell back to an insecure channel and sent the password there).
"""

from __future__ import annotations

from typing import Any

import pytest
from recording_server import Recorder

from stalwart.api import naming
from stalwart.drill.login import drill_credentials, wants_tls
from stalwart.drill.session import DrillError, DrillSession
from stalwart.etcd.client import CredentialsError

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
