"""How ``stalwart drill`` logs in to a job's etcd: as the job itself, through :func:`stalwart.etcd.client.connect`.

The drill uses the login the job's pods use, never one of its own: the job's ``spec.rendezvous.secretRef`` when
it names one, else the job's own Secret (``<job>-stalwart``), where the operator keeps the job's etcd user
(``--job-etcd-users``) and the CA of its etcd. TLS is asked for by the job's ``tls``, by ``--etcd-tls``, by an
``https://`` endpoint, or by a ``ca.crt`` in the Secret; once asked, a Secret without ``ca.crt`` is an error
naming the key (:class:`~stalwart.etcd.client.CredentialsError`), never a plaintext connection.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stalwart.etcd.client import CredentialsError, EtcdCredentials

__all__ = ["drill_credentials", "wants_tls"]


def wants_tls(spec: Mapping[str, Any], endpoints: Sequence[str], secret: Mapping[str, bytes], *,
              force_tls: bool = False) -> bool:
    """Whether the drill must speak TLS to the job's etcd (any one reason suffices; none can turn it off)."""
    rendezvous = spec.get("rendezvous") or {}
    return bool(force_tls or rendezvous.get("tls") or "ca.crt" in secret
                or any(e.startswith("https://") for e in endpoints))


def drill_credentials(spec: Mapping[str, Any], endpoints: Sequence[str], secret_name: str,
                      secret: Mapping[str, bytes], *, force_tls: bool = False) -> EtcdCredentials:
    """The job's own etcd credentials from ``secret`` (the data of the Secret named ``secret_name``: the job's
    ``secretRef`` or its own Secret). Raises :class:`CredentialsError` naming the Secret and the key."""
    tls = wants_tls(spec, endpoints, secret, force_tls=force_tls)
    try:
        return EtcdCredentials.from_secret(secret, tls=tls)
    except CredentialsError as e:
        raise CredentialsError(f"Secret {secret_name}: {e}") from None
