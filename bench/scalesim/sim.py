"""The simulator's clock, its model of one etcd server's time, and the store the simulated agents call.

Simulated time, not wall time: a run of 10,000 agents on one 2-core machine cannot give each agent a CPU,
so the simulator executes every agent's real code (the protocol, the driver, the fence) one after the other
and charges each etcd request and each watch event to a model of one etcd server whose costs are measured on
a real etcd server of this machine first (:mod:`.calibrate`):

* a request reaches etcd half a round trip after it is sent, waits for the server, takes its service time
  (``write`` for a proposal, ``read + read_byte * bytes`` for a read) and its answer comes back half a round
  trip later; the server does one thing at a time, in the order the simulator issues requests;
* a change is sent to every watcher of its prefix (or, for a watch of :class:`Subscription`, to every watcher
  whose ranges hold its key, with etcd's NOPUT filter): the server spends ``event + event_byte * bytes`` per
  event per watcher, in batches (all changes committed while it was busy go out together), and a watcher
  holds the batch half a round trip after the server finished sending it to all.

Answers (revisions, compares, watch events) are those of :class:`.memetcd.MemEtcd`.

The project's own code costs what it takes (``cpu=True``, the default): a simulated process's work (a
rank's barrier step, an agent's driver step, a relay's transaction) runs inside :meth:`Sim.working`, which
measures its thread CPU time and advances the clock by it, in order (computation before a request delays the
request), with the simulator's own work (the model etcd, the fan-out) left out. A process does one thing at a
time: its next work starts when its last ended, and the watch batches that arrive while it computes wait and
are handled as one (:meth:`Sim.serial`), as the real loop takes what arrived since and decides once. The CPU
is this machine's, one simulated process at a time: each real process would have a core of its own. Work the
simulator shares between processes that would each do it (a parse of the same bytes) is charged to each, at
the CPU it took once (:meth:`Sim.charge`). The etcd client's own CPU (gRPC, TLS, protobuf) is charged the
same way where the calibration measured it (:attr:`Costs.client_request` per request, :attr:`Costs.client_event`
per watch event received), to the process that sends or receives. Not charged: the Python interpreter's start,
imports, garbage collection pauses and the kernel's network stack (beyond what the client's CPU holds of it).
"""

from __future__ import annotations

import bisect
import contextlib
import heapq
import itertools
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from bench.scalesim.memetcd import MemEtcd
from stalwart.api.pacing import progress_interval
from stalwart.etcd.store import Compare, KeyValue, Op, TxnResult, WatchEvent, WatchRange

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Costs:
    """Seconds the model etcd spends: per round trip, per proposal, per read (and per key and per byte it
    returns), per watch event per watcher (and per byte of it).

    ``write_batched``: seconds per proposal measured with that many proposals in flight at once, as
    ``(concurrency, seconds)`` rows by rising concurrency (``calibrate.py``). etcd's raft loop puts every
    proposal that arrived while it was busy into its next append and fsync, so a proposal costs less the more
    are in flight; the server charges a proposal the row of the proposals in flight when it arrives
    (:meth:`write_at`). Empty: every proposal costs ``write``."""

    rtt: float = 0.0002
    write: float = 0.0001
    read: float = 0.00005
    read_key: float = 0.0
    read_byte: float = 2e-9
    event: float = 0.000005
    event_byte: float = 2e-9
    write_batched: tuple[tuple[float, float], ...] = ()
    read_batched: tuple[tuple[float, float], ...] = ()
    #: CPU seconds the calling process's etcd client (gRPC, TLS, protobuf) spends per request it sends and
    #: answer it reads, and per watch event it is sent (one event to an answer, as the barrier's watches get
    #: them): charged to the simulated process that sends or receives, like its own code. 0 in rows calibrated
    #: before they were measured: those runs did not charge the client.
    client_request: float = 0.0
    client_event: float = 0.0

    def __post_init__(self) -> None:
        for name in ("client_request", "client_event"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: expected CPU seconds >= 0, got {getattr(self, name)!r}")
        for name in ("write_batched", "read_batched"):
            given = getattr(self, name)
            # From JSON (``--costs``) the rows come as lists.
            rows = tuple((float(c), float(s)) for c, s in given)
            if any(c < 1 or s < 0 for c, s in rows) or any(a[0] >= b[0] for a, b in itertools.pairwise(rows)):
                raise ValueError(f"{name}: expected (concurrency >= 1, seconds >= 0) rows by rising concurrency, "
                                 f"got {list(given)}")
            object.__setattr__(self, name, rows)

    def write_at(self, in_flight: float) -> float:
        """Seconds of the server per proposal with ``in_flight`` proposals in flight (this one counted): the
        measured rows, interpolated linearly in the logarithm of the concurrency and held at either end."""
        return _at(self.write_batched, in_flight, self.write)

    def read_at(self, in_flight: float) -> float:
        """Seconds of the server for a read's own part (besides its keys and bytes) with ``in_flight`` reads in
        flight (this one counted), as :meth:`write_at` for proposals; ``read`` without rows."""
        return _at(self.read_batched, in_flight, self.read)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in self.__slots__}
        for name in ("write_batched", "read_batched"):
            out[name] = [list(r) for r in getattr(self, name)]
        return out


