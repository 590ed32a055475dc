"""The in-process restart protocol as pure functions over frozen records: what etcd holds for a round
(:class:`EpochView`) and who this process is (:class:`Participant`) in, the next step and the writes to make
out.

Nothing here does I/O or reads a clock; the wrapper (:mod:`.wrapper`) and the coordinator
(:mod:`.coordination`) read etcd, carry out what these functions return and wait for what they say to wait
for. One iteration of one process goes:

1. :func:`join` says where a (re)started process enters the round;
2. :func:`budget_left` whether it may start another iteration; it arrives at the barrier, which is over when
   :func:`barrier_state` says so (sealed by someone, or complete); an unsealed barrier is sealed with
   :func:`plan_seal` (create-if-absent: every process then reads the same seal);
3. :func:`placement` says what the seal means for this process: run a rank, wait as a spare, or exit;
4. a spare, or a rank whose function returned, waits until :func:`iteration_end` says the iteration ended;
5. a rank whose function failed reports what :func:`fault_report` says (nothing when the failure is a
   consequence of a peer's fault), and takes the iteration's cause (:func:`verdict`) before the next barrier.

Keys of iterations before the previous one are removed by the process that seals (:func:`stale_iterations`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from stalwart.api.exit_codes import ExitCode
from stalwart.api.restart import (
    DIRECT_KINDS,
    AliveRecord,
    ArrivalRecord,
    DoneRecord,
    FaultKind,
    FaultRecord,
    SealRecord,
)
from stalwart.etcd.keys import ALIVE, ARRIVE, DONE, END, FAULT, SEAL
from stalwart.etcd.records import WatchRange
from stalwart.restart.assignment import Candidate, RankAssignment, WorldTooSmall, initial_ranks

__all__ = [
    "Arrived",
    "EpochView",
    "Exit",
    "Finished",
    "Join",
    "Participant",
    "Report",
    "Run",
    "Spare",
    "WaitEnd",
    "apply_changes",
    "barrier_complete",
    "barrier_sealer",
    "barrier_state",
    "better_cause",
    "budget_left",
    "completes",
    "completion_known",
    "fault_report",
    "iteration_end",
    "join",
    "missing_slots",
    "of_another",
    "parse_view",
    "placement",
    "plan_seal",
    "sealer_parts",
    "stale_iterations",
    "unhealthy_seal",
    "verdict",
]

# -- what etcd holds ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EpochView:
    """What etcd holds for one round's restart prefix, parsed (as of etcd revision ``revision``).

    ``faults`` keeps each iteration's records with their mod_revision, oldest first. The mappings must not be
    mutated: :func:`parse_view` builds a new view.
    """

    revision: int = 0
    alive: Mapping[int, AliveRecord] = field(default_factory=dict)
    arrivals: Mapping[int, Mapping[int, ArrivalRecord]] = field(default_factory=dict)
    seals: Mapping[int, SealRecord] = field(default_factory=dict)
    faults: Mapping[int, tuple[tuple[int, FaultRecord], ...]] = field(default_factory=dict)
    done: Mapping[int, frozenset[int]] = field(default_factory=dict)
    #: Iterations whose END record says every active process returned.
    ended: frozenset[int] = frozenset()

    def first_fault(self, iteration: int) -> FaultRecord | None:
        faults = self.faults.get(iteration, ())
        return faults[0][1] if faults else None

    def cause(self, iteration: int) -> FaultRecord | None:
        """The iteration's cause: its first fault of a kind seen at the faulty process (``DIRECT_KINDS``),
        else its first fault."""
        faults = [rec for _, rec in self.faults.get(iteration, ())]
        return next((rec for rec in faults if rec.kind in DIRECT_KINDS), faults[0] if faults else None)

    def faults_of_others(self, iteration: int, slot: int, pid: int | None = None) -> list[FaultRecord]:
        """The faults recorded in ``iteration`` about processes other than this one (``slot``, ``pid``), oldest
        first (see :func:`of_another`)."""
        return [rec for _, rec in self.faults.get(iteration, ()) if of_another(rec, slot, pid)]


_Record = AliveRecord | ArrivalRecord | SealRecord | FaultRecord | DoneRecord | None

#: The record model of each kind of key (a DONE mark is its key) and how many numbers its key holds. Built once:
#: a sealer parses every key of the epoch (30,000 at 10,000 ranks), and these were a fifth of each parse.
_MODELS: dict[str, type[AliveRecord | ArrivalRecord | SealRecord | FaultRecord | DoneRecord] | None] = {
    ALIVE: AliveRecord, ARRIVE: ArrivalRecord, SEAL: SealRecord, FAULT: FaultRecord, DONE: None, END: DoneRecord}
_WIDTHS = {ALIVE: 1, SEAL: 1, ARRIVE: 2, FAULT: 2, DONE: 2, END: 1}


def _parse_entry(key: str, value: bytes | None) -> tuple[str, tuple[int, ...], _Record] | None:
    """The kind, the numbers in ``key`` (relative to the round's restart prefix) and the record of ``value``
    (``None`` for a deletion, and for a DONE mark, which is its key); ``None`` for a key of no kind. Raises
    ``ValueError`` for a record that cannot be read."""
    kind, _, rest = key.partition("/")
    parts = rest.split("/")
    kind += "/"
    if kind not in _MODELS or len(parts) != _WIDTHS[kind]:
        return None
    numbers = tuple(int(p) for p in parts)
    cls = _MODELS[kind]
    return kind, numbers, (cls.from_json_bytes(value) if cls is not None and value is not None else None)


def parse_view(entries: Iterable[tuple[str, bytes, int]], revision: int) -> tuple[EpochView, dict[str, str]]:
    """The view of ``entries`` (key relative to the round's restart prefix, value, mod_revision) read at
    ``revision``, and the records that could not be read (relative key -> why): those are left out."""
    return apply_changes(EpochView(), ((key, value, mod) for key, value, mod in entries), revision)


def apply_changes(view: EpochView, changes: Iterable[tuple[str, bytes | None, int]],
                  revision: int) -> tuple[EpochView, dict[str, str]]:
    """``view`` after ``changes`` (key relative to the round's restart prefix, value or ``None`` for a
    deletion, mod_revision), in the order etcd made them, as of ``revision``; and the records that could not be
    read (left out, as :func:`parse_view` does). A watcher keeps its view current this way instead of reading
    the prefix again after each change: the result equals :func:`parse_view` of what etcd then holds."""
    alive = dict(view.alive)
    arrivals = {it: dict(a) for it, a in view.arrivals.items()}
    seals = dict(view.seals)
    faults = {it: list(fs) for it, fs in view.faults.items()}
    done = {it: set(slots) for it, slots in view.done.items()}
    ended = set(view.ended)
    problems: dict[str, str] = {}
    for key, new_value, mod_revision in changes:
        value = new_value
        try:
            parsed = _parse_entry(key, value)
        except ValueError as e:
            problems[key] = str(e)
            try:  # an unreadable record is left out: it replaces what was there as a deletion would
                parsed = _parse_entry(key, None)
            except ValueError:
                continue
            value = None
        if parsed is None:
            continue
        kind, numbers, rec = parsed
        if kind == ALIVE:
            _set(alive, numbers[0], rec if value is not None else None)
        elif kind == SEAL:
            _set(seals, numbers[0], rec if value is not None else None)
        elif kind == END:
            (ended.add if value is not None else ended.discard)(numbers[0])
        elif kind == ARRIVE:
            _set(arrivals.setdefault(numbers[0], {}), numbers[1], rec if value is not None else None)
        elif kind == FAULT:
            kept = [f for f in faults.get(numbers[0], []) if f[1].slot != numbers[1]]
            if value is not None:
                assert isinstance(rec, FaultRecord)
                kept.append((mod_revision, rec))
            faults[numbers[0]] = kept
        else:
            slots = done.setdefault(numbers[0], set())
            if value is not None:
                slots.add(numbers[1])
            else:
                slots.discard(numbers[1])
    return EpochView(revision=revision, alive=alive,
                     arrivals={it: a for it, a in arrivals.items() if a},
                     seals=seals,
                     faults={it: tuple(sorted(fs, key=lambda f: f[0])) for it, fs in faults.items() if fs},
                     done={it: frozenset(slots) for it, slots in done.items() if slots},
                     ended=frozenset(ended)), problems


def _set(mapping: dict[int, Any], key: int, rec: object) -> None:
    if rec is None:
        mapping.pop(key, None)
    else:
        mapping[key] = rec


# -- who this process is --------------------------------------------------------------------------------------


def of_another(rec: FaultRecord, slot: int, pid: int | None) -> bool:
    """Whether ``rec`` is about a process other than this one (``slot``, ``pid``): another slot's, or its agent's
    record of the process that held this slot before (killed or dead, this one was respawned in its place)."""
    return rec.slot != slot or (pid is not None and rec.pid is not None and rec.pid != pid)


@dataclass(frozen=True, slots=True)
class Participant:
    """One rank process in its round: its ``slot`` of ``slots``, its node, whether it is a spare, and the
    world the round aims at (``target_world`` ranks)."""

    slot: int
    node_id: str
    slots: int
    target_world: int
    spare: bool = False


@dataclass(frozen=True, slots=True)
class Report:
    """Write a fault record of this process (the shell adds the time, and the exception when there is one)."""

    iteration: int
    rank: int | None
    kind: FaultKind
    reason: str
    lost_slots: tuple[int, ...] = ()
    unreachable: tuple[str, ...] = ()

    def record(self, slot: int, node_id: str, time: float, *, pid: int | None = None, exception: str | None = None,
               message: str | None = None) -> FaultRecord:
        """The record of this report by the process ``pid`` of ``slot`` on ``node_id``, at wall-clock ``time``."""
        return FaultRecord(slot=slot, pid=pid, rank=self.rank, node_id=node_id, iteration=self.iteration,
                           kind=self.kind, reason=self.reason[:2048], time=time, lost_slots=list(self.lost_slots),
                           unreachable=list(self.unreachable[:64]),
                           exception=None if exception is None else exception[:512],
                           message=None if message is None else message[:2048])


@dataclass(frozen=True, slots=True)
class Exit:
    """Give up: the process exits with ``code``."""

    code: ExitCode
    reason: str


# -- where a process enters ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Join:
    """Go to the barrier of ``iteration``, after writing ``report`` when there is one."""

    iteration: int
    report: Report | None = None


@dataclass(frozen=True, slots=True)
class WaitEnd:
    """Wait as a spare until ``iteration`` (sealed as ``seal``) ends; then finish, or join the next one."""

    iteration: int
    seal: SealRecord


@dataclass(frozen=True, slots=True)
class Finished:
    """The job's function returned on every active process: nothing left to run."""


def join(view: EpochView, me: Participant) -> Join | WaitEnd | Finished | Exit:
    """Where a (re)started process joins: iteration 0 at the round's start (or the barrier under way); after a
    respawn, the next iteration, reporting the current one as faulted when this slot was running in it."""
    if not view.seals:
        return Join(max(view.arrivals, default=0))
    latest = max(view.seals)
    seal = view.seals[latest]
    if seal.error:
        return Exit(ExitCode.WORLD_TOO_SMALL, seal.error)
    if latest + 1 in view.arrivals:
        return Join(latest + 1)
    if latest in view.ended:
        # Every active process returned and the end is recorded: a process that died afterwards (in its
        # teardown), and a fault recorded for it, end nothing.
        return Finished()
    if latest in view.faults:
        return Join(latest + 1)
    if {int(s) for s in seal.ranks} <= view.done.get(latest, frozenset()):
        return Finished()
    mine = str(me.slot)
    if mine in seal.ranks:
        # The process that held this slot died during the iteration: the iteration cannot finish.
        return Join(latest + 1, Report(latest, seal.ranks[mine], "process_died",
                                       "the process of this slot was restarted"))
    return WaitEnd(latest, seal)


def budget_left(iteration: int, max_restarts: int, last_cause: str = "") -> Exit | None:
    """``None`` while ``iteration`` is within the restart budget (iteration n is the n-th restart)."""
    if iteration <= max_restarts:
        return None
    last = f"; the last failure: {last_cause}" if last_cause else ""
    return Exit(ExitCode.RESTARTS_EXHAUSTED, f"{iteration} in-process restarts; max_restarts is {max_restarts}{last}")


# -- the barrier ---------------------------------------------------------------------------------------------


def barrier_complete(view: EpochView, iteration: int, slots: int) -> bool:
    """Whether every slot the barrier of ``iteration`` waits for has arrived.

    A slot that took no part in the last iteration and has no live process is not waited for again.
    Arrivals are bound to their process's lease and vanish with it, so the last seal (which is not) also
    says who took part: a process cut off from etcd for a moment is waited for, and comes back with a new
    lease, instead of being dropped from the world.
    """
    expected = set(range(slots))
    previous = view.arrivals.get(iteration - 1)
    if previous is not None:
        took_part = set(previous)
        last_seal = view.seals.get(iteration - 1)
        if last_seal is not None:
            took_part |= {int(s) for s in last_seal.ranks} | set(last_seal.inactive)
        expected -= {s for s in expected if s not in took_part and s not in view.alive}
    return expected <= set(view.arrivals.get(iteration, {}))


def barrier_sealer(previous: SealRecord | None) -> int:
    """The slot whose process watches the arrivals at the barrier after the iteration of ``previous`` (its
    seal; ``None`` before the first) and seals it; the others watch only for the seal.

    It is the lowest slot that took part in the previous iteration (slot 0 at the first barrier):
    :func:`barrier_complete` waits for every such slot, so the barrier cannot complete without this one's
    process there, watching. A process of it that dies is respawned and arrives again as the sealer; one that
    never comes back leaves the barrier incomplete, and every process seals at its barrier timeout, as any
    incomplete barrier ends.
    """
    if previous is None or previous.error:
        return 0
    return min([int(s) for s in previous.ranks] + list(previous.inactive), default=0)


def sealer_parts(iteration: int, previous: SealRecord | None, slots: int) -> list[WatchRange] | None:
    """What the sealer of the barrier of ``iteration`` (whose previous seal is ``previous``) reads with its
    arrival and then watches, as parts of the round's restart prefix; ``None``: all of it.

    :func:`barrier_state` and :func:`plan_seal` look at this barrier's arrivals and seal and at the previous
    seal; who took part in the previous iteration and who is alive (:func:`barrier_complete`) change nothing
    while the previous seal places every slot (as a rank or inactive): each is then waited for whatever else
    etcd holds. So only when a slot missed the last barrier (or there is no valid seal to go by) is the whole
    prefix read and watched. At 16,384 ranks this leaves out the heartbeats and the previous iteration's
    arrivals: 32,768 of the 49,000 records the sealer parsed on its critical path.
    """
    here = [WatchRange(f"{ARRIVE}{iteration}/", prefix=True), WatchRange(f"{SEAL}{iteration}")]
    if iteration == 0:
        return here
    if previous is None or previous.error or previous.iteration != iteration - 1:
        return None
    placed = {int(s) for s in previous.ranks} | set(previous.inactive)
    if not placed >= set(range(slots)):
        return None
    return [*here, WatchRange(f"{SEAL}{iteration - 1}")]


@dataclass(frozen=True, slots=True)
class Arrived:
    """Every slot the barrier waits for arrived and no one sealed yet: seal it (:func:`plan_seal`)."""


def barrier_state(view: EpochView, iteration: int, slots: int) -> SealRecord | Arrived | None:
    """The barrier of ``iteration``: its seal once written, :class:`Arrived` when it may be sealed, ``None``
    while it waits."""
    seal = view.seals.get(iteration)
    if seal is not None:
        return seal
    return Arrived() if barrier_complete(view, iteration, slots) else None


def missing_slots(view: EpochView, iteration: int, slots: int) -> list[int]:
    """The slots that have not arrived at the barrier of ``iteration``."""
    return sorted(set(range(slots)) - set(view.arrivals.get(iteration, {})))


def unhealthy_seal(iteration: int, me: Participant) -> SealRecord:
    """What an unhealthy process takes as its seal: it arrived (saying so) and leaves without waiting."""
    return SealRecord(iteration=iteration, world_size=0, ranks={}, sealed_by=me.slot, error="unhealthy")


def plan_seal(view: EpochView, iteration: int, me: Participant, policy: RankAssignment,
              timed_out: bool) -> SealRecord:
    """The seal of ``iteration`` over the processes that arrived: ``policy`` places them, starting from the
    last valid seal's ranks (or every slot in its own rank at first). A world too small is a seal with
    ``error`` set: every process then exits ``WORLD_TOO_SMALL``."""
    arrivals = view.arrivals.get(iteration, {})
    previous_seal = view.seals.get(iteration - 1)
    if previous_seal is not None and not previous_seal.error:
        previous = {int(s): r for s, r in previous_seal.ranks.items()}
    else:
        previous = initial_ranks(me.target_world)
    candidates = [Candidate(slot=a.slot, spare=a.spare, healthy=a.healthy) for a in arrivals.values()]
    try:
        a = policy.assign(candidates, previous, me.target_world)
    except WorldTooSmall as e:
        return SealRecord(iteration=iteration, world_size=0, ranks={}, sealed_by=me.slot, timed_out=timed_out,
                          error=str(e))
    return SealRecord(iteration=iteration, world_size=a.world_size, ranks={str(s): r for s, r in a.ranks.items()},
                      inactive=a.inactive, sealed_by=me.slot, timed_out=timed_out)


def stale_iterations(sealed: int) -> range:
    """The iterations whose keys (and torch Stores) the sealer of ``sealed`` removes: the two before the
    previous one (a range already removed is removed again harmlessly; the count of keys stays bounded)."""
    before = sealed - 1
    return range(max(0, before - 2), before) if before > 0 else range(0)


@dataclass(frozen=True, slots=True)
class Run:
    """Run the function as ``rank`` of ``world_size``; ``active`` are the slots running the iteration."""

    rank: int
    world_size: int
    active: frozenset[int]


@dataclass(frozen=True, slots=True)
class Spare:
    """Not placed in this iteration: wait until it ends."""

    seal: SealRecord


def placement(seal: SealRecord, me: Participant, healthy: bool, why: str = "") -> Run | Spare | Exit:
    """What the seal of an iteration means for this process (``healthy``: it passed its health check)."""
    if not healthy:
        return Exit(ExitCode.UNHEALTHY, why)
    if seal.error:
        return Exit(ExitCode.WORLD_TOO_SMALL, seal.error)
    rank = seal.ranks.get(str(me.slot))
    if rank is None:
        return Spare(seal)
    return Run(rank, seal.world_size, frozenset(int(s) for s in seal.ranks))


# -- the end of an iteration ---------------------------------------------------------------------------------


Outcome = Literal["done", "fault"]


def iteration_end(view: EpochView, seal: SealRecord, me: Participant) -> tuple[Outcome, Report | None] | None:
    """Whether the iteration of ``seal`` ended: ``"done"`` (every active process returned) or ``"fault"`` (a
    fault was reported, or an active process that had not returned lost its heartbeat lease: then this
    process reports it); ``None`` while it runs."""
    iteration = seal.iteration
    if view.faults.get(iteration):
        return "fault", None
    if iteration in view.ended:
        return "done", None
    active = {int(s) for s in seal.ranks}
    done = view.done.get(iteration, frozenset())
    if active <= done:
        return "done", None
    lost = tuple(sorted(s for s in active - done if s not in view.alive))
    if lost:
        return "fault", Report(iteration, seal.ranks.get(str(me.slot)), "peer_lost",
                               f"the heartbeat lease of slot(s) {list(lost)} ended", lost)
    return None


def completion_known(view: EpochView, iteration: int) -> Outcome | None:
    """What a process that waits for ``iteration`` to end learns from its fault records and its END record
    alone (it is not sent the completion marks and heartbeats of every process): ``"fault"``, ``"done"``, or
    ``None`` while neither is written. A heartbeat's deletion meanwhile is judged on a full read, by
    :func:`iteration_end`."""
    if view.faults.get(iteration):
        return "fault"
    return "done" if iteration in view.ended else None


def completes(marks: int, seal: SealRecord) -> bool:
    """Whether ``marks`` completion marks of the iteration of ``seal`` (counted in the transaction that wrote
    one of them) are every active process's: the process whose mark it was writes the END record."""
    return bool(seal.ranks) and marks >= len(seal.ranks)


def fault_report(iteration: int, rank: int, *, interrupted: bool, peer_fault: FaultRecord | None,
                 init_deadline_hit: bool, barrier_timeout: float, error: str) -> Report | None:
    """What an iteration's failure (``error``, its repr) is to report: nothing when the iteration was
    interrupted (someone reported already) or the failure followed a peer's fault (``peer_fault``: most likely
    its consequence, the peer's abort broke this process's collectives); else the process's own fault, as
    an ``init_timeout`` when building the process group ran past its deadline."""
    if interrupted or peer_fault is not None:
        return None
    if init_deadline_hit:
        return Report(iteration, rank, "init_timeout",
                      f"the process group was not built within {barrier_timeout:g}s: {error}")
    return Report(iteration, rank, "exception", error)


def verdict(cause: FaultRecord | None, describe: str) -> Exit | None:
    """What the cause of an interrupted iteration means for every process: a ``non_retryable`` fault
    anywhere ends them all (no restart can help); ``describe`` is the cause in words."""
    if cause is not None and cause.kind == "non_retryable":
        return Exit(ExitCode.NON_RETRYABLE, describe)
    return None


# -- the monitor's decisions ----------------------------------------------------------------------------------


def better_cause(known: FaultRecord | None, rec: FaultRecord) -> bool:
    """Whether ``rec`` says more about its iteration's cause than the one ``known`` so far: the first record,
    or the first of a kind seen at the faulty process after only symptoms."""
    return known is None or (rec.kind in DIRECT_KINDS and known.kind not in DIRECT_KINDS)
