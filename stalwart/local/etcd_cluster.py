"""Several etcd members on loopback in one raft group: the shape of the chart's ``etcd.replicas: 3``.

Each member is an :class:`~stalwart.local.etcd.EtcdServer` with its own ports and data directory; with TLS they
share one CA (one set of certificates, written once and copied), so that one client certificate reaches every
member; with authentication, the root user is created once, through the group. For benchmarks and tests that
need what users run (raft replication, fsync on by default), not for the local cluster, whose etcd is one
member.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from stalwart.local.etcd import EtcdServer

if TYPE_CHECKING:
    from stalwart.etcd.client import EtcdCredentials


class EtcdCluster:
    def __init__(self, members: int = 3, *, host: str = "127.0.0.1", tls: bool = False, auth: bool = False,
                 fsync: bool = True) -> None:
        if members < 1:
            raise ValueError(f"members: expected at least 1, got {members}")
        self.dir = Path(tempfile.mkdtemp(prefix="stalwart-etcd-cluster-"))
        self.members = [EtcdServer(self.dir / f"member-{i}", host=host, tls=tls, auth=auth, fsync=fsync,
                                   name=f"member-{i}") for i in range(members)]
        group = ",".join(f"{m.name}=http://{host}:{m.peer_port}" for m in self.members)
        for m in self.members:
            m.initial_cluster = group
            m.root_password = self.members[0].root_password  # one root user for the group
        self.tls, self.auth = tls, auth

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def credentials(self) -> EtcdCredentials:
        """The root login (with authentication) and the client certificate (with TLS) every member accepts."""
        return self.members[0].credentials()

    def start(self, timeout: float = 60.0) -> None:
        """Start every member, then wait until each serves (which it does once the group has a leader); raises
        ``TimeoutError`` naming the member that did not (and its log) after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        if self.tls:
            from stalwart.local.etcd_pki import LocalCA

            first = self.members[0]
            LocalCA().write(first.pki_dir, hosts=(first.host, "localhost"))
            for m in self.members[1:]:
                shutil.copytree(first.pki_dir, m.pki_dir)
        try:
            for m in self.members:
                m.launch()
            # A member serves its clients only once it has joined the group through raft: all serving, the group
            # has a leader.
            for m in self.members:
                m.wait_ready(max(0.1, deadline - time.monotonic()))
            if self.auth:
                from stalwart.etcd.admin import enable_auth
                from stalwart.etcd.client import connect

                anon = self.members[0].credentials(user="", password="")
                with connect(self.endpoints, anon, timeout=max(1.0, deadline - time.monotonic())) as store:
                    enable_auth(store, self.members[0].root_password or "")
                for m in self.members:
                    m._auth_on = True  # on for the group: a member restarted alone must not enable it again
        except BaseException:
            self.cleanup()
            raise

    def cleanup(self) -> None:
        """Stop every member (each within its grace, then killed) and remove the group's directory."""
        for m in self.members:
            m.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