def _at(rows: tuple[tuple[float, float], ...], in_flight: float, alone: float) -> float:
    if not rows:
        return alone
    if in_flight <= rows[0][0]:
        return rows[0][1]
    if in_flight >= rows[-1][0]:
        return rows[-1][1]
    hi = next(i for i, (c, _) in enumerate(rows) if c >= in_flight)
    (c0, s0), (c1, s1) = rows[hi - 1], rows[hi]
    return s0 + (s1 - s0) * (math.log(in_flight) - math.log(c0)) / (math.log(c1) - math.log(c0))


def in_ranges(ranges: tuple[WatchRange, ...], ev: WatchEvent) -> bool:
    """Whether a watch on ``ranges`` is sent ``ev`` (etcd's matching, and its NOPUT filter)."""
    key = ev.kv.key
    return any((key.startswith(r.key) if r.prefix else key == r.key) and not (r.no_put and ev.type == "put")
               for r in ranges)


@dataclass(eq=False)
class Subscription:
    """One watch stream of one simulated process: the ranges it follows from revision ``start`` and what it does
    with a batch (the events it is sent, and when it holds them)."""

    ranges: tuple[WatchRange, ...]
    start: int
    deliver: Callable[[list[WatchEvent], float], None]
    active: bool = True
    #: A what-if (not how the code watches): the watches of one ``group`` (a pod) are one watch in etcd, which
    #: the pod's agent hands on to each (``hop`` seconds later); ``None``: a watch of its own.
    group: object | None = None
    #: A what-if: the changes of one transaction are one record (a pod's arrivals in one key): one event.
    per_transaction: bool = False
    hop: float = 0.0
    #: The simulated process whose etcd client receives the events (charged :attr:`Costs.client_event` each);
    #: ``None``: nobody's (the model's own watchers).
    owner: object | None = None


@dataclass
class _Scope:
    phase: str
    mark: float
    owner: object = None


@dataclass
class _CpuLine:
    """One process's CPU when its work runs on threads (or the model etcd's time): the bursts placed so far, as
    the end of the last one and the idle gaps left before it (the most recent ``keep``, in order). A burst takes
    the first gap that holds it at or after it is ready, else the end: a thread's work after its etcd answer
    (which the simulator computes at once, at the answer's time) does not hold back another thread's work that
    was ready before."""

    free: float = 0.0
    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    keep: int = 64  # the most recent gaps kept (older ones are given up: a burst then waits longer)

    def place(self, ready: float, length: float) -> float:
        """Where a burst of ``length`` seconds, ready at ``ready``, ends."""
        # The gaps are disjoint and in order, so their ends are too: skip those over before ``ready``.
        for i in range(bisect.bisect_left(self.ends, ready), len(self.ends)):
            a, b = self.starts[i], self.ends[i]
            start = max(a, ready)
            if start + length <= b:
                parts = [g for g in ((a, start), (start + length, b)) if g[1] > g[0]]
                self.starts[i:i + 1] = [g[0] for g in parts]
                self.ends[i:i + 1] = [g[1] for g in parts]
                return start + length
        start = max(ready, self.free)
        if start > self.free:
            self.starts.append(self.free)
            self.ends.append(start)
            del self.starts[:-self.keep], self.ends[:-self.keep]
        self.free = start + length
        return self.free


