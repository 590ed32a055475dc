"""The barrier relay: the agent sends its ranks' barrier requests to etcd together (:mod:`stalwart.api.relay`).

Three parts, as everywhere in the agent:

* :func:`due` decides when the requests waiting are sent: as soon as every rank of the pod that is connected
  and has not yet taken that step of that barrier has asked, or ``linger`` seconds after the oldest one
  arrived, whichever is first. Ranks of one pod are interrupted by the same watch event and ask once their
  aborts are done, a few milliseconds apart; waiting for each other here costs them nothing, since the
  barrier cannot complete without all of them. A rank that comes later than the linger (it was slow to
  abort) finds the others already served and is sent at once.
* :func:`admit` decides whether a request may go at all. The relay never takes a request's word for who sent
  it: each connection is bound, by its peer's process id (``SO_PEERCRED``), to one of the agent's own rank
  processes and the slot the agent gave it (``slot_of``); an arrival for any other slot, or from a process
  that is not one of the agent's ranks, is refused at once and nothing is written.
* :func:`execute` sends one batch: per epoch, one transaction fenced by it, with every arrival a put to the
  key of the slot its connection is bound to, bound to that slot's heartbeat lease (the transaction compares
  the slot's ``alive`` key's lease with the one the arrival names: a rank cannot bind its arrival to another
  rank's lease) and every distinct read once, then answers each request with its reads. A
  transaction etcd refuses (a lease gone, a newer round, etcd unreachable) is answered ``ok: false`` to all of
  its requests, and each rank makes its request itself, as it would without a relay: the relay never decides
  anything a rank would decide differently.
* :class:`BarrierRelay` is the thin shell: a Unix socket in the agent's private run directory, one thread;
  the batch's transactions run on a second one, so that a request is answered (``ok: false`` at worst) within
  ``answer_within`` in all, however many transactions its batch takes and whether or not the store logs in
  again on the way.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from stalwart.agent.socket_peers import Peer, SlotOf, peer_pid
from stalwart.api.relay import MAX_FRAME_BYTES, RelayAnswer, RelayRequest, RelayValue
from stalwart.etcd.fence import Fence
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Compare, Get, Put, Store

log = logging.getLogger(__name__)

__all__ = ["BarrierRelay", "Lend", "Step", "Waiting", "admit", "due", "execute", "linger_left", "socket_path",
           "transactions"]

#: A step of one barrier: (``"arrive"`` or ``"read"``, epoch, iteration).
Step = tuple[str, int, int]

#: The most requests in one transaction: with at most MAX_READS reads each and the fence's guards, well
#: within etcd's default limit of 128 operations in a transaction (``--max-txn-ops``).
MAX_BATCH = 16

#: How long a request waits for the pod's other ranks. A rank that waits for them here would wait for them at
#: the barrier anyway (it cannot complete without them), so only a rank that never asks (stopped, or still in
#: its own code) costs the others anything; the ranks of a loaded pod finish their aborts up to some 10 ms
#: apart, and a shorter linger would split their batch.
DEFAULT_LINGER = 0.02

#: How long sending one answer may take: answers are small, and a rank reads its answer at once.
_SEND_WITHIN = 0.5

#: The longest Unix socket path the kernel takes (``sun_path`` is 108 bytes with its terminating zero).
_MAX_SOCKET_PATH = 107


def socket_path(run_dir: Path) -> Path:
    return run_dir / "relay.sock"


#: Lends the pod's lease for its ranks' liveness: (TTL asked, a lease the rank found gone or 0, timeout) -> lease.
Lend = Callable[[int, int, float], int]


def admit(request: RelayRequest, slot: int | None) -> str | None:
    """Why the rank whose connection is bound to ``slot`` may not send ``request`` (``None``: it may). A rank
    names what to read; where its arrival goes is its own slot, as the agent knows it, never what it says. The
    pod's lease is lent to the agent's ranks only."""
    if request.lease_ttl:
        return None if slot is not None else "refused: the pod's lease is lent to this agent's ranks only"
    if request.arrival is None:
        return None
    if slot is None:
        return "refused: this connection is not one of this agent's ranks with a slot; nothing was written"
    if request.arrival.slot != slot:
        return (f"refused: an arrival for slot {request.arrival.slot} from the rank of slot {slot}; "
                "nothing was written")
    return None


@dataclass(frozen=True, slots=True)
class Waiting:
    """A request received from the rank on connection ``client`` at ``since`` (monotonic), not sent yet."""

    client: int
    request: RelayRequest
    since: float
    #: The slot the connection was bound to when the request came (``None``: a read only, from any rank).
    slot: int | None = None

    @property
    def step(self) -> Step:
        return self.request.op, self.request.epoch, self.request.iteration


def due(waiting: Sequence[Waiting], connected: frozenset[int], served: Mapping[Step, frozenset[int]],
        now: float, linger: float) -> bool:
    """Whether to send ``waiting`` now: every connected rank that has not taken a waiting step yet has asked
    (for that step or another), or the oldest request has waited ``linger`` seconds."""
    left = linger_left(waiting, now, linger)
    if left is None:
        return False
    if left == 0.0:
        return True
    asked = frozenset(w.client for w in waiting)
    return all(connected - served.get(step, frozenset()) <= asked for step in {w.step for w in waiting})


def linger_left(waiting: Sequence[Waiting], now: float, linger: float) -> float | None:
    """Seconds until :func:`due` holds by the linger alone; ``None`` when nothing waits."""
    if not waiting:
        return None
    return max(0.0, min(w.since for w in waiting) + linger - now)


def transactions(requests: Sequence[RelayRequest]) -> list[list[int]]:
    """Which requests go in which transaction (their indices): one per epoch, per :data:`MAX_BATCH` of them."""
    out: list[list[int]] = []
    for epoch in sorted({r.epoch for r in requests}):
        mine = [i for i, r in enumerate(requests) if r.epoch == epoch]
        out += [mine[first:first + MAX_BATCH] for first in range(0, len(mine), MAX_BATCH)]
    return out


def execute(store: Store, keys: JobKeys, requests: Sequence[RelayRequest], slots: Sequence[int | None], *,
            timeout: float | None = None) -> list[RelayAnswer]:
    """Send ``requests`` as :func:`transactions` says, each fenced by its epoch, and answer each request, in
    order. ``slots`` holds the slot each request's connection is bound to: an arrival goes to that slot's key
    (one :func:`admit` refuses is answered ``ok: false`` and not sent), bound to its lease only if that is the
    slot's heartbeat lease. ``timeout`` bounds all the transactions together, not each. Never raises for what
    etcd answers: a refused transaction is an ``ok: false`` answer to each of its requests. Of two arrivals for
    one key in a batch only the later is written; the earlier is answered ``ok: false`` (its rank then writes
    its own): an ``ok`` always means "written, with your lease"."""
    if len(slots) != len(requests):
        raise ValueError(f"slots: expected one per request ({len(requests)}), got {len(slots)}")
    deadline = None if timeout is None else time.monotonic() + timeout
    answers: dict[int, RelayAnswer] = {}
    admitted: list[int] = []
    for i, (r, slot) in enumerate(zip(requests, slots, strict=True)):
        if (why := admit(r, slot)) is not None:
            answers[i] = RelayAnswer(ok=False, reason=why)
        else:
            admitted.append(i)
    for part in transactions([requests[i] for i in admitted]):
        mine = [admitted[i] for i in part]
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            answers.update((i, RelayAnswer(ok=False, reason="the relay could not send it in time")) for i in mine)
            continue
        epoch = requests[mine[0]].epoch
        answers.update(zip(mine, _execute_epoch(store, keys, epoch, [requests[i] for i in mine],
                                                [slots[i] for i in mine], timeout=left), strict=True))
    assert sorted(answers) == list(range(len(requests)))
    return [answers[i] for i in range(len(requests))]


def _execute_epoch(store: Store, keys: JobKeys, epoch: int, requests: Sequence[RelayRequest],
                   slots: Sequence[int | None], *, timeout: float | None) -> list[RelayAnswer]:
    round_keys = keys.restart_round(epoch)
    base = round_keys.base
    puts: dict[str, tuple[int, Put, Compare]] = {}
    superseded: set[int] = set()
    for i, (r, slot) in enumerate(zip(requests, slots, strict=True)):
        if r.arrival is not None:
            assert slot is not None  # admitted
            key = round_keys.arrival(r.iteration, slot)
            if key in puts:
                superseded.add(puts[key][0])
            puts[key] = i, Put(key, r.arrival.to_json_bytes(), r.lease), \
                Compare(round_keys.alive(slot), "lease", "==", r.lease)
    ranges: dict[tuple[str, bool], int] = {}
    for r in requests:
        for part in r.reads:
            ranges.setdefault((part.key, part.prefix), len(ranges))
    gets = [Get(base + key, prefix=prefix) for key, prefix in ranges]
    try:
        res = Fence(store, keys, epoch).txn([c for _, _, c in puts.values()],
                                            [*(put for _, put, _ in puts.values()), *gets], timeout=timeout)
    except Exception as e:  # a lease gone, a newer round, etcd away: each rank finds out itself, alone
        return [RelayAnswer(ok=False, reason=_why(e)) for _ in requests]
    if not res.succeeded:  # an arrival named a lease that is not its slot's heartbeat lease (or that is gone)
        return [RelayAnswer(ok=False, reason="refused: an arrival's lease is not its slot's heartbeat lease; "
                                             "nothing was written") for _ in requests]
    got = res.responses[len(puts):]
    values = [[RelayValue(key=kv.key[len(base):], value=base64.b64encode(kv.value).decode(),
                          mod_revision=kv.mod_revision) for kv in response] for response in got]
    return [RelayAnswer(ok=False, reason="a later arrival for the same slot came in the same batch")
            if i in superseded else
            RelayAnswer(ok=True, revision=res.revision, values=[values[ranges[(p.key, p.prefix)]] for p in r.reads])
            for i, r in enumerate(requests)]


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:2048]


class _Client:
    """One rank's connection: what it sent that is not a whole line yet."""

    def __init__(self, conn: socket.socket, ident: int, pid: int) -> None:
        self.conn = conn
        self.ident = ident
        self.pid = pid
        self.buffer = b""


