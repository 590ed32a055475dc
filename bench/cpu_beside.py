"""Who used this machine's CPU while a recovery ran: every process's CPU time sampled, grouped by the pod it
belongs to (its ``STALWART_NODE_ID``) or by what it is, and the CPU-seconds each group used in a window.

On a 2-core machine every process of the local cluster shares the cores the training ranks step on, so a
process that starts during a recovery (a replacement pod importing torch) costs the ranks' first step directly;
on a real cluster it runs on another node. :func:`used` says how much CPU each group took in a window, so that
a benchmark can print it beside the phase it slowed. What it misses: a process born and ended between two
samples (its CPU is not seen), and CPU a process spends after the last sample before the window's end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuSampler", "Sample", "group_of", "used"]

#: Clock ticks per second of /proc/<pid>/stat's times (USER_HZ: 100 on every Linux this runs on).
TICKS = 100

#: A process: its pid and its start time in ticks since boot (a pid reused later is another process).
Proc = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Sample:
    """At wall time ``at``, the CPU-seconds (user and system) each process had used since it started."""

    at: float
    cpu: Mapping[Proc, float]


def group_of(environ: bytes, cmdline: bytes) -> str:
    """The group a process belongs to: ``pod <name>`` for a pod's process (the agent's, its ranks', the fork
    server's), else what its command line says it is."""
    for entry in environ.split(b"\0"):
        if entry.startswith(b"STALWART_NODE_ID="):
            return "pod " + entry.split(b"=", 1)[1].decode(errors="replace")
    text = cmdline.replace(b"\0", b" ")
    for needle, name in ((b"stalwart.local.controlplane", "control plane"), (b"etcdbin/etcd", "etcd"),
                         (b"stalwart operator", "operator"), (b"stalwart.local", "local cluster"),
                         (b"kubectl", "kubectl")):
        if needle in text:
            return name
    return "other"


def used(samples: Sequence[Sample], groups: Mapping[Proc, str], start: float, end: float) -> dict[str, float]:
    """CPU-seconds each group used between ``start`` and ``end``: each process's CPU at the last sample at or
    before ``end`` less its CPU at the last sample at or before ``start`` (nothing, for one first seen since).
    Raises ValueError when no sample was taken at or before ``start``, or ``end`` is before ``start``."""
    if end < start:
        raise ValueError(f"end: expected a time at or after start {start}, got {end}")
    before = [s for s in samples if s.at <= start]
    after = [s for s in samples if s.at <= end]
    if not before:
        raise ValueError(f"start: no sample at or before {start} (the first at "
                         f"{samples[0].at if samples else 'none'})")
    first, last = before[-1], after[-1]
    out: dict[str, float] = {}
    for proc, cpu in last.cpu.items():
        spent = cpu - first.cpu.get(proc, 0.0)
        if spent > 0:
            group = groups.get(proc, "other")
            out[group] = out.get(group, 0.0) + spent
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _procs() -> Iterator[tuple[Proc, float, Path]]:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After the command's closing parenthesis: state is field 0, utime 11, stime 12, starttime 19.
        yield (int(entry.name), int(fields[19])), (int(fields[11]) + int(fields[12])) / TICKS, entry


class CpuSampler:
    """Samples every process's CPU every ``interval`` seconds on a thread of its own, between ``with``'s entry
    and exit (the thread is joined on exit)."""

    def __init__(self, interval: float = 0.2) -> None:
        if interval <= 0:
            raise ValueError(f"interval: expected seconds > 0, got {interval}")
        self.interval = interval
        self.samples: list[Sample] = []
        self.groups: dict[Proc, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.interval + 5)
        self.sample()

    def sample(self) -> None:
        cpu: dict[Proc, float] = {}
        for proc, seconds, entry in _procs():
            cpu[proc] = seconds
            if proc not in self.groups:
                try:
                    self.groups[proc] = group_of((entry / "environ").read_bytes(), (entry / "cmdline").read_bytes())
                except OSError:
                    self.groups[proc] = "other"
        self.samples.append(Sample(time.time(), cpu))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()