@dataclass(order=True)
class _Job:
    at: float
    seq: int
    fn: Callable[[], None] = field(compare=False)


@dataclass
class _Counts:
    """Times with how many things happened at each: those that came in order (the most), kept with their running
    total; those that came before the last one (a request served in an idle gap finished before some placed
    earlier), kept apart in a short sorted list that is merged in when it grows."""

    times: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    late_times: list[float] = field(default_factory=list)
    late_counts: list[float] = field(default_factory=list)

    def add(self, when: float, count: float) -> None:
        if not self.times or when >= self.times[-1]:
            self.times.append(when)
            self.total.append((self.total[-1] if self.total else 0.0) + count)
            return
        i = bisect.bisect_right(self.late_times, when)
        self.late_times.insert(i, when)
        self.late_counts.insert(i, count)
        if len(self.late_times) > 256:
            self._merge()

    def by(self, when: float) -> float:
        """How many happened at or before ``when``."""
        i = bisect.bisect_right(self.times, when)
        j = bisect.bisect_right(self.late_times, when)
        return (self.total[i - 1] if i else 0.0) + sum(self.late_counts[:j])

    def _merge(self) -> None:
        counts = [b - a for a, b in zip([0.0, *self.total[:-1]], self.total, strict=True)]
        merged = sorted([*zip(self.times, counts, strict=True),
                         *zip(self.late_times, self.late_counts, strict=True)], key=lambda tc: tc[0])
        self.times = [t for t, _ in merged]
        self.total = list(itertools.accumulate(c for _, c in merged))
        self.late_times, self.late_counts = [], []


@dataclass
class _InFlight:
    """When each request of one kind arrived and finished, with how many of that kind it carried."""

    arrived: _Counts = field(default_factory=_Counts)
    done: _Counts = field(default_factory=_Counts)

    def at(self, arrive: float) -> float:
        """Queued or being served at ``arrive``: arrived by then, not finished by then."""
        return self.arrived.by(arrive) - self.done.by(arrive)

    def add(self, arrive: float, done: float, count: float) -> None:
        self.arrived.add(arrive, count)
        self.done.add(done, count)


@dataclass
class Server:
    """The model etcd's single queue; records when each request finished (for the peak request rate).

    Requests are served in the order they reach it in simulated time, one at a time: a request takes the first
    idle stretch at or after its arrival that holds it (the simulator issues requests in the order it runs the
    processes' steps, so a request that arrives earlier may be issued after one that arrives later: it is
    served in the gap that one left, not after it).

    A request that carries ``proposals`` raft proposals costs, besides its own ``cost``, each of them
    :meth:`Costs.write_at` of the proposals in flight when it arrives: those that arrived before it and are not
    done yet, and its own. A burst of proposals is
    thus charged as etcd's raft loop batches it: the first at the cost of one alone, each later one at the cost
    measured with as many in flight. ``reads`` (linearizable reads, which etcd batches onto one read index
    likewise) are charged :meth:`Costs.read_at` the same way."""

    costs: Costs
    busy_until: float = 0.0
    busy_total: float = 0.0
    done_at: list[float] = field(default_factory=list)
    proposals: _InFlight = field(default_factory=_InFlight)
    reads: _InFlight = field(default_factory=_InFlight)
    line: _CpuLine = field(default_factory=lambda: _CpuLine(keep=1024))

    def in_flight(self, arrive: float) -> float:
        """Proposals queued or being served at ``arrive``."""
        return self.proposals.at(arrive)

    def serve(self, arrive: float, cost: float, *, request: bool = True, proposals: float = 0.0,
              reads: float = 0.0) -> float:
        if proposals:
            cost += proposals * self.costs.write_at(self.proposals.at(arrive) + proposals)
        if reads:
            cost += reads * self.costs.read_at(self.reads.at(arrive) + reads)
        done = self.line.place(arrive, cost)
        self.busy_until = max(self.busy_until, done)
        self.busy_total += cost
        if proposals:
            self.proposals.add(arrive, done, proposals)
        if reads:
            self.reads.add(arrive, done, reads)
        if request:
            self.done_at.append(done)
        return done

    def peak_rate(self, window: float = 0.1) -> float:
        """The most requests finished in any ``window`` seconds, per second."""
        times = sorted(self.done_at)
        best, lo = 0, 0
        for hi, t in enumerate(times):
            while times[lo] < t - window:
                lo += 1
            best = max(best, hi - lo + 1)
        return best / window


