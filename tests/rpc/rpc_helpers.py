"""Functions the RPC tests call on their workers (registered by name; both sides import this module)."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from typing import Any

from stalwart.agent.rpc import RpcAgent, StaticMembership, View, rpc_function
from stalwart.agent.rpc.transport import GrpcTransport

TOKEN = "test-token-0123456789abcdef"

CALLS: Counter[str] = Counter()
GATE = threading.Event()
HELD: dict[str, Any] = {}


@rpc_function("t.echo")
def echo(x: Any) -> Any:
    return x


@rpc_function("t.add")
def add(a: Any, b: Any) -> Any:
    return a + b


@rpc_function("t.fail")
def fail(message: str) -> None:
    raise KeyError(message)


@rpc_function("t.count")
def count(key: str) -> int:
    CALLS[key] += 1
    return CALLS[key]


@rpc_function("t.wait_gate")
def wait_gate(key: str) -> str:
    CALLS[key] += 1
    GATE.wait(60)
    return key


@rpc_function("t.sleep")
def sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@rpc_function("t.value")
def value(key: str) -> dict[str, Any]:
    return {"key": key, "pid": os.getpid()}


@rpc_function("t.hold")
def hold(key: str, rref: Any) -> str:
    HELD[key] = rref
    return rref.owner_name  # type: ignore[no-any-return]


def world(n: int, *, epoch: int = 1, token: str = TOKEN, wrap: Any = None,
          **options: Any) -> tuple[list[RpcAgent], StaticMembership]:
    """``n`` started agents ``w0..`` in one process, joined to one static membership."""
    agents = []
    for i in range(n):
        transport = GrpcTransport(token)
        if wrap is not None:
            transport = wrap(i, transport)
        agents.append(RpcAgent(f"w{i}", i, transport=transport, **options))
    for a in agents:
        a.start()
    membership = StaticMembership(View.of(epoch, [a.member for a in agents]))
    for a in agents:
        a.join(membership)
    return agents, membership


def shutdown_all(agents: list[RpcAgent], *, graceful: bool = True, timeout: float = 30.0) -> list[Any]:
    """Shut every agent down at once (graceful shutdown is a barrier among them)."""
    reports: list[Any] = [None] * len(agents)

    def one(i: int) -> None:
        reports[i] = agents[i].shutdown(graceful=graceful, timeout=timeout)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(agents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return reports


def wait_for(predicate: Any, timeout: float = 30.0, what: str = "condition") -> None:
    """Poll ``predicate`` until true; fail after a generous ``timeout`` (not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
