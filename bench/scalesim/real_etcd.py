"""What the real-etcd validation runs share: the job's own etcd login, worker processes spoken to by lines, and
the counters read from etcd and the machine around a timed run.

A validation run starts a few worker processes (``python -m bench.scalesim.real_barrier`` or
``real_rendezvous``), each of which hosts many ranks or nodes on one etcd connection, and speaks to them by
lines: a worker prints ``READY`` (or ``FAILED <why>``) when set up, waits for a word on its standard input,
and prints ``DONE <json>`` with what it measured. Every worker is ended when the run ends, however it ends.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from stalwart.etcd.admin import delete_job_login, ensure_job_login, new_password
from stalwart.etcd.client import EtcdCredentials, connect
from stalwart.etcd.errors import StoreError
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store

ROOT = Path(__file__).resolve().parents[2]


class ValidationError(Exception):
    """A validation's etcd cannot be reached or refuses the client, or a worker failed; the message names the
    endpoint (or the worker) and why."""


@dataclass(frozen=True)
class Access:
    """How the workers reach etcd: the endpoint, and the directory of their credentials (as a mounted Secret
    holds them: ``ca.crt``, ``tls.crt``, ``tls.key``, ``username``, ``password``), ``None`` without TLS or login."""

    endpoint: str
    secret_dir: str | None
    tls: bool

    def args(self) -> list[str]:
        return ["--endpoint", self.endpoint, *(["--secret-dir", self.secret_dir] if self.secret_dir else []),
                *(["--tls"] if self.tls else [])]

    def connect(self) -> Store:
        creds = EtcdCredentials.from_dir(self.secret_dir, tls=self.tls) if self.secret_dir else None
        return connect([self.endpoint], creds, timeout=30)


def admin(endpoint: str, credentials: EtcdCredentials | None) -> Store:
    """The run's own client (as root where there is a login); an etcd it cannot reach or that refuses its TLS
    settings or login raises :class:`ValidationError` naming the endpoint and the cause."""
    try:
        store = connect([endpoint], credentials, timeout=30)
        store.revision()  # without a login connect() asks nothing: a closed port shows here
    except StoreError as e:
        raise ValidationError(f"validation: etcd at {endpoint}: {e}") from None
    return store


@contextmanager
def job_access(store: Store, endpoint: str, credentials: EtcdCredentials | None, keys: JobKeys) -> Iterator[Access]:
    """The job's own etcd user, limited to its prefix (as the operator makes one for each job), written out for
    the workers as a mounted Secret would be; without a login on ``store``, the root's TLS material alone. The
    user and the directory go with the block."""
    creds = credentials or EtcdCredentials()
    if not creds.user and not creds.tls:
        yield Access(endpoint, None, tls=False)
        return
    secret = Path(tempfile.mkdtemp(prefix="stalwart-validate-"))
    try:
        files = {"ca.crt": creds.ca_cert, "tls.crt": creds.client_cert, "tls.key": creds.client_key}
        if creds.user:
            login = ensure_job_login(store, keys, new_password())
            files.update({"username": login.user.encode(), "password": login.password.encode()})
        for name, data in files.items():
            if data:
                (secret / name).write_bytes(data)
        yield Access(endpoint, str(secret), tls=creds.tls)
    finally:
        shutil.rmtree(secret, ignore_errors=True)
        if creds.user:
            delete_job_login(store, keys)


def counters(metrics: Sequence[str]) -> dict[str, float]:
    """etcd's counts of committed raft proposals (the first member's: every member commits each) and of lease
    renewals (summed: only the leader renews) from the members' plain-HTTP ``/metrics``."""
    out = {"proposals": 0.0, "renewals": 0.0}
    for i, endpoint in enumerate(metrics):
        with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as resp:
            for line in resp.read().decode().splitlines():
                name = line.split(" ", 1)[0]
                if name == "etcd_server_proposals_committed_total" and i == 0:
                    out["proposals"] = float(line.split()[-1])
                elif name == "etcd_debugging_lease_renewed_total":
                    out["renewals"] += float(line.split()[-1])
    return out


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of every core of this machine so far (``/proc/stat``)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return float(sum(fields) - idle), float(sum(fields))


def busy_share(before: tuple[float, float], after: tuple[float, float]) -> float:
    """The share of the machine's cores busy between two :func:`machine_busy` readings."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else 0.0


class Worker:
    """One worker process: its lines, read by a thread of its own so that a wait for one has a deadline."""

    def __init__(self, name: str, argv: Sequence[str]) -> None:
        self.name = name
        self.proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.err: list[str] = []
        self._cond = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(self.proc.stdout, self.lines), daemon=True),
                         threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True)]
        for t in self._readers:
            t.start()

    def _read(self, stream: IO[str] | None, into: list[str]) -> None:
        assert stream is not None
        for line in stream:
            with self._cond:
                into.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def expect(self, word: str, deadline: float) -> str:
        """The rest of the first line that starts with ``word``; :class:`ValidationError` (with the worker's last
        words) when it prints ``FAILED``, ends, or says nothing of it by ``deadline`` (monotonic)."""
        with self._cond:
            while True:
                for i, line in enumerate(self.lines):
                    if line.startswith(word):
                        del self.lines[:i + 1]
                        return line[len(word):].strip()
                    if line.startswith("FAILED"):
                        raise ValidationError(f"validation: {self.name}: {line[6:].strip()}")
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not any(t.is_alive() for t in self._readers)):
                    why = "did not answer in time" if left <= 0 else f"ended ({self.proc.returncode})"
                    raise ValidationError(f"validation: {self.name} {why} waiting for {word}: "
                                          f"{' | '.join(self.err[-5:])[-600:]}")
                self._cond.wait(min(left, 0.5))

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it ended: expect() says why

    def end(self, grace: float = 20.0) -> None:
        """Ask it to stop, wait up to ``grace`` seconds, then kill it: it has ended when this returns."""
        if self.proc.poll() is None:
            self.send("STOP")
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for t in self._readers:
            t.join(5)


@contextmanager
def workers(specs: Sequence[tuple[str, Sequence[str]]]) -> Iterator[list[Worker]]:
    """Start a worker per (name, argv); every one has ended when the block is left."""
    started: list[Worker] = []
    try:
        for name, argv in specs:
            started.append(Worker(name, argv))
        yield started
    finally:
        for w in started:
            w.end()


# -- the worker's side --------------------------------------------------------------------------------------


def say(word: str, payload: dict[str, Any] | str | None = None) -> None:
    """One line to the run (a worker's stdout)."""
    text = "" if payload is None else payload if isinstance(payload, str) else json.dumps(payload)
    print(f"{word} {text}".rstrip(), flush=True)


def cpu_seconds() -> float:
    """This process's CPU seconds so far, user and system."""
    t = os.times()
    return t.user + t.system


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments every validation worker takes: its etcd, its job, and its share [lo, hi) of the run."""
    p.add_argument("--endpoint", required=True)
    p.add_argument("--secret-dir")
    p.add_argument("--tls", action="store_true")
    p.add_argument("--namespace", required=True)
    p.add_argument("--uid", required=True)
    p.add_argument("--lo", type=int, required=True)
    p.add_argument("--hi", type=int, required=True)
