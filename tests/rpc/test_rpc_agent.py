"""Real agents over real gRPC streams on loopback, several in one process."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import hmac
import os
import pickle
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from rpc_helpers import CALLS, GATE, HELD, TOKEN, shutdown_all, wait_for, world

from stalwart.rpc import (
    EpochAhead,
    MembershipView,
    NotOwner,
    OwnerDied,
    PayloadError,
    RemoteError,
    RetryOptions,
    RpcAgent,
    RpcTimeout,
    RRefCreationFailed,
    RRefDeleted,
    StaleEpoch,
    StaticMembership,
    UnknownFunction,
    UnknownWorker,
    Worker,
    WorkerDied,
)
from stalwart.rpc.faults import Faults, FaultyTransport
from stalwart.rpc.streams import ACCEPTED, MAGIC, REFUSED, callee_proof, caller_proof
from stalwart.rpc.transport import Transport
from stalwart.rref import RRefRuntime


@pytest.fixture
def three() -> Iterator[tuple[list[RpcAgent], StaticMembership]]:
    agents, membership = world(3)
    yield agents, membership
    GATE.set()
    HELD.clear()
    shutdown_all(agents, graceful=False)
    GATE.clear()


def test_calls_carry_json_bytes_and_tensors(three: Any) -> None:
    (a, _b, _c), _ = three
    value = {"a": [1, 2.5, (3, "x")], 7: None, "$odd": b"\x00raw"}
    assert a.rpc_sync("w1", "t.echo", (value,)) == value
    out = a.rpc_sync(1, "t.add", (torch.ones(2, 3), torch.arange(3.0)))
    assert torch.equal(out, torch.ones(2, 3) + torch.arange(3.0))
    futures = [a.rpc_async("w2", "t.add", (i, 1)) for i in range(50)]
    assert [f.wait() for f in futures] == [i + 1 for i in range(50)]
    assert a.rpc_sync("w0", "t.echo", ("self",)) == "self"  # a call to oneself goes through the server too


def test_errors_are_typed(three: Any) -> None:
    (a, _b, _c), _ = three
    with pytest.raises(RemoteError) as e:
        a.rpc_sync("w1", "t.fail", ("nope",))
    assert e.value.type == "KeyError" and "nope" in e.value.remote_message and "fail" in e.value.remote_traceback
    with pytest.raises(UnknownFunction, match=r"no\.such"):
        a.rpc_sync("w1", "no.such.function")
    with pytest.raises(UnknownFunction, match="not registered"):
        a.rpc_sync("w1", lambda: None)
    with pytest.raises(UnknownWorker, match="w9"):
        a.rpc_sync("w9", "t.echo", (1,))
    with pytest.raises(PayloadError, match=r"args.*object"):
        a.rpc_sync("w1", "t.echo", (object(),))
    with pytest.raises(ValueError, match="retry"):
        a.rpc_async("w1", "t.echo", (1,), retry=RetryOptions())
    with pytest.raises(ValueError, match="timeout"):
        a.rpc_async("w1", "t.echo", (1,), timeout=0)


def _record_kinds(data: bytes) -> set[int]:
    """The kinds of the length-prefixed records in ``data`` (the top two bits of each prefix)."""
    kinds, at = set(), 0
    while at < len(data):
        word = int.from_bytes(data[at:at + 4], "big")
        kinds.add(word >> 30)
        at += 4 + (word & ((1 << 30) - 1))
    assert at == len(data)
    return kinds


def test_unauthenticated_peer_gets_nothing_and_nothing_is_unpickled_streams(tmp_path: Path) -> None:
    agents, _ = world(1)
    server = agents[0]
    intruder = RpcAgent("x0", 5, token="wrong-token-0123456789")
    try:
        intruder.start()
        intruder.join(StaticMembership(MembershipView.of(1, [intruder.member, server.member])))
        before = CALLS["intruder"]
        with pytest.raises((RpcTimeout, WorkerDied, Exception)) as e:
            intruder.rpc_sync("w0", "t.count", ("intruder",), timeout=5)
        assert not isinstance(e.value, AssertionError)
        assert CALLS["intruder"] == before  # the function never ran

        marker = tmp_path / "pwned"

        class Evil:
            def __reduce__(self) -> Any:
                return (os.system, (f"touch {marker}",))

        evil = pickle.dumps(Evil())
        host, _, port = server.address.rpartition(":")

        async def raw(first: bytes, then: bytes) -> bytes:
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                writer.write(first + then)
                await writer.drain()
                return await asyncio.wait_for(reader.read(), 30)  # everything until the server closes
            finally:
                writer.close()

        async def handshake(token: str, then: bytes, replay: bytes | None = None,
                            raw_token_proof: bool = False) -> tuple[bool, bytes, bytes]:
            """A caller by hand: (the callee's proof was right, the proof we sent, all we got after it)."""
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                nonce = os.urandom(16)
                writer.write(MAGIC + nonce)
                challenge = await asyncio.wait_for(reader.readexactly(48), 30)
                callee_ok = challenge[16:] == callee_proof(TOKEN, nonce, challenge[:16])
                ours = replay if replay is not None else caller_proof(token, nonce, challenge[:16])
                if raw_token_proof:  # keyed with the token itself, as before one key per purpose
                    ours = hmac.new(token.encode(), b"caller" + challenge[:16] + nonce, hashlib.sha256).digest()
                writer.write(ours + then)
                await writer.drain()
                answer = await asyncio.wait_for(reader.readexactly(1), 30)
                writer.write_eof()
                return callee_ok, ours, answer + await asyncio.wait_for(reader.read(), 30)
            finally:
                writer.close()

        framed_evil = len(evil).to_bytes(4, "big") + evil
        # a pickle where the hello goes: one refusal byte, then the connection closes
        assert asyncio.run(raw(evil[:24].ljust(24, b"\0"), framed_evil)) == REFUSED
        # a wrong token: the callee proves it holds the job's token, the caller cannot; refused, nothing parsed
        callee_ok, _, answer = asyncio.run(handshake("wrong-token-0123456789", framed_evil))
        assert callee_ok and answer == REFUSED
        # the right token used as the key itself (not the RPC key derived from it): refused
        callee_ok, _, answer = asyncio.run(handshake(TOKEN, framed_evil, raw_token_proof=True))
        assert callee_ok and answer == REFUSED
        # even with the right token, a pickle is only a malformed frame: dropped, never loaded, no reply
        callee_ok, recorded, answer = asyncio.run(handshake(TOKEN, framed_evil))
        assert callee_ok and answer[:1] == ACCEPTED
        assert _record_kinds(answer[1:]) <= {2}  # at most the server's arena offer: transport records, no reply
        # a recorded proof is worth nothing on another connection (fresh nonces)
        assert asyncio.run(handshake(TOKEN, b"", replay=recorded))[2] == REFUSED
        assert not marker.exists()
        assert server.rpc_sync("w0", "t.echo", ("still fine",)) == "still fine"
    finally:
        intruder.shutdown(graceful=False)
        shutdown_all(agents, graceful=False)


def test_messages_from_another_epoch_are_rejected() -> None:
    old = RpcAgent("w0", 0, token=TOKEN)
    new = RpcAgent("w1", 1, token=TOKEN)
    try:
        old.start()
        new.start()
        old.join(StaticMembership(MembershipView.of(1, [old.member, new.member])))
        new.join(StaticMembership(MembershipView.of(2, [old.member, new.member])))
        with pytest.raises(StaleEpoch):
            old.rpc_sync("w1", "t.echo", (1,))  # a zombie of round 1 cannot act in round 2
        with pytest.raises(EpochAhead):
            new.rpc_sync("w0", "t.echo", (1,))  # not retried: the call was not marked idempotent
    finally:
        shutdown_all([old, new], graceful=False)


def test_timeout_then_the_late_reply_is_dropped(three: Any) -> None:
    (a, _b, _c), _ = three
    with pytest.raises(RpcTimeout, match="timed out"):
        a.rpc_sync("w1", "t.wait_gate", ("late",), timeout=0.3)
    GATE.set()  # now the function returns and its reply arrives after its call is gone
    wait_for(lambda: not a.debug_state()["pending"], what="no pending call")
    assert a.rpc_sync("w1", "t.echo", ("after",)) == "after"


def test_idempotent_calls_run_exactly_once_through_drops_and_duplicates() -> None:
    faulty: list[FaultyTransport] = []

    def wrap(i: int, inner: Transport) -> FaultyTransport:
        bad = Faults(drop=0.25, duplicate=0.3, reorder=0.2, delay=0.3, delay_range=(0.0, 0.05))
        t = FaultyTransport(inner, seed=100 + i, requests={"call": bad}, replies={"call": bad})
        faulty.append(t)
        return t

    agents, _ = world(2, wrap=wrap)
    try:
        retry = RetryOptions(max_retries=50, initial_delay=0.01, max_delay=0.1, deadline=60, attempt_timeout=0.5)
        keys = [f"once-{i}" for i in range(40)]
        futures = [agents[0].rpc_async("w1", "t.count", (k,), idempotent=True, retry=retry) for k in keys]
        assert [f.wait() for f in futures] == [1] * len(keys)
        assert all(CALLS[k] == 1 for k in keys)  # every request ran once, retries and duplicates included
        counts = faulty[0].stats.counts | faulty[1].stats.counts
        assert counts.get("drop:call", 0) > 0 and counts.get("duplicate:call", 0) > 0
        # the next request carries the caller's low-water mark: the callee drops every record below it
        assert agents[0].rpc_sync("w1", "t.count", ("last",), idempotent=True, retry=retry) == 1
        assert agents[1].debug_state()["records"] <= 1
    finally:
        shutdown_all(agents, graceful=False)


def test_user_calls_are_not_retried_unless_idempotent() -> None:
    def wrap(i: int, inner: Transport) -> FaultyTransport:
        return FaultyTransport(inner, seed=i, requests={"call": Faults(drop=1.0)} if i == 0 else {})

    agents, _ = world(2, wrap=wrap)
    try:
        with pytest.raises(RpcTimeout, match="1 attempt"):
            agents[0].rpc_sync("w1", "t.count", ("not-retried",), timeout=0.5)
        assert CALLS["not-retried"] == 0
    finally:
        shutdown_all(agents, graceful=False)


def test_every_pending_retry_waits_in_one_heap_not_in_tasks() -> None:
    agents, membership = world(1)
    a = agents[0]
    try:
        nowhere = Worker("w9", 9, "127.0.0.1:1")  # nothing listens there: every attempt fails
        membership.set_view(MembershipView.of(1, [a.member, nowhere]))
        wait_for(lambda: a.worker_info("w9").rank == 9 if "w9" in a._peers.view.members else False, what="new view")
        retry = RetryOptions(max_retries=1000, initial_delay=5.0, max_delay=5.0, jitter=0.0, deadline=60)
        futures = [a.rpc_async("w9", "t.echo", (i,), idempotent=True, retry=retry) for i in range(300)]
        wait_for(lambda: a.debug_state()["timers"] >= 600, what="300 calls waiting to retry")
        tasks = a._reactor.run(_count_tasks())
        assert tasks < 20  # no task (or thread) per waiting call: only the heap holds them
        membership.worker_left("w9")
        for f in futures:
            with pytest.raises(WorkerDied):
                f.wait(30)
    finally:
        shutdown_all(agents, graceful=False)


async def _count_tasks() -> int:
    return len(asyncio.all_tasks())


def test_remote_references(three: Any) -> None:
    (a, b, c), _ = three
    r = RRefRuntime.of(a).remote("w1", "t.add", (2, 3))
    assert r.to_here() == 5 and r.confirmed and r.owner().name == "w1" and not r.is_owner()
    with pytest.raises(NotOwner):
        r.local_value()
    local = RRefRuntime.of(a).remote("w0", "t.value", ("mine",))
    assert local.is_owner() and local.local_value()["key"] == "mine"
    assert a.rpc_sync("w2", "t.hold", ("r", r)) == "w1"  # a fork to a third worker
    assert HELD["r"].to_here() == 5
    bad = RRefRuntime.of(a).remote("w1", "t.fail", ("creation",))
    with pytest.raises(RRefCreationFailed, match="creation"):
        bad.to_here()
    r.release()
    with pytest.raises(RRefDeleted):
        r.to_here()
    assert HELD.pop("r").to_here() == 5  # w2's fork keeps the value alive
    del bad, local
    gc.collect()
    wait_for(lambda: all(RRefRuntime.of(x).book.is_quiescent() for x in (a, b, c))
             and b.debug_state()["generation"] == 2, what="every reference released and both values on w1 freed")


def test_owner_death_fails_fast_and_owners_drop_its_forks(three: Any) -> None:
    (a, b, c), membership = three
    on_b = RRefRuntime.of(a).remote("w1", "t.value", ("b's",))
    assert on_b.to_here()["key"] == "b's"
    on_c = RRefRuntime.of(b).remote("w2", "t.value", ("held by b",))
    on_c.to_here()
    on_c_too = RRefRuntime.of(a).remote("w2", "t.value", ("held by a",))
    on_c_too.to_here()
    slow = a.rpc_async("w1", "t.wait_gate", ("dying",), timeout=120)
    wait_for(lambda: CALLS["dying"] == 1, what="the call is running on w1")
    membership.worker_left("w1", "test: lease expired")
    with pytest.raises(WorkerDied):
        slow.wait(30)
    with pytest.raises(OwnerDied):
        on_b.to_here()  # fails at once, not after a timeout
    wait_for(lambda: len(c.debug_state()["owners"]) == 1, what="w2 dropped the value only w1 held")
    assert on_c_too.to_here()["key"] == "held by a"
    on_b.release()
    on_c_too.release()
    wait_for(lambda: not c.debug_state()["owners"], what="w2's values freed")


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


def _sockets() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                n += 1
        except OSError:
            pass
    return n


def test_shutdown_leaves_no_threads_or_sockets_and_reports_leaks() -> None:
    agents, _ = world(2)  # warm gRPC's process-wide state up before taking the baseline
    shutdown_all(agents)
    gc.collect()
    threads, sockets = _threads(), _sockets()
    agents, _ = world(3)
    a = agents[0]
    assert a.rpc_sync("w1", "t.echo", (torch.ones(1000),)).sum() == 1000
    kept = RRefRuntime.of(a).remote("w2", "t.value", ("leaked",))
    kept.to_here()
    assert a.rpc_sync("w1", "t.hold", ("kept", kept)) == "w2"
    reports = shutdown_all(agents, timeout=20)
    HELD.clear()
    assert any(kept.rref_id in leak for leak in reports[0].leaked_user_rrefs)
    assert any(kept.rref_id in leak for leak in reports[1].leaked_user_rrefs)
    assert not reports[2].leaked_owner_rrefs  # the leaked handles were released at shutdown
    assert not any(r.timed_out for r in reports)
    assert _threads() <= threads | {"MainThread"}
    wait_for(lambda: _sockets() <= sockets, what="sockets closed")
    with pytest.raises(Exception, match="not running"):
        a.rpc_sync("w1", "t.echo", (1,))
