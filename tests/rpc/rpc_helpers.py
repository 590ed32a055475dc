"""Functions the RPC tests call on their workers (registered by name; both sides import this module)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter
from typing import Any

from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Compare, Get, Put, Store
from stalwart.rpc import MembershipView, RpcAgent, StaticMembership, rpc_function
from stalwart.rpc.streams import StreamTransport
from stalwart.rref import RRefRuntime

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
        transport = StreamTransport(token)
        if wrap is not None:
            transport = wrap(i, transport)
        agents.append(RpcAgent(f"w{i}", i, transport=transport, **options))
    for a in agents:
        a.start()
    membership = StaticMembership(MembershipView.of(epoch, [a.member for a in agents]))
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


# -- worker processes (the multi-process tests) --------------------------------------------------------------

CONTROL = ("fork", "accept", "delete")


def _agent() -> RpcAgent:
    from stalwart.rpc import current_agent

    return current_agent()


def _send_retry() -> Any:
    from stalwart.rpc import RetryOptions

    return RetryOptions(max_retries=100, initial_delay=0.01, max_delay=0.2, deadline=60, attempt_timeout=2.0)


@rpc_function("p.make")
def p_make(key: str, owner: str) -> str:
    ref = RRefRuntime.of(_agent()).remote(owner, "t.value", (key,))
    HELD[key] = ref
    return ref.rref_id


@rpc_function("p.send")
def p_send(key: str, new_key: str, dst: str) -> str:
    return _agent().rpc_sync(dst, "t.hold", (new_key, HELD[key]), idempotent=True,  # type: ignore[no-any-return]
                             retry=_send_retry())


@rpc_function("p.drop")
def p_drop(key: str) -> None:
    HELD.pop(key).release()


@rpc_function("p.get")
def p_get(key: str) -> Any:
    return HELD[key].to_here(timeout=30)


@rpc_function("p.drop_all")
def p_drop_all() -> int:
    n = len(HELD)
    for ref in list(HELD.values()):
        ref.release()
    HELD.clear()
    return n


@rpc_function("p.state")
def p_state() -> dict[str, Any]:
    return _agent().debug_state()


@rpc_function("p.sees")
def p_sees(names: list[str]) -> bool:
    """Whether this worker's view holds every one of ``names`` (its etcd watch may lag the driver's)."""
    from stalwart.rpc import UnknownWorker

    try:
        for n in names:
            _agent().worker_info(n)
    except UnknownWorker:
        return False
    return True


@rpc_function("p.faults")
def p_faults(seed: int, spec: dict[str, dict[str, Any]]) -> None:
    """Replace the worker's faults: ``spec`` maps a message type to Faults fields (requests and replies)."""
    from stalwart.rpc.faults import Faults, FaultyTransport

    transport = _agent()._transport
    assert isinstance(transport, FaultyTransport)
    table = {k: Faults(**{**v, "delay_range": tuple(v.get("delay_range", (0.001, 0.05)))})
             for k, v in spec.items()}
    _agent()._reactor.call_soon(lambda: transport.configure(seed=seed, requests=table, replies=table))


def worker_main(who: tuple[str, int], endpoint: str, job: tuple[str, str], world_size: int, stop: Any) -> None:
    """A worker process: joins the job's RPC membership in etcd (lease TTL 2 s) with a fault-injecting
    transport, serves until ``stop`` is set, then shuts down."""
    import logging

    from stalwart.etcd.keys import JobKeys
    from stalwart.etcd.store import Store
    from stalwart.rpc import RetryOptions, init_rpc, shutdown
    from stalwart.rpc.faults import FaultyTransport

    logging.basicConfig(level=logging.WARNING)
    namespace, uid = job
    name, rank = who
    store = Store([endpoint], timeout=5.0)
    control = RetryOptions(max_retries=1000, initial_delay=0.01, max_delay=0.2, deadline=60, attempt_timeout=0.5)
    keys = JobKeys(namespace, uid)
    agent = init_rpc(name, rank, store=store, keys=keys, epoch=sealed(store, keys), world_size=world_size,
                     lease_ttl=2, transport=FaultyTransport(StreamTransport(TOKEN), seed=rank),
                     control_retry=control)
    RRefRuntime.of(agent).book.freed_log = []
    with contextlib.suppress(EOFError):
        stop.recv()  # the driver says stop, or its end of the pipe closes
    shutdown(graceful=True, timeout=20)
    store.close()


def sealed(store: Store, keys: JobKeys) -> int:
    """The epoch of the job's sealed round: its manifest's mod_revision, sealing one if none is (every process
    of a test that calls this gets the same). RPC workers register only in the round the manifest names."""
    manifest = keys.manifest
    res = store.txn([Compare(manifest, "create", "==", 0)], [Put(manifest, b"{}")], [Get(manifest)])
    if res.succeeded:
        return res.revision
    return res.responses[0][0].mod_revision
