"""Finding 3 of issue 31: no job's pods receive the operator's etcd client certificate, and no certificate a job
holds maps to another etcd identity.

With ``--client-cert-auth`` etcd takes a certificate's CN for the user when a request carries no token. Before
the fix every job's Secret held the operator's own certificate and key; were it issued with CN=root, every job
pod was root. Now a job's Secret holds the CA, its own login and (where etcd demands one in the handshake) the
jobs' certificate, whose CN names no etcd user: on a real etcd (TLS only, client certificates required,
authentication on), that certificate alone reads and writes nothing, and the job's login reaches nothing
outside its prefix.
"""

from __future__ import annotations

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID
from pyetcd.etcdrpc import rpc_pb2 as rpc

from stalwart.etcd.admin import JobLogin, ensure_job_login
from stalwart.etcd.client import EtcdCredentials, connect
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import StoreSecurityError
from stalwart.local.etcd import EtcdServer
from stalwart.operator.job_login import JobClient, job_secret_data


def _cn(pem: bytes) -> str:
    return str(x509.load_pem_x509_certificate(pem).subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)


def test_the_jobs_secret_never_carries_the_operators_certificate(secure_etcd: EtcdServer) -> None:
    operator = secure_etcd.credentials()
    assert operator.client_cert and operator.client_key
    login = JobLogin("stalwart-job-ns-u", "pw")
    bare = job_secret_data(login, operator)  # no jobs' certificate given: the login over server-authenticated TLS
    assert set(bare) == {"username", "password", "ca.crt"}
    with pytest.raises(ValueError, match=r"^job-tls\.crt/job-tls\.key: the jobs' client certificate is the "
                                         r"operator's own"):
        job_secret_data(login, operator, JobClient(operator.client_cert, operator.client_key))
    job_client = secure_etcd.job_client()
    assert job_client is not None
    data = job_secret_data(login, operator, job_client)
    assert data["tls.crt"] == job_client.cert and data["tls.key"] == job_client.key
    assert operator.client_cert not in data.values() and operator.client_key not in data.values()


def test_no_certificate_a_job_holds_maps_to_another_identity(secure_etcd: EtcdServer) -> None:
    mine, theirs = JobKeys("ns-a", "uid-a"), JobKeys("ns-b", "uid-b")
    root_creds = secure_etcd.credentials()
    with connect([secure_etcd.endpoint], root_creds) as root:
        login = ensure_job_login(root, mine, "job-a-password")
        ensure_job_login(root, theirs, "job-b-password")
        root.put(f"{theirs.prefix}secret", b"theirs")
        users = {str(u) for u in root.auth("UserList", rpc.AuthUserListRequest()).users}
    job_client = secure_etcd.job_client()
    assert job_client is not None
    data = job_secret_data(login, root_creds, job_client)
    # The job's certificate names no etcd user (nor the operator's certificate's).
    assert _cn(data["tls.crt"]) not in users | {_cn(root_creds.client_cert or b"")}
    cert_only = EtcdCredentials.from_secret({k: v for k, v in data.items() if k not in ("username", "password")},
                                            tls=True)
    for prefix in (theirs.prefix, mine.prefix, "/"):
        with pytest.raises(StoreSecurityError, match="no username/password was given"):
            connect([secure_etcd.endpoint], cert_only, probe=prefix).close()
    # The job's own login reaches its own prefix and nothing else.
    job = EtcdCredentials.from_secret(data, tls=True)
    with connect([secure_etcd.endpoint], job, probe=mine.prefix) as store:
        with pytest.raises(StoreSecurityError, match="permission"):
            store.put(f"{theirs.prefix}secret", b"overwritten")
        with pytest.raises(StoreSecurityError, match="permission"):
            store.get_prefix(theirs.prefix)
    with connect([secure_etcd.endpoint], root_creds) as root:
        kvs, _ = root.get_prefix(f"{theirs.prefix}secret")
        assert [kv.value for kv in kvs] == [b"theirs"]  # nothing was written