@dataclass(frozen=True, slots=True)
class Background:
    """The steady requests a running job sends etcd beside the protocol's, as the project's code sends them:
    the ranks' liveness lease (one per pod of ``ranks_per_lease`` ranks, which its agent lends them:
    ``stalwart/agent/rank_liveness.py``; 1: a lease per rank, as a rank without an agent holds) and each node's
    lease refreshed every third of its TTL; with ``ranks_on_node_lease`` (the agent's default, where the two TTLs
    are equal) the agent lends its ranks the node's own lease, and the ranks' liveness costs no refresh of its own
    (``stalwart/etcd/leases.py``: ``heartbeat_ttl`` 10 s, ``node_ttl`` 10 s by default), and each node's
    agent's progress record, a fenced put every ``progress_interval``: by default what the agents' own
    :func:`~stalwart.api.pacing.progress_interval` makes of their 1 s setting for this many nodes and the
    default soft timeout (60 s). A refresh costs the server a read (etcd's leader renews a lease without a raft
    proposal), a progress write a proposal. The operator's reads (one of the job's prefix per resync) and the
    watches' own keep-alives are not counted."""

    ranks: int
    nodes: int
    rank_ttl: float = 10.0
    node_ttl: float = 10.0
    progress_interval: float | None = None
    ranks_per_lease: int = 8
    ranks_on_node_lease: bool = True

    def writes_every(self) -> float:
        """Seconds between one node's progress writes."""
        if self.progress_interval is not None:
            return self.progress_interval
        return progress_interval(self.nodes, least=1.0, soft_timeout=60.0) if self.nodes else 1.0

    def rates(self) -> dict[str, float]:
        """Requests per second, by kind."""
        shared = self.ranks_on_node_lease and self.ranks_per_lease > 1 and self.rank_ttl == self.node_ttl
        return {"rank_lease_refresh": 0.0 if shared else -(-self.ranks // self.ranks_per_lease) / (self.rank_ttl / 3),
                "node_lease_refresh": self.nodes / (self.node_ttl / 3),
                "progress_write": self.nodes / self.writes_every()}

    def busy_per_second(self, costs: Costs, tick: float = 0.005) -> float:
        """Seconds of the server's time each second these take (its utilisation before the protocol's), as
        :meth:`Sim.background` serves them: a tick's progress writes in flight together."""
        r = self.rates()
        refreshes, writes = r["rank_lease_refresh"] + r["node_lease_refresh"], r["progress_write"]
        return refreshes * costs.read_at(refreshes * tick) + writes * costs.write_at(writes * tick)


class Sim:
    """A discrete-event loop over simulated seconds, one model etcd server and its watch fan-out."""

    def __init__(self, costs: Costs, mem: MemEtcd | None = None, *, cpu: bool = True, threads: bool = False) -> None:
        self.costs = costs
        self.mem = mem or MemEtcd()
        self.server = Server(costs)
        self.now = 0.0
        #: Charge the project's code its CPU time (see the module's doc); off, it runs in no simulated time.
        self.cpu = cpu
        #: A process's work runs on threads of it (see :meth:`working`): as the real validation's processes do,
        #: each holding thousands of ranks or nodes, their etcd calls on threads of their own.
        self.threads = threads
        self._lines: dict[int, _CpuLine] = {}
        #: CPU seconds measured per phase (charged or not), and per simulated process: when it is free.
        self.cpu_seconds: dict[str, float] = {}
        self.busy: dict[int, float] = {}
        self._scope: _Scope | None = None
        self._untimed = 0
        #: Requests of the background load served so far (see :meth:`background`).
        self.background_requests = 0.0
        self._queue: list[_Job] = []
        self._seq = itertools.count()
        #: Commit time of each entry of ``mem.log`` (same index).
        self.committed_at: list[float] = []
        self.watchers: list[Callable[[int, int, float], None]] = []
        self.watch_prefix = ""
        #: Watch streams per watcher callback (a rank watches the same prefix twice).
        self.streams = 1
        #: When set, the number of watch streams in all (agents that share one watch, as in one process).
        self.watch_streams: int | None = None
        #: Watches by their ranges (see :meth:`subscribe`).
        self.subscriptions: dict[tuple[WatchRange, ...], list[Subscription]] = {}
        self._sent = 0
        self._pump_pending = False
        self.events_sent = 0
        self.event_bytes_sent = 0
        #: The order etcd sends one change to its watchers in (none set: seeded, so a run repeats).
        self._order = random.Random(0)

    # -- the loop ----------------------------------------------------------------------------------------

    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._queue, _Job(when, next(self._seq), fn))

    def run(self, until: float, stop: Callable[[], bool] = lambda: False) -> None:
        while self._queue and not stop():
            job = heapq.heappop(self._queue)
            if job.at > until:
                heapq.heappush(self._queue, job)
                return
            # Each agent acts at its own time: a job runs at the time it was due, not after the requests of the
            # jobs run before it (that would make every agent wait for every other's round trip, as if they
            # all shared one connection and called one after another). The server stays one FIFO queue.
            self.now = job.at
            job.fn()

    def background(self, load: Background, start: float, until: float, tick: float = 0.005) -> None:
        """Serve ``load`` from ``start`` to ``until``: every ``tick`` its requests of that tick join the
        server's queue (a steady flow, spread evenly: refreshes are jittered, progress timers free-running)."""
        per_tick = sum(load.rates().values()) * tick
        rates = load.rates()
        refreshes = (rates["rank_lease_refresh"] + rates["node_lease_refresh"]) * tick
        writes = rates["progress_write"] * tick

        def step() -> None:
            # Batched with whatever is in flight, as the protocol's: the progress writes are proposals, the
            # lease refreshes charged as reads (the leader renews without a proposal).
            self.server.serve(self.now, 0.0, request=False, proposals=writes, reads=refreshes)
            self.background_requests += per_tick
            if self.now + tick <= until:
                self.at(self.now + tick, step)
        self.at(start, step)

    # -- the project's CPU ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def working(self, owner: object, phase: str) -> Iterator[None]:
        """The block is ``owner``'s work (one simulated process): it starts when the process is free (not
        before ``now``), and its CPU time, up to each request and after the last, advances the clock.

        With :attr:`threads` the block is one of the process's threads: each piece of its CPU waits for the
        process's CPU to be free (one interpreter lock), but its waits on etcd leave the CPU to the others."""
        assert self._scope is None, "a simulated process's work does not nest"
        if not self.threads:
            self.now = max(self.now, self.busy.get(id(owner), 0.0))
        self._scope = _Scope(phase, time.thread_time(), owner)
        try:
            yield
        finally:
            self._charge()
            self._scope = None
            if not self.threads:
                self.busy[id(owner)] = self.now

    def charge(self, seconds: float) -> None:
        """Charge the work under way ``seconds`` more: what it would have computed itself, had the simulator
        not shared the result of another process's same computation."""
        if self._scope is not None:
            self._account(self._scope.phase, seconds)

    @contextlib.contextmanager
    def untimed(self) -> Iterator[None]:
        """The simulator's own work inside a process's (the model etcd answering): charged to nobody."""
        self._charge()
        self._untimed += 1
        try:
            yield
        finally:
            self._untimed -= 1
            if self._scope is not None and not self._untimed:
                self._scope.mark = time.thread_time()

    def measured(self, fn: Callable[[], T]) -> tuple[T, float]:
        """``fn()`` and the thread CPU seconds it took (for :meth:`charge` of a shared result)."""
        t0 = time.thread_time()
        result = fn()
        return result, time.thread_time() - t0

    def serial(self, owner: object, handle: Callable[[list[WatchEvent], float], None]) \
            -> Callable[[list[WatchEvent], float], None]:
        """A watch's ``deliver`` for ``owner``, which handles one batch at a time: a batch that arrives while
        the process computes waits, with every batch after it, until the process is free, and goes as one."""
        pending: list[WatchEvent] = []

        def flush() -> None:
            free = self.busy.get(id(owner), 0.0)
            if free > self.now:
                self.at(free, flush)
                return
            batch = pending[:]
            pending.clear()
            handle(batch, self.now)

        def deliver(events: list[WatchEvent], when: float) -> None:
            free = self.busy.get(id(owner), 0.0)
            # On threads (``threads``) a batch is handled at once: its CPU waits for the process's (``working``).
            if not pending and (not self.cpu or self.threads or free <= when):
                handle(events, when)
                return
            if not pending:
                self.at(max(free, when), flush)
            pending.extend(events)
        return deliver

    def _charge(self) -> None:
        scope = self._scope
        if scope is None or self._untimed:
            return
        t = time.thread_time()
        spent, scope.mark = t - scope.mark, t
        self._account(scope.phase, spent)

    def _account(self, phase: str, seconds: float) -> None:
        self.cpu_seconds[phase] = self.cpu_seconds.get(phase, 0.0) + seconds
        if not self.cpu:
            return
        if self.threads and self._scope is not None:
            self.now = self._on_line(self._scope.owner, seconds)
        else:
            self.now += seconds

    def _on_line(self, owner: object, seconds: float) -> float:
        """A burst of ``seconds`` of ``owner``'s CPU, ready now, placed on its line (:attr:`threads`): when it
        ends."""
        line = self._lines.setdefault(id(owner), _CpuLine())
        done = line.place(self.now, seconds)
        self.busy[id(owner)] = line.free
        return done

    # -- requests ----------------------------------------------------------------------------------------

    def request(self, cost: float | Callable[[], float], call: Callable[[], T], *,
                proposals: float | Callable[[], float] = 0.0, reads: float | Callable[[], float] = 0.0) -> T:
        """Run ``call`` on the model etcd as a request sent at ``now``; ``now`` becomes the answer's time.
        ``cost`` (the request's work besides its proposals and its read's own part), ``proposals`` (how many
        raft proposals it makes) and ``reads`` (1 for a read that makes none), each charged by the server at
        the concurrency it meets, may be functions, asked after the call (a transaction makes a proposal only
        if it wrote)."""
        with self.untimed():
            before = len(self.mem.log)
            arrive = self.now + self.costs.rtt / 2
            try:
                result = call()
            finally:
                done = self.server.serve(arrive, cost if isinstance(cost, float) else cost(),
                                         proposals=proposals if isinstance(proposals, float) else proposals(),
                                         reads=reads if isinstance(reads, float) else reads())
                new = len(self.mem.log) - before
                if new:
                    self.committed_at.extend([done] * new)
                    self._schedule_pump(done)
                self.now = done + self.costs.rtt / 2
        if self._scope is not None and self.costs.client_request:
            self._account("client", self.costs.client_request)  # the caller's client sends it and reads the answer
        return result

    # -- watch fan-out -----------------------------------------------------------------------------------

    def subscribe(self, ranges: tuple[WatchRange, ...], start: int,
                  deliver: Callable[[list[WatchEvent], float], None], *, group: object | None = None,
                  per_transaction: bool = False, hop: float = 0.0, owner: object | None = None,
                  created_now: bool = True) -> Subscription:
        """A watch on ``ranges`` from revision ``start`` (what etcd sends a process that read at ``start - 1``
        and then watched from the next revision), received by the process ``owner``, whose client pays for its
        creation now (``created_now``; not for a watch set up before what is timed); ``group``,
        ``per_transaction``, ``hop``: what-ifs, see :class:`Subscription`."""
        sub = Subscription(ranges, start, deliver, group=group, per_transaction=per_transaction, hop=hop,
                           owner=owner)
        if owner is not None and group is None and created_now:
            # Creating a watch is a request and its answer on the owner's stream (etcd's side is not charged).
            self._client_cpu(owner, self.costs.client_request)
        self.subscriptions.setdefault(ranges, []).append(sub)
        self._replay(sub)
        return sub

    def _replay(self, sub: Subscription) -> None:
        """Send a new watch what it asked for of the changes already sent to the others (etcd replays history
        from a watch's start revision): a watch opened after the change it waits for was sent still gets it."""
        log = self.mem.log
        first = bisect.bisect_left(log, sub.start, hi=self._sent, key=lambda ev: ev.kv.mod_revision)
        missed = [ev for ev in log[first:self._sent] if in_ranges(sub.ranges, ev)]
        if not missed:
            return
        count, cost = self._sending(sub, missed)
        done = self.server.serve(self.now, cost, request=False)
        self._send(sub, missed, count, done + self.costs.rtt / 2)

    def _sending(self, sub: Subscription, sent: list[WatchEvent]) -> tuple[int, float]:
        """What sending ``sent`` to ``sub`` is, counted in the totals: its events (a transaction's one, for a
        ``per_transaction`` watch) and the server's seconds for them."""
        size = sum(len(ev.kv.key) + len(ev.kv.value) for ev in sent)
        count = len({ev.kv.mod_revision for ev in sent}) if sub.per_transaction else len(sent)
        self.events_sent += count
        self.event_bytes_sent += size
        return count, count * self.costs.event + size * self.costs.event_byte

    def unsubscribe(self, sub: Subscription) -> None:
        sub.active = False
        group = self.subscriptions.get(sub.ranges, [])
        if sub in group:
            group.remove(sub)

    def _fan_out(self, log: Sequence[WatchEvent]) \
            -> tuple[float, list[tuple[Subscription, list[WatchEvent], int]]]:
        """The server's cost of sending ``log`` to the subscriptions, and who gets what (with the events its
        process's client decodes: none where its group's were decoded once for all). Watches of equal ranges
        share the matching; each is sent what is at or after its start."""
        cost: float = 0.0
        sends: list[tuple[Subscription, list[WatchEvent], int]] = []
        for ranges, group in self.subscriptions.items():
            if not group:
                continue
            events = [ev for ev in log if in_ranges(ranges, ev)]
            if not events:
                continue
            charged: set[tuple[int, int]] = set()  # (group, first revision sent) already paid for
            for sub in group:
                sent = events if events[0].kv.mod_revision >= sub.start else \
                    [ev for ev in events if ev.kv.mod_revision >= sub.start]
                if not sent:
                    continue
                if sub.group is not None:
                    mark = (id(sub.group), sent[0].kv.mod_revision)
                    if mark in charged:
                        sends.append((sub, sent, 0))
                        continue
                    charged.add(mark)
                count, seconds = self._sending(sub, sent)
                sends.append((sub, sent, count))
                cost += seconds
        return cost, sends

    def _schedule_pump(self, when: float) -> None:
        if not self._pump_pending:
            self._pump_pending = True
            self.at(when, self._pump)

    def _pump(self) -> None:
        """Send every change committed by now to every watcher, as one batch."""
        self._pump_pending = False
        start, end = self._sent, len(self.committed_at)
        while end > start and self.committed_at[end - 1] > self.now:
            end -= 1
        if end == start:
            if len(self.committed_at) > start:
                self._schedule_pump(self.committed_at[start])
            return
        events = [ev for ev in self.mem.log[start:end] if ev.kv.key.startswith(self.watch_prefix)]
        size = sum(len(ev.kv.key) + len(ev.kv.value) for ev in events)
        watchers = self.watch_streams if self.watch_streams is not None else len(self.watchers) * self.streams
        cost = watchers * (len(events) * self.costs.event + size * self.costs.event_byte)
        self.events_sent += watchers * len(events)
        self.event_bytes_sent += watchers * size
        sub_cost, sends = self._fan_out(self.mem.log[start:end])
        done = self.server.serve(self.now, cost + sub_cost, request=False)
        self._sent = end
        delivered = done + self.costs.rtt / 2
        for deliver in list(self.watchers):
            self.at(delivered, lambda d=deliver: d(start, end, delivered))  # type: ignore[misc]
        # etcd sends a change to its watchers in no set order; a process's client decodes its watches' answers one
        # after another, and each watch's events reach the code once its answer is decoded.
        self._order.shuffle(sends)
        for sub, sent, count in sends:
            self._send(sub, sent, count, delivered)
        if len(self.committed_at) > end:
            self._schedule_pump(self.committed_at[end])

    def _send(self, sub: Subscription, events: list[WatchEvent], count: int, delivered: float) -> None:
        """``events`` reach ``sub``'s process at ``delivered``: decoded by its client first where it has one."""
        if count and sub.owner is not None:
            self.at(delivered, lambda: self._received(sub, events, count))
            return
        self.at(delivered + sub.hop, lambda: sub.deliver(events, delivered + sub.hop) if sub.active else None)

    def _received(self, sub: Subscription, events: list[WatchEvent], count: int) -> None:
        """``sub``'s process's client decodes its ``count`` events (:attr:`Costs.client_event` each) on that
        process's CPU from now, after what it decodes or computes already; then they are ``sub``'s."""
        if not sub.active:
            return
        # A group's watch (a what-if) is its pod agent's: the agent decodes, then hands the events on.
        done = self._client_cpu(sub.group if sub.group is not None else sub.owner, count * self.costs.client_event)
        self.at(done + sub.hop, lambda: sub.deliver(events, done + sub.hop) if sub.active else None)

    def _client_cpu(self, owner: object, seconds: float) -> float:
        """``seconds`` of ``owner``'s CPU from now on for its etcd client's work outside its own code's (a watch
        created, events decoded): its next work starts when that is done. When it is done."""
        if not (self.cpu and seconds):
            return self.now
        self.cpu_seconds["client"] = self.cpu_seconds.get("client", 0.0) + seconds
        if self.threads:
            return self._on_line(owner, seconds)
        done = self.busy[id(owner)] = max(self.now, self.busy.get(id(owner), 0.0)) + seconds
        return done


