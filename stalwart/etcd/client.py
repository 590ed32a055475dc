"""How every etcd client of stalwart finds and logs in to etcd: one model, from one place in the pod contract.

The pod contract (design.md, "What a worker pod gets"): ``STALWART_ETCD_ENDPOINTS`` names the servers; when the
job names an etcd credentials Secret, the operator mounts it at ``STALWART_ETCD_SECRET_DIR`` and sets
``STALWART_ETCD_TLS``. The Secret's keys are those of a Kubernetes TLS Secret plus a login:

* ``ca.crt`` -- the CA that signed etcd's server certificate (required with TLS);
* ``tls.crt`` / ``tls.key`` -- this client's certificate and key (together, or neither);
* ``username`` / ``password`` -- an etcd user (together, or neither).

Secrets stay in files: the agent hands its rank processes the directory, never the values, so nothing secret
shows in ``kubectl describe`` or a process's environment. :func:`connect` opens a :class:`Store` and proves
the settings at once (a login, or a status call), so a wrong CA, a missing login or a wrong password fail on
start with an error naming the cause, before anything is written.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from stalwart.api.pod_env import ETCD_SECRET_DIR, EtcdSecretMount
from stalwart.etcd.admin import ROOT_USER
from stalwart.etcd.admin import enable_auth as turn_on_auth
from stalwart.etcd.store import DEFAULT_TIMEOUT, Store, StorePermissionDenied, StoreSecurityError

log = logging.getLogger(__name__)

__all__ = ["CredentialsError", "EtcdCredentials", "connect"]

SECRET_KEYS = ("ca.crt", "tls.crt", "tls.key", "username", "password")


class CredentialsError(ValueError):
    """The etcd credentials are incomplete; the message names the Secret key or variable."""


@dataclass(frozen=True, slots=True)
class EtcdCredentials:
    """TLS material and/or a login for etcd; empty means plaintext and no login. Secrets stay out of ``repr``."""

    tls: bool = False
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_cert: bytes | None = field(default=None, repr=False)
    client_cert: bytes | None = field(default=None, repr=False)
    client_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.tls and not self.ca_cert:
            raise CredentialsError("ca.crt: required with TLS (the CA that signed etcd's server certificate)")
        if not self.tls and (self.ca_cert or self.client_cert or self.client_key):
            raise CredentialsError("tls: certificates were given but TLS is off")
        if bool(self.client_cert) != bool(self.client_key):
            raise CredentialsError("tls.crt/tls.key: a client certificate needs its key, and the key its "
                                   "certificate")
        if bool(self.user) != bool(self.password):
            raise CredentialsError("username/password: a login needs both")

    @classmethod
    def from_secret(cls, data: Mapping[str, bytes], *, tls: bool) -> EtcdCredentials:
        """From a Secret's data (keys as in the module docstring); certificates are ignored without ``tls``."""
        def text(key: str) -> str | None:
            value = data.get(key)
            if value is None:
                return None
            try:
                return value.decode().strip() or None
            except UnicodeDecodeError:
                raise CredentialsError(f"{key}: must be UTF-8 text") from None

        return cls(tls=tls, user=text("username"), password=text("password"),
                   ca_cert=data.get("ca.crt") if tls else None,
                   client_cert=data.get("tls.crt") if tls else None,
                   client_key=data.get("tls.key") if tls else None)

    @classmethod
    def from_dir(cls, directory: str | Path, *, tls: bool) -> EtcdCredentials:
        """From a mounted Secret: one file per key."""
        root = Path(directory)
        if not root.is_dir():
            raise CredentialsError(f"{ETCD_SECRET_DIR}: {str(root)!r} is not a directory (the mounted etcd "
                                   "credentials Secret)")
        return cls.from_secret({k: (root / k).read_bytes() for k in SECRET_KEYS if (root / k).is_file()}, tls=tls)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EtcdCredentials:
        """From the pod contract (:class:`~stalwart.api.pod_env.EtcdSecretMount`: ``STALWART_ETCD_SECRET_DIR`` and
        ``STALWART_ETCD_TLS``; none set means none). A malformed variable raises
        :class:`~stalwart.api.pod_env.PodEnvError`, incomplete credentials :class:`CredentialsError`."""
        access = EtcdSecretMount.from_env(environ)
        if access.secret_dir is None:
            return cls()
        return cls.from_dir(access.secret_dir, tls=access.tls)

    def to_env(self, directory: str | Path) -> dict[str, str]:
        """The variables that make :meth:`from_env` read these credentials back from ``directory``."""
        return EtcdSecretMount(tls=self.tls, secret_dir=str(directory)).to_env()

    def with_login(self, user: str, password: str) -> EtcdCredentials:
        return EtcdCredentials(self.tls, user, password, self.ca_cert, self.client_cert, self.client_key)


def connect(endpoints: Sequence[str], credentials: EtcdCredentials | None = None, *,
            timeout: float = DEFAULT_TIMEOUT, probe: str | None = None, enable_auth: bool = False) -> Store:
    """A :class:`Store` for ``endpoints`` with ``credentials``, checked before it is returned: the login (when
    there is one), then a read of the keys under ``probe`` (a job's prefix: proves the user may read it), else
    a status call. Raises :class:`~stalwart.etcd.store.StoreSecurityError` naming the cause (TLS, no login, wrong
    login, no permission) or ``StoreUnavailable``; nothing has been written then.

    With ``enable_auth`` and the ``root`` login, an etcd whose authentication is still off gets it turned on
    first (the root user created with the given password): how the operator secures the chart's etcd."""
    creds = credentials or EtcdCredentials()
    try:
        store = Store(endpoints, timeout=timeout, user=creds.user, password=creds.password,
                      ca_cert=creds.ca_cert, client_cert=creds.client_cert, client_key=creds.client_key)
    except StoreSecurityError as e:
        if not (enable_auth and creds.user == ROOT_USER and "authentication is not enabled" in str(e)):
            raise
        with Store(endpoints, timeout=timeout, ca_cert=creds.ca_cert, client_cert=creds.client_cert,
                   client_key=creds.client_key) as bare:
            turn_on_auth(bare, creds.password or "")
        log.warning("etcd authentication was off at %s; turned it on with the root user", ",".join(endpoints))
        store = Store(endpoints, timeout=timeout, user=creds.user, password=creds.password,
                      ca_cert=creds.ca_cert, client_cert=creds.client_cert, client_key=creds.client_key)
    try:
        if probe is not None:
            store.count_prefix(probe)
        elif creds.user is None and creds.tls:
            store.status()
    except StorePermissionDenied as e:
        store.close()
        if creds.user is None:  # etcd took the client certificate's name for a user it does not know
            raise StoreSecurityError(f"{e}; no username/password was given: etcd has authentication on and "
                                     "needs a login (username and password in the etcd credentials "
                                     "Secret)") from e
        raise
    except BaseException:
        store.close()
        raise
    return store
