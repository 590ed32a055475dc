"""One etcd user per job, on the operator's default etcd (``--job-etcd-users``).

For a job that uses the operator's etcd (no ``spec.rendezvous.endpoints``/``secretRef`` of its own), the
operator, logged in as an etcd administrator, makes the job a role limited to its key prefix and a user with a
random password (:mod:`stalwart.etcd.admin`), and writes the login (and the TLS material its agents need) into
the job's own Secret, which is owner-referenced and mounted into every pod as the etcd credentials. The user and
role are deleted with the job (the finalizer). A job's agents so read and write their own prefix and nothing
else.

The password lives in the Secret: when the Secret already exists (an operator restart), its password is kept
and the etcd user brought in line with it, so the running pods' login keeps working.

The job's Secret never carries the operator's own client certificate (issue 31, finding 3): with
``--client-cert-auth`` etcd takes a certificate's CN for the user when no token is sent, so a job holding the
operator's certificate could act as the operator (as root, were it issued so). A job gets the CA (to
authenticate the server) and its login; where etcd demands a client certificate in the handshake, the one an
administrator made for jobs (:class:`JobClient`, ``job-tls.crt``/``job-tls.key`` beside the operator's
credentials), whose CN must name no etcd user; it is refused when it is the operator's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from stalwart.etcd.admin import JobLogin, delete_job_login, ensure_job_login, new_password
from stalwart.etcd.client import EtcdCredentials
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store

__all__ = ["JobClient", "job_secret_data", "provision", "retire"]


@dataclass(frozen=True, slots=True)
class JobClient:
    """The client certificate jobs present in etcd's TLS handshake (never the operator's); key out of ``repr``."""

    cert: bytes = field(repr=False)
    key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not self.cert or not self.key:
            raise ValueError("job-tls.crt/job-tls.key: the jobs' client certificate needs both")

    @classmethod
    def from_dir(cls, directory: str | Path | None) -> JobClient | None:
        """``job-tls.crt``/``job-tls.key`` from the operator's credentials directory; None when neither is there."""
        if directory is None:
            return None
        cert, key = Path(directory) / "job-tls.crt", Path(directory) / "job-tls.key"
        if not cert.is_file() and not key.is_file():
            return None
        return cls(cert.read_bytes() if cert.is_file() else b"", key.read_bytes() if key.is_file() else b"")


def provision(store: Store, keys: JobKeys, existing: Mapping[str, bytes]) -> JobLogin:
    """Create or repair the job's etcd user, keeping the password of an ``existing`` Secret's data."""
    old = existing.get("password")
    password = old.decode() if old else new_password()
    return ensure_job_login(store, keys, password)


def retire(store: Store, keys: JobKeys) -> None:
    """Delete the job's etcd user and role (idempotent)."""
    delete_job_login(store, keys)


def job_secret_data(login: JobLogin, operator: EtcdCredentials, job_client: JobClient | None = None
                    ) -> dict[str, bytes]:
    """The etcd credentials keys of the job's Secret: the job's login, the CA of etcd's server certificate
    when etcd requires TLS, and the jobs' client certificate when one is given; never the operator's own
    certificate or key (a ``ValueError`` names ``job-tls.crt``/``job-tls.key`` when they are the operator's)."""
    data = {"username": login.user.encode(), "password": login.password.encode()}
    if operator.tls and operator.ca_cert:
        data["ca.crt"] = operator.ca_cert
    if job_client is not None:
        if job_client.cert.strip() == (operator.client_cert or b"").strip() \
                or job_client.key.strip() == (operator.client_key or b"").strip():
            raise ValueError("job-tls.crt/job-tls.key: the jobs' client certificate is the operator's own; "
                             "issue jobs one of their own whose CN names no etcd user")
        if operator.tls:
            data["tls.crt"], data["tls.key"] = job_client.cert, job_client.key
    return data