class BarrierRelay:
    """Serves ``RelayRequest`` lines on a Unix socket at ``path`` from one thread until :meth:`stop`.

    ``linger`` bounds how long a request waits for the pod's other ranks; ``answer_within`` bounds how long a
    request waits here in all, its transaction included (a rank's client gives up a little later and goes
    itself). ``slot_of`` says which slot a connection's rank holds (see :data:`SlotOf`): the agent's own
    bookkeeping, never the request. The thread survives whatever one request or transaction raises: it logs it,
    answers that batch ``ok: false`` and goes on serving."""

    def __init__(self, store: Store, keys: JobKeys, path: Path, *, slot_of: SlotOf,
                 linger: float = DEFAULT_LINGER, answer_within: float = 2.0, context: str = "",
                 lend: Lend | None = None) -> None:
        if linger < 0:
            raise ValueError(f"linger: expected seconds >= 0, got {linger}")
        if answer_within <= 0:
            raise ValueError(f"answer_within: expected seconds > 0, got {answer_within}")
        self.store = store
        self.keys = keys
        self.path = path
        self.linger = linger
        self.answer_within = answer_within
        self.context = context
        self.slot_of = slot_of
        self.lend = lend
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._listener: socket.socket | None = None
        self._clients: dict[int, _Client] = {}
        self._waiting: list[Waiting] = []
        self._served: dict[Step, frozenset[int]] = {}
        self._next = 0
        self._sender: concurrent.futures.ThreadPoolExecutor | None = None
        #: Requests and etcd transactions so far (the relay's whole point is that the second is smaller).
        self.requests = 0
        self.transactions = 0

    def start(self) -> bool:
        """Listen and serve; ``False`` (and a log line) when the socket cannot be made: ranks then go alone."""
        if len(os.fsencode(self.path)) > _MAX_SOCKET_PATH:
            log.warning("%s: barrier relay off: socket path %s is longer than %d bytes", self.context, self.path,
                        _MAX_SOCKET_PATH)
            return False
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            listener.bind(str(self.path))
            os.chmod(self.path, 0o600)  # the run directory is private too; this says so on the socket itself
            listener.listen(64)
        except OSError as e:
            listener.close()
            log.warning("%s: barrier relay off: %s", self.context, e)
            return False
        listener.setblocking(False)
        self._listener = listener
        self._sender = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stalwart-relay-txn")
        self._thread = threading.Thread(target=self._serve, name="stalwart-relay", daemon=True)
        self._thread.start()
        return True

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("%s: barrier relay thread did not stop within %.1f s", self.context, timeout)
            self._thread = None
            if self._sender is not None:
                self._sender.shutdown(wait=False, cancel_futures=True)
            log.info("%s: barrier relay: %d requests from the ranks in %d etcd transactions", self.context,
                     self.requests, self.transactions)

    # -- the thread -------------------------------------------------------------------------------------------

    def _serve(self) -> None:
        assert self._listener is not None
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, None)
        try:
            while not self._stop.is_set():
                try:
                    self._step(sel)
                except Exception:  # a bug or the system's limits; the ranks still waiting go alone
                    log.exception("%s: barrier relay: unexpected error; going on", self.context)
                    self._refuse(sel, self._waiting, "the relay failed")
                    self._waiting = []
        finally:
            self._refuse(sel, self._waiting, "the agent is stopping")  # now, not at their clients' timeout
            for client in list(self._clients.values()):
                self._drop(sel, client)
            sel.close()
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def _step(self, sel: selectors.BaseSelector) -> None:
        left = linger_left(self._waiting, time.monotonic(), self.linger)
        for key, _ in sel.select(timeout=0.2 if left is None else min(left, 0.2)):
            if key.data is None:
                self._accept(sel)
            else:
                self._read(sel, key.data)
        if due(self._waiting, frozenset(self._clients), self._served, time.monotonic(), self.linger):
            self._flush(sel)

    def _accept(self, sel: selectors.BaseSelector) -> None:
        assert self._listener is not None
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            return
        except OSError as e:  # out of file descriptors, say: the rank finds no relay and goes alone
            log.warning("%s: barrier relay: cannot accept a rank: %s", self.context, e)
            self._stop.wait(0.1)  # the listener stays readable; do not spin on it
            return
        conn.setblocking(False)
        self._next += 1
        client = _Client(conn, self._next, peer_pid(conn))
        self._clients[client.ident] = client
        sel.register(conn, selectors.EVENT_READ, client)

    def _read(self, sel: selectors.BaseSelector, client: _Client) -> None:
        try:
            data = client.conn.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sel, client)
            return
        client.buffer += data
        while b"\n" in client.buffer:
            line, client.buffer = client.buffer.split(b"\n", 1)
            self._received(sel, client, line)
        if len(client.buffer) > MAX_FRAME_BYTES:
            self._answer(sel, client, RelayAnswer(ok=False, reason=f"request longer than {MAX_FRAME_BYTES} bytes"))
            self._drop(sel, client)

    def _received(self, sel: selectors.BaseSelector, client: _Client, line: bytes) -> None:
        try:
            request = RelayRequest.model_validate_json(line)
        except ValidationError as e:
            # The rank's own fallback covers it; the log says which field was wrong.
            log.warning("%s: barrier relay: invalid request: %s", self.context, e)
            self._answer(sel, client, RelayAnswer(ok=False, reason=f"invalid request: {e}"[:2048]))
            return
        self.requests += 1
        try:
            slot = self.slot_of(Peer(client.ident, client.pid))
        except Exception:  # the agent's bookkeeping changed under it: not known, so not admitted
            log.exception("%s: barrier relay: cannot tell which rank connection %d is", self.context, client.ident)
            slot = None
        if (why := admit(request, slot)) is not None:
            log.warning("%s: barrier relay: %s (pid %d)", self.context, why, client.pid)
            self._answer(sel, client, RelayAnswer(ok=False, reason=why))
            return
        if request.lease_ttl:
            self._answer(sel, client, self._lent(request))
            return
        self._waiting.append(Waiting(client.ident, request, time.monotonic(), slot))

    def _lent(self, request: RelayRequest) -> RelayAnswer:
        """The answer to one of the agent's ranks asking for the pod's lease."""
        if self.lend is None:
            return RelayAnswer(ok=False, reason="no lease lent here: take one of your own")
        assert self._sender is not None
        lend = self.lend
        try:
            lease = self._sender.submit(lambda: lend(request.lease_ttl, request.lease, self.answer_within)).result(
                timeout=self.answer_within)
        except Exception as e:  # etcd away, or slow: the rank takes a lease of its own, as without an agent
            log.warning("%s: barrier relay: could not lend the ranks' lease: %s", self.context, _why(e))
            return RelayAnswer(ok=False, reason=f"could not lend the pod's lease: {_why(e)}")
        return RelayAnswer(ok=True, lease=lease)

    def _flush(self, sel: selectors.BaseSelector) -> None:
        batch, self._waiting = self._waiting, []
        # A request waits here at most answer_within in all, so that its rank is answered before it gives up.
        left = self.answer_within - (time.monotonic() - min(w.since for w in batch))
        if left <= 0:
            self._refuse(sel, batch, "the relay could not send it in time")
            return
        requests = [w.request for w in batch]
        self.transactions += len(transactions(requests))
        assert self._sender is not None
        sent = self._sender.submit(execute, self.store, self.keys, requests, [w.slot for w in batch], timeout=left)
        try:
            # The bound holds in all: a transaction the store retries after logging in again, or one that is
            # still waiting behind the previous batch, is answered "no" at the bound, and its rank goes alone
            # (an arrival written later anyway is the same record its rank then writes itself).
            answers = sent.result(timeout=left)
        except concurrent.futures.TimeoutError:
            self._refuse(sel, batch, "the relay could not send it in time")
            return
        except Exception:  # execute answers what etcd refuses; this is a bug, and the batch's ranks go alone
            log.exception("%s: barrier relay: a batch failed", self.context)
            self._refuse(sel, batch, "the relay failed")
            return
        for w, answer in zip(batch, answers, strict=True):
            self._served[w.step] = self._served.get(w.step, frozenset()) | {w.client}
            client = self._clients.get(w.client)
            if client is not None:
                self._answer(sel, client, answer)
        while len(self._served) > 16:  # only the last barriers' steps matter
            del self._served[next(iter(self._served))]

    def _refuse(self, sel: selectors.BaseSelector, batch: Sequence[Waiting], why: str) -> None:
        for w in batch:
            if (client := self._clients.get(w.client)) is not None:
                self._answer(sel, client, RelayAnswer(ok=False, reason=why))

    def _answer(self, sel: selectors.BaseSelector, client: _Client, answer: RelayAnswer) -> None:
        data = answer.model_dump_json(by_alias=True).encode() + b"\n"
        try:
            # A rank that does not read its answer at once is dropped (it goes alone), not waited for.
            client.conn.settimeout(_SEND_WITHIN)
            client.conn.sendall(data)
            client.conn.setblocking(False)
        except OSError as e:
            log.warning("%s: barrier relay: could not answer a rank: %s", self.context, e)
            self._drop(sel, client)

    def _drop(self, sel: selectors.BaseSelector, client: _Client) -> None:
        self._clients.pop(client.ident, None)
        self._waiting = [w for w in self._waiting if w.client != client.ident]
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(client.conn)
        client.conn.close()

