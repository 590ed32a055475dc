"""``kubectl logs`` for the process kubelet: a container's log file, its previous instance's, or a follow that
streams until the container stops."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

from stalwart.local.apiserver.objects import ApiError
from stalwart.local.pods import PodRun


def pod_dir(workdir: Path, namespace: str, name: str, uid: str) -> Path:
    """Where a pod's working directory and container logs live."""
    return workdir / "pods" / f"{namespace}_{name}_{uid}"


async def stream_logs(path: Path, runs: Mapping[tuple[str, str], PodRun], key: tuple[str, str], uid: str,
                      container: str | None, *, follow: bool, tail_lines: int | None, previous: bool,
                      limit_bytes: int | None) -> AsyncIterator[bytes]:
    """The log at ``path``; ``follow`` keeps reading while the pod ``key`` (of ``uid``) runs the container."""
    if not await asyncio.to_thread(path.exists):
        if previous:
            raise ApiError(400, "BadRequest", f'previous terminated container "{container}" in pod "{key[1]}" '
                                              "not found")
        return
    sent = 0
    f = await asyncio.to_thread(open, path, "rb")
    try:
        data = await asyncio.to_thread(f.read)
        if tail_lines is not None:
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[-tail_lines:]) if tail_lines > 0 else b""
        if limit_bytes is not None:
            data = data[:limit_bytes]
        sent += len(data)
        if data:
            yield data
        if not follow or previous:
            return
        while True:
            chunk = await asyncio.to_thread(f.read, 65536)
            if chunk:
                if limit_bytes is not None:
                    chunk = chunk[: max(limit_bytes - sent, 0)]
                sent += len(chunk)
                yield chunk
                continue
            run = runs.get(key)
            c = None if run is None or run.uid != uid or run.stopped.is_set() else next(
                (x for x in run.all_containers() if x.name == container), None)
            if c is None or c.done:
                tail = await asyncio.to_thread(f.read)
                if tail:
                    yield tail
                return
            await asyncio.sleep(0.2)
    finally:
        f.close()
