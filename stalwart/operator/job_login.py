"""One etcd user per job, on the operator's default etcd (``--job-etcd-users``).

For a job that uses the operator's etcd (no ``spec.rendezvous.endpoints``/``secretRef`` of its own), the
operator, logged in as an etcd administrator, makes the job a role limited to its key prefix and a user with a
random password (:mod:`stalwart.etcd.admin`), and writes the login (and the TLS material its agents need) into
the job's own Secret, which is owner-referenced and mounted into every pod as the etcd credentials. The user and
role are deleted with the job (the finalizer). A job's agents so read and write their own prefix and nothing
else.

The password lives in the Secret: when the Secret already exists (an operator restart), its password is kept
and the etcd user brought in line with it, so the running pods' login keeps working.
"""

from __future__ import annotations

from collections.abc import Mapping

from stalwart.etcd.admin import JobLogin, delete_job_login, ensure_job_login, new_password
from stalwart.etcd.client import EtcdCredentials
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store

__all__ = ["job_secret_data", "provision", "retire"]


def provision(store: Store, keys: JobKeys, existing: Mapping[str, bytes]) -> JobLogin:
    """Create or repair the job's etcd user, keeping the password of an ``existing`` Secret's data."""
    old = existing.get("password")
    password = old.decode() if old else new_password()
    return ensure_job_login(store, keys, password)


def retire(store: Store, keys: JobKeys) -> None:
    """Delete the job's etcd user and role (idempotent)."""
    delete_job_login(store, keys)


def job_secret_data(login: JobLogin, operator: EtcdCredentials) -> dict[str, bytes]:
    """The etcd credentials keys of the job's Secret: the job's login, and the CA and client certificate the
    operator itself uses when etcd requires TLS."""
    data = {"username": login.user.encode(), "password": login.password.encode()}
    if operator.tls:
        for key, value in (("ca.crt", operator.ca_cert), ("tls.crt", operator.client_cert),
                           ("tls.key", operator.client_key)):
            if value:
                data[key] = value
    return data
