"""Field types shared by the models that read the pod environment (the agent's and the rank process's)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, Field

__all__ = ["EtcdEndpoints", "JobRef"]


def _split(v: object) -> object:
    if isinstance(v, str):
        return [e.strip() for e in v.split(",") if e.strip()]
    return v


def _check_endpoints(v: list[str]) -> list[str]:
    for ep in v:
        host, sep, port = ep.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"expected comma-separated host:port, got {ep!r}")
    return v


def _check_job(v: str) -> str:
    ns, sep, name = v.partition("/")
    if not sep or not ns or not name:
        raise ValueError(f"expected <namespace>/<name>, got {v!r}")
    return v


#: ``STALWART_ETCD_ENDPOINTS``: comma-separated ``host:port``, at least one.
EtcdEndpoints = Annotated[list[str], BeforeValidator(_split), Field(min_length=1), AfterValidator(_check_endpoints)]
#: ``STALWART_JOB``: ``<namespace>/<name>``.
JobRef = Annotated[str, AfterValidator(_check_job)]
