"""The process kubelet's book of container processes: one JSON line for each start and each end of a container's
main process, in ``<cluster dir>/containers.jsonl``.

Why a book beside the pod's status: the status's ``finishedAt`` has whole seconds and only the latest instance
of each container, while a check that a process was gone within seconds of deciding to exit needs the end to a
fraction of a second, for every instance, after the pod itself is gone. Each line carries ``event``
(``started``, ``ended`` or ``leftovers``), ``time`` (wall-clock seconds when the kubelet saw it: the end is
when its wait on the process returned), ``namespace``, ``pod``, ``uid``, ``container`` and ``pid``; ``started``
adds ``log`` (the instance's log file while it is the container's latest) and ``argv`` (the first words of
its command line), ``ended`` adds ``exitCode`` (negative:
the signal), ``leftovers`` adds ``pids``: the container's processes still alive after its main process ended,
which the kubelet then killed (a container's processes end with its PID 1).

The kubelet is the only writer (one process, lines appended whole); :func:`read_book` reads what was added since
an offset. :mod:`.exitcheck` judges from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import weakref
from pathlib import Path
from typing import Any

from stalwart.local.pods import PodRun

BOOK = "containers.jsonl"
JSON = dict[str, Any]

__all__ = ["BOOK", "ContainerBook", "read_book"]


class ContainerBook:
    """Writes the book at ``path`` (``None``: writes nothing). An end is written once per process, by whichever
    of the kubelet's steps sees it first (the container's own wait, or a stop or kill of the pod)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._ended: weakref.WeakSet[asyncio.subprocess.Process] = weakref.WeakSet()

    def started(self, run: PodRun, container: str, pid: int, log: Path, argv: list[str]) -> None:
        self._write(run, container, pid, "started", log=str(log), argv=argv[:4])

    def ended(self, run: PodRun, container: str, proc: asyncio.subprocess.Process) -> None:
        """``proc`` has ended (its ``returncode`` is set); noted now unless it was already."""
        if proc in self._ended or proc.returncode is None:
            return
        self._ended.add(proc)
        self._write(run, container, proc.pid, "ended", exitCode=proc.returncode)

    def leftovers(self, run: PodRun, container: str, pid: int, pids: list[int]) -> None:
        if pids:
            self._write(run, container, pid, "leftovers", pids=sorted(pids))

    def _write(self, run: PodRun, container: str, pid: int, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        record = {"event": event, "time": round(time.time(), 3), "namespace": run.namespace, "pod": run.name,
                  "uid": run.uid, "container": container, "pid": pid, **fields}
        with contextlib.suppress(OSError), open(self.path, "a") as f:  # one short line, from the loop
            f.write(json.dumps(record) + "\n")


def read_book(path: Path, offset: int = 0) -> tuple[list[JSON], int]:
    """The records written to the book at ``path`` from byte ``offset`` on (whole lines only), and the offset
    after them; ``([], offset)`` when there is no book (yet, or any more)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1
    records: list[JSON] = []
    for line in data[:end].splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if isinstance(rec, dict):
                records.append(rec)
    return records, offset + end