class TimedStore:
    """The :class:`stalwart.etcd.store.Store` interface the real code calls, answered by the model etcd at the
    simulated time of the agent running now (every call advances ``sim.now`` by its round trip)."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.mem = sim.mem

    def _read_cost(self, kvs: Sequence[KeyValue]) -> float:
        """A read's keys and bytes (its own part, :meth:`Costs.read_at`, is the server's to charge)."""
        c = self.sim.costs
        return c.read_key * len(kvs) + c.read_byte * sum(len(kv.key) + len(kv.value) for kv in kvs)

    def get(self, key: str, *, timeout: float | None = None) -> KeyValue | None:
        with self.sim.untimed():
            kv = self.mem.get(key)
            return self.sim.request(self._read_cost([kv] if kv else []), lambda: kv, reads=1.0)

    def get_prefix(self, prefix: str, *, keys_only: bool = False,
                   timeout: float | None = None) -> tuple[list[KeyValue], int]:
        with self.sim.untimed():
            kvs, rev = self.mem.get_prefix(prefix)
            return self.sim.request(self._read_cost(kvs), lambda: (kvs, rev), reads=1.0)

    def txn(self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = (),
            *, timeout: float | None = None) -> TxnResult:
        before = self.mem.counters.proposals
        res: list[TxnResult] = []

        def call() -> TxnResult:
            res.append(self.mem.txn(compare, success, failure))
            return res[0]

        def wrote() -> float:
            return 1.0 if self.mem.counters.proposals > before else 0.0

        def cost() -> float:
            # A write that also reads (an arrival with the keys it waits on) pays for what it returns.
            return self._read_cost([kv for r in res[0].responses for kv in r]) if res else 0.0
        return self.sim.request(cost, call, proposals=wrote, reads=lambda: 1.0 - wrote())

    def put(self, key: str, value: bytes, *, lease: int = 0, timeout: float | None = None) -> int:
        return self.sim.request(0.0, lambda: self.mem.put(key, value, lease=lease), proposals=1.0)

    def revision(self, *, timeout: float | None = None) -> int:
        return self.sim.request(0.0, self.mem.revision, reads=1.0)

    def lease_grant(self, ttl: int, *, keepalive: bool = True, timeout: float | None = None) -> int:
        return self.sim.request(0.0, lambda: self.mem.lease_grant(ttl), proposals=1.0)

    def lease_revoke(self, lease_id: int, *, timeout: float | None = None) -> None:
        self.sim.request(0.0, lambda: self.mem.lease_revoke(lease_id), proposals=1.0)

    def lease_ttl(self, lease_id: int, *, timeout: float | None = None) -> int:
        return self.sim.request(0.0, lambda: self.mem.lease_ttl(lease_id), reads=1.0)

    def lost_leases(self) -> set[int]:
        return set()

    def watch(self, key: str, *, prefix: bool = False, start_revision: int = 0) -> object:
        raise NotImplementedError("simulated agents receive watch events from Sim's fan-out")

    def close(self) -> None:
        pass


def changes(sim: Sim, start: int, end: int, prefix: str) -> tuple[WatchEvent, ...]:
    """The changes ``start:end`` of the log under ``prefix``."""
    return tuple(ev for ev in sim.mem.log[start:end] if ev.kv.key.startswith(prefix))
