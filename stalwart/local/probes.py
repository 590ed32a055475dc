"""Readiness and liveness probes (exec, tcpSocket, httpGet) of a running container."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stalwart.local.pods import ContainerRun, PodRun
from stalwart.local.processes import child_setup

log = logging.getLogger(__name__)
JSON = dict[str, Any]


async def probe_loop(run: PodRun, c: ContainerRun, kind: str, env: dict[str, str], cwd: Path, *,
                     active: Callable[[], bool], on_ready_change: Callable[[], None],
                     on_liveness_failure: Callable[[], None]) -> None:
    """Probe while the container runs. Readiness sets ``c.ready`` (``on_ready_change`` reports it); a liveness
    failure past the threshold calls ``on_liveness_failure`` once and ends the loop. Nothing is probed while
    ``active()`` is false (the node's kubelet is cut off)."""
    spec = c.spec[kind]
    period = float(spec.get("periodSeconds", 10))
    failures_allowed = int(spec.get("failureThreshold", 3))
    successes_needed = int(spec.get("successThreshold", 1))
    await asyncio.sleep(float(spec.get("initialDelaySeconds", 0)))
    fails = oks = 0
    while c.proc is not None and c.proc.returncode is None:
        if not active():
            await asyncio.sleep(period)
            continue
        ok = await probe_once(run, c, spec, env, cwd)
        fails, oks = (0, oks + 1) if ok else (fails + 1, 0)
        if kind == "readinessProbe":
            ready = c.ready
            if ok and oks >= successes_needed:
                ready = True
            elif not ok and fails >= failures_allowed:
                ready = False
            if ready != c.ready:
                c.ready = ready
                on_ready_change()
        elif fails >= failures_allowed:
            on_liveness_failure()
            return
        await asyncio.sleep(period)


async def probe_once(run: PodRun, c: ContainerRun, spec: JSON, env: dict[str, str], cwd: Path) -> bool:
    timeout = float(spec.get("timeoutSeconds", 1))

    def port_of(value: Any) -> int:
        if isinstance(value, int):
            return value
        for p in c.spec.get("ports") or []:
            if p.get("name") == value:
                return int(p["containerPort"])
        return int(value)

    try:
        if "exec" in spec:
            proc = await asyncio.create_subprocess_exec(
                *[str(a) for a in spec["exec"].get("command") or []], env=env, cwd=str(cwd),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
                preexec_fn=child_setup(run.enter))
            try:
                return await asyncio.wait_for(proc.wait(), timeout) == 0
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
                return False
        if "tcpSocket" in spec:
            host = spec["tcpSocket"].get("host") or run.ip
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port_of(spec["tcpSocket"].get("port"))), timeout)
            writer.close()
            return True
        if "httpGet" in spec:
            import aiohttp

            http = spec["httpGet"]
            url = (f"{str(http.get('scheme', 'HTTP')).lower()}://{http.get('host') or run.ip}:"
                   f"{port_of(http.get('port'))}{http.get('path', '/')}")
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session, \
                    session.get(url, headers={h["name"]: h["value"] for h in http.get("httpHeaders") or []}) \
                    as resp:
                return 200 <= resp.status < 400
    except (OSError, TimeoutError, ValueError):
        return False
    except Exception as exc:  # an aiohttp client error is a failed probe, like any other
        log.debug("probe of %s/%s %s failed: %r", run.namespace, run.name, c.name, exc)
        return False
    return False
