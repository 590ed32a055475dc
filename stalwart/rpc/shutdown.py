"""The agent's shutdown: a graceful drain with a barrier among peers, then the teardown, and the report.

A graceful shutdown stops taking new calls, waits for our outgoing calls, lets the layers release what user
code still holds (reported as leaks) and waits for their messages to be acknowledged, then waits until every
live peer has said it is done too (``done``: a barrier, as torch's graceful shutdown) -- all within one time
limit. The teardown fails what is still pending with :class:`~.errors.RpcShutdown` and stops the transport
and the agent's tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from stalwart.rpc.calls import Caller
from stalwart.rpc.extension import RpcExtension
from stalwart.rpc.peers import Peers
from stalwart.rpc.reactor import Reactor
from stalwart.rpc.retry import RetryOptions
from stalwart.rpc.server import Server
from stalwart.rpc.transport import Transport


@dataclass
class ShutdownReport:
    """What :meth:`RpcAgent.shutdown` found. ``clean`` when nothing leaked and every step finished in time."""

    graceful: bool
    timed_out: list[str] = field(default_factory=list)  # the drain steps that ran out of time
    pending_calls: list[str] = field(default_factory=list)  # calls still pending when the agent stopped
    leaked_user_rrefs: list[str] = field(default_factory=list)  # handles user code still held
    leaked_owner_rrefs: dict[str, list[str]] = field(default_factory=dict)  # values still referenced
    parked_deletes: dict[str, list[str]] = field(default_factory=dict)
    pending_children: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.timed_out or self.pending_calls or self.leaked_user_rrefs or self.leaked_owner_rrefs
                    or self.parked_deletes or self.pending_children)


@dataclass(frozen=True, slots=True)
class AgentParts:
    """The parts of one agent that its shutdown drives."""

    reactor: Reactor
    caller: Caller
    server: Server
    peers: Peers
    transport: Transport
    extensions: Sequence[RpcExtension]
    control_retry: RetryOptions


def _flush(parts: AgentParts) -> None:
    for ext in parts.extensions:
        ext.flush()


async def drain(parts: AgentParts, limit: float, report: ShutdownReport) -> None:
    """The graceful part, within ``limit`` seconds; what ran out of time goes to ``report.timed_out``."""
    reactor, caller, server = parts.reactor, parts.caller, parts.server
    deadline = reactor.time() + limit
    step = limit / 3

    def flush() -> None:
        _flush(parts)

    def user_calls_done() -> bool:
        return not any(c.user for c in caller.pending.values())

    if not await reactor.wait_until(user_calls_done, reactor.time() + step, flush):
        report.timed_out.append("outgoing calls")
    flush()
    for ext in parts.extensions:
        ext.release_all(report)
    if not await reactor.wait_until(lambda: not caller.pending, reactor.time() + step, flush):
        report.timed_out.append("RRef control messages")
    peers = parts.peers.live_peers()
    for w in peers:
        caller.control(w, "done", "", "", retry=parts.control_retry, on_done=lambda _exc: None)
    dead = parts.peers.dead

    def everyone_done() -> bool:
        return (all(w.name in server.done_from or w.name in dead for w in peers)
                and not caller.pending and server.incoming <= 0)

    if not await reactor.wait_until(everyone_done, deadline, flush):
        missing = sorted(w.name for w in peers if w.name not in server.done_from and w.name not in dead)
        report.timed_out.append(f"shutdown barrier (waiting for {missing or 'in-flight requests'})")


async def teardown(parts: AgentParts, name: str, report: ShutdownReport, grace: float) -> None:
    """Fail what is pending, close the layers, stop the transport and every task of the agent."""
    reactor = parts.reactor
    for ext in parts.extensions:
        ext.report(report)
    report.pending_calls = parts.caller.stop(name)
    reactor.disarm()
    for ext in parts.extensions:
        ext.close()
    await parts.transport.stop(grace)
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and t not in reactor.tasks]
    if others:  # stream tasks of the transport wind down after the server stopped
        await asyncio.wait(others, timeout=2.0)
    tasks = list(reactor.tasks)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    with contextlib.suppress(Exception):  # name lookups ran on the loop's default executor
        await asyncio.wait_for(reactor.loop.shutdown_default_executor(), 5.0)
