"""The JSON records of in-process restart, kept in etcd under ``JobKeys.restart`` and in the agent's run dir.

Key layout (``R = JobKeys(ns, uid).restart + "<epoch>/"``, built by :class:`stalwart.etcd.keys.RestartKeys`;
every write is fenced by the epoch):

``R + "alive/<slot>"`` -> :class:`AliveRecord`
    One key per live rank process, bound to the process's lease (its heartbeat).
``R + "arrive/<iteration>/<slot>"`` -> :class:`ArrivalRecord`
    A rank process is ready to run ``iteration`` (the iteration barrier), bound to its lease.
``R + "seal/<iteration>"`` -> :class:`SealRecord`
    Who runs ``iteration`` under which rank, written once (create-if-absent) by the first process that sees
    the barrier complete or time out. Every process reads the same seal, so all agree on the world.
``R + "fault/<iteration>/<slot>"`` -> :class:`FaultRecord`
    A fault seen by a process in ``iteration``. The first one (lowest revision) interrupts the iteration.
``R + "done/<iteration>/<slot>"`` -> :class:`DoneRecord`
    The training function returned on this process (the completion barrier).
``R + "end/<iteration>"`` -> :class:`DoneRecord`
    Every active process of ``iteration`` returned: written by the process whose mark was the last (it counts
    the marks in the request that writes its own). The others wait for this one key.

Keys of iterations older than the previous one are deleted by the process that seals the next iteration,
so the number of keys stays bounded however many restarts happen.

``JobKeys.progress + "<nodeId>"`` -> :class:`ProgressRecord`, written by each agent (rate-limited) for the
operator. The agent reads each rank's :class:`RankStatus` from a local file, never from the network. Besides
the node's state it carries the facts the operator's status is decided from: each rank's last completed
step and progress (:class:`RankReport`), rank processes that ended on their own (:class:`RankExit`), and per
round the last iteration in which a step completed and the iterations respawned processes joined
(:class:`RoundSummary`). The operator counts recoveries and names culprits from these and from the
:class:`FaultRecord` keys; nothing there is a counter the operator adds up blindly.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, SerializationInfo, SerializerFunctionWrapHandler, model_serializer, model_validator

from stalwart.api.base import ApiModel

__all__ = [
    "MAX_EXITS",
    "MAX_HISTORY",
    "MAX_SEAL_SLOTS",
    "STACKS_SIGNAL",
    "AliveRecord",
    "ArrivalRecord",
    "DoneRecord",
    "FailureInfo",
    "FaultKind",
    "FaultRecord",
    "ProgressRecord",
    "RankExit",
    "RankReport",
    "RankStatus",
    "RoundSummary",
    "SealRecord",
    "failure_info",
    "rank_runs",
]

FaultKind = Literal["exception", "soft_timeout", "peer_lost", "unhealthy", "barrier_timeout",
                    "completion_timeout", "process_died", "hard_timeout", "stopped", "init_timeout",
                    "non_retryable", "link_down"]
"""What a fault record says happened. ``exception``: the training function raised (``exception`` and
``message`` say what); ``non_retryable``: it raised :class:`stalwart.NonRetryable` (every process of the
job then gives up: no restart can help). ``soft_timeout``: the process's main thread made no progress for
the soft timeout. ``hard_timeout``: its agent killed it after the hard timeout; ``stopped``: its agent found
it stopped (SIGSTOP) past the soft timeout and killed it; ``process_died``: it exited or was killed during the
iteration (recorded by its agent, or by its respawned successor). ``init_timeout``: the iteration's process
group was not built within its deadline. ``peer_lost``: a peer's heartbeat lease ended;
``completion_timeout``: not every rank returned in time; ``link_down``: interrupted by a peer's hang, the
process found bytes it had sent retransmitted unacknowledged (``unreachable`` names where: the link between
carries nothing); ``barrier_timeout``, ``unhealthy``: as named. The
kinds in :data:`DIRECT_KINDS` are seen at the faulty process itself (or by its agent); the others are
symptoms a peer observes."""

#: Kinds observed at the faulty process (or by its agent): when an iteration has records of both sorts, the
#: earliest of these is its cause (a peer's symptom, e.g. its own soft timeout while it waited in a collective
#: for a stopped rank, is not).
DIRECT_KINDS: frozenset[str] = frozenset({"exception", "hard_timeout", "stopped", "process_died", "unhealthy",
                                          "init_timeout", "non_retryable"})

_REASON = 2048


class AliveRecord(ApiModel):
    """A live rank process (its heartbeat key)."""

    slot: int = Field(ge=0, description="The process's slot: its fixed identity within the round.")
    node_id: str = Field(description="The node (pod) that runs the process.")
    pid: int = Field(ge=1, description="Process id, for logs.")


class ArrivalRecord(ApiModel):
    """A rank process has reached the barrier of an iteration."""

    slot: int = Field(ge=0, description="The process's slot.")
    node_id: str = Field(description="The node (pod) that runs the process.")
    spare: bool = Field(default=False, description="The process is a spare: active only when one is missing.")
    healthy: bool = Field(default=True, description="The process passed its health check.")


#: The most slots a seal's ``rankRuns`` may cover (a bound on what one record may expand to).
MAX_SEAL_SLOTS = 1 << 20


def rank_runs(ranks: Mapping[str, int]) -> list[list[int]]:
    """``ranks`` (slot -> rank) as runs ``[first slot, count, first rank]``: the slots ``first slot ..
    first slot + count - 1`` hold the ranks ``first rank ..`` in order. A world whose ranks follow its slots
    is one run, however large; each slot out of order costs one more."""
    runs: list[list[int]] = []
    for slot, rank in sorted((int(s), r) for s, r in ranks.items()):
        last = runs[-1] if runs else None
        if last is not None and last[0] + last[1] == slot and last[2] + last[1] == rank:
            last[1] += 1
        else:
            runs.append([slot, 1, rank])
    return runs


def _expand_runs(runs: object) -> dict[str, int]:
    if not isinstance(runs, list) or not all(
            isinstance(r, list) and len(r) == 3 and all(isinstance(v, int) and not isinstance(v, bool) for v in r)
            for r in runs):
        raise ValueError("rankRuns: expected a list of [first slot, count, first rank] integer triples")
    if any(first < 0 or count < 1 or rank < 0 for first, count, rank in runs):
        raise ValueError("rankRuns: expected slots and ranks >= 0 and counts >= 1")
    if sum(count for _, count, _ in runs) > MAX_SEAL_SLOTS:
        raise ValueError(f"rankRuns: more than {MAX_SEAL_SLOTS} slots")
    ranks = {str(first + i): rank + i for first, count, rank in runs for i in range(count)}
    if len(ranks) != sum(count for _, count, _ in runs):
        raise ValueError("rankRuns: a slot is given twice")
    return ranks


class SealRecord(ApiModel):
    """Who runs an iteration. ``ranks`` maps slot (as a string, JSON keys are strings) to rank.

    As JSON the map is written as ``rankRuns`` (see :func:`rank_runs`): every rank process is sent the seal of
    every iteration, and at 10,000 ranks the map alone is about 150 KB where the runs of an unchanged world
    are a few bytes. A document with ``ranks`` is read as well.
    """

    iteration: int = Field(ge=0, description="The iteration this seal is for.")
    world_size: int = Field(ge=0, description="Ranks of the iteration (0 when ``error`` is set).")
    ranks: dict[str, int] = Field(description="Slot -> rank for every active process.")
    inactive: list[int] = Field(default_factory=list, description="Slots that wait as spares this iteration.")
    sealed_by: int = Field(ge=0, description="Slot of the process that sealed.")
    timed_out: bool = Field(default=False, description="The barrier timed out: some slots did not arrive.")
    error: str = Field(default="", max_length=_REASON,
                       description="Set when no valid world could be formed (too few healthy processes).")

    @model_validator(mode="before")
    @classmethod
    def _read_runs(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        key = next((k for k in ("rankRuns", "rank_runs") if k in data), None)
        if key is None:
            return data
        if "ranks" in data:
            raise ValueError("rankRuns: expected either ranks or rankRuns, not both")
        data = dict(data)
        data["ranks"] = _expand_runs(data.pop(key))
        return data

    @model_serializer(mode="wrap")
    def _write_runs(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if "ranks" in data:
            del data["ranks"]
            data["rankRuns" if info.by_alias else "rank_runs"] = rank_runs(self.ranks)
        return data


class FaultRecord(ApiModel):
    """A fault in one process during an iteration."""

    slot: int = Field(ge=0, description="Slot of the process that saw the fault.")
    pid: int | None = Field(
        default=None, ge=1, description=("That process's id. A record its agent wrote names the dead or killed "
                                         "process, so that the one respawned in its slot takes it as a peer's."))
    rank: int | None = Field(default=None, description="Its rank in the iteration, when it had one.")
    node_id: str = Field(description="The node (pod) of the process.")
    iteration: int = Field(ge=0, description="The iteration that was interrupted.")
    kind: FaultKind = Field(description="What happened.")
    reason: str = Field(default="", max_length=_REASON, description="Exception text or timeout details.")
    exception: str | None = Field(
        default=None, max_length=512,
        description="For kind exception: the exception's type (qualified unless a builtin), e.g. ValueError.")
    message: str | None = Field(default=None, max_length=_REASON,
                                description="For kind exception: the exception's message (str of it).")
    time: float = Field(description="Wall-clock time (Unix seconds), for status only.")
    lost_slots: list[int] = Field(
        default_factory=list, max_length=4096,
        description="For peer_lost: the slots whose heartbeat lease ended (the culprits, not the reporter).")
    unreachable: list[str] = Field(
        default_factory=list, max_length=64,
        description=("For soft_timeout: the peers (``ip:port``) to which this process's group connections held sent "
                     "bytes that the kernel was retransmitting unacknowledged when the timeout fired. A hung or "
                     "paused peer's kernel still acknowledges; only a network that carries nothing does not."))


class DoneRecord(ApiModel):
    """The training function returned on a process (the completion barrier)."""

    slot: int = Field(ge=0, description="Slot of the process.")
    iteration: int = Field(ge=0, description="The iteration it completed.")


class FailureInfo(ApiModel):
    """The last failure, as the operator shows it in ``status.lastFailure``."""

    rank: int | None = Field(default=None, description="Rank that failed first, when known.")
    pod: str = Field(default="", description="The pod (node id) it ran on.")
    reason: str = Field(default="", max_length=_REASON, description="What happened.")
    kind: FaultKind | None = Field(default=None, description="The fault's kind, when a fault record says it.")
    exception: str | None = Field(default=None, max_length=512,
                                  description="The exception's type, when the training function raised.")
    message: str | None = Field(default=None, max_length=_REASON, description="The exception's message.")
    iteration: int | None = Field(default=None, ge=0, description="The restart iteration it happened in, when known.")
    time: float = Field(description="Wall-clock time (Unix seconds).")


#: The signal an agent sends a rank process it is about to kill for a hang, when its status says it takes it:
#: the process writes the stack of every thread to its stderr (the pod's log), so the log says where it hung.
STACKS_SIGNAL = signal.SIGQUIT


class RecoveryMarks(ApiModel):
    """Wall-clock times (Unix seconds) one rank process recorded of the iteration it runs: what the phases of
    a recovery are read from (:mod:`stalwart.api.recovery`). Written by the restart wrapper
    (:mod:`stalwart.restart.phase_marks`), carried by the status file and the agent's progress record."""

    epoch: int | None = Field(default=None, ge=1, description="The round (its epoch) of the iteration.")
    iteration: int = Field(ge=0, description="The in-process restart iteration these marks are of.")
    knew: float | None = Field(
        default=None, description=("When this process first learned of the fault the iteration recovers from "
                                   "(None: it learned of none, e.g. a process started for the iteration)."))
    left: float | None = Field(
        default=None, description=("When this process left the training function of the interrupted iteration (an "
                                   "interrupt waits for native compute in flight to return to Python; None: it "
                                   "ran none, e.g. a spare or a process started for the iteration)."))
    entered: float | None = Field(
        default=None, description="When the process took up the iteration's round (its handover, or its start).")
    sealed: float = Field(description="When the process passed the iteration's barrier (its rank known).")
    group: float | None = Field(default=None, description="When the iteration's process group was built.")
    prepare_start: float | None = Field(default=None, description="When the decorator's prepare hook began.")
    prepare_end: float | None = Field(default=None, description="When the prepare hook returned.")
    prepare_parked: bool = Field(default=False, description="The prepare hook ran while the process was parked.")
    copy_start: float | None = Field(
        default=None, description="When sync_from_peers began, on a rank that sent or received state in it.")
    copy_end: float | None = Field(default=None, description="When that sync_from_peers returned.")
    copy_bytes: int = Field(default=0, ge=0, description="Bytes of state it received (or sent, as a source).")
    copy_role: Literal["sent", "received"] | None = Field(
        default=None, description="Whether the process sent or received state in the iteration.")
    copy_sources: int = Field(default=0, ge=0, description="How many ranks sent a part of the state.")


class RankStatus(ApiModel):
    """What one rank process tells its agent, through a file the agent reads (atomically replaced)."""

    slot: int = Field(ge=0, description="The process's slot.")
    pid: int = Field(ge=1, description="Process id.")
    state: Literal["starting", "barrier", "running", "inactive", "restarting", "done", "failed"] = Field(
        description="Where the process is.")
    epoch: int | None = Field(
        default=None, ge=1, description="The round (its epoch) the process runs in; none while it is parked.")
    iteration: int = Field(default=0, ge=0, description="Current in-process restart iteration (of that round).")
    rank: int | None = Field(default=None, description="Rank in the current iteration (none while inactive).")
    world_size: int | None = Field(default=None, description="World size of the current iteration.")
    step: int | None = Field(default=None, description="Last step the training function reported.")
    step_time: float | None = Field(default=None, description="Wall-clock time that step was reported.")
    first_step: int | None = Field(
        default=None, description="The first step reported in the current iteration (None before it).")
    first_step_time: float | None = Field(default=None, description="Wall-clock time of that first step.")
    restarts: int = Field(default=0, ge=0, description="In-process restarts so far.")
    last_failure: FailureInfo | None = Field(default=None, description="The last fault this process saw.")
    soft_timeout: float | None = Field(
        default=None, description="Seconds without progress after which the iteration is interrupted.")
    hard_timeout: float | None = Field(
        default=None, description=("Seconds without progress after which the agent kills the process: the hard "
                                   "timeout, longer before an iteration's first ping by the startup allowance."))
    stall_limit: float | None = Field(
        default=None, gt=0,
        description=("Seconds without progress after which the process counts its iteration hung now: the soft "
                     "timeout once it pinged in the iteration, the startup allowance before (its group may wait "
                     "for a peer that is still starting)."))
    heartbeat: float = Field(
        description="CLOCK_MONOTONIC time of the last sign of progress of the process's main thread.")
    dumps_stacks: bool = Field(
        default=False, description="The process writes its threads' stacks to stderr on STACKS_SIGNAL.")
    snapshot_step: int | None = Field(
        default=None, ge=0, description="The newest step of this rank's peer snapshot that landed on its buddy.")
    snapshot_time: float | None = Field(default=None, description="Wall-clock time that copy landed.")
    snapshot_fallback: str | None = Field(
        default=None, max_length=300,
        description="Why the last restore of peer snapshots found none to use (the checkpoint's turn).")
    exiting: float | None = Field(
        default=None, description="CLOCK_MONOTONIC time the process's interpreter began to exit (its script "
                                  "ended); the agent bounds the exit from then on.")
    recovery: RecoveryMarks | None = Field(
        default=None, description="The marks of the iteration the process runs (the phases of its recovery).")
    lease: int | None = Field(
        default=None, ge=1, le=2**63 - 1,
        description=("The pod's liveness lease its alive key is bound to, when its agent lent it one: the agent "
                     "then ends that key (and its arrivals) when the process dies or stops writing this file."))
    written: float | None = Field(
        default=None, description="CLOCK_MONOTONIC time this file was last written (its monitor writes it twice a "
                                  "second while the process runs).")


#: Most rank exits a progress record keeps (the newest).
MAX_EXITS = 8
#: Most rounds a progress record summarises (the newest): enough for an operator that was away for a few.
MAX_HISTORY = 4

RankState = Literal["starting", "barrier", "running", "inactive", "restarting", "done", "failed"]


class RankReport(ApiModel):
    """One local rank process as its agent last saw it."""

    local_rank: int = Field(ge=0, description="Local rank on the node.")
    slot: int = Field(ge=0, description="The process's slot (its identity within the round).")
    rank: int | None = Field(default=None, description="Global rank in the current iteration (None while inactive).")
    pid: int = Field(ge=1, description="Process id.")
    state: RankState | None = Field(default=None, description="What its status file says (None: none written yet).")
    iteration: int = Field(default=0, ge=0, description="Its in-process restart iteration.")
    step: int | None = Field(default=None, description="Last step it reported.")
    step_time: float | None = Field(default=None, description="Wall-clock time of that step.")
    first_step: int | None = Field(default=None, description="First step it reported in this iteration.")
    first_step_time: float | None = Field(default=None, description="Wall-clock time of that first step.")
    progress_time: float | None = Field(
        default=None, description="Wall-clock time of the last progress of its main thread (None: unknown).")
    snapshot_step: int | None = Field(
        default=None, ge=0, description="The newest step of its peer snapshot that landed on its buddy.")
    snapshot_time: float | None = Field(default=None, description="Wall-clock time that copy landed.")
    snapshot_fallback: str | None = Field(
        default=None, max_length=300, description="Why its last restore found no peer snapshot to use.")
    soft_timeout: float | None = Field(
        default=None, gt=0, description=("The soft timeout the process itself uses (a @restartable(soft_timeout=...) "
                                         "may differ from the spec's); None: unknown, the spec's applies."))
    stall_limit: float | None = Field(
        default=None, gt=0,
        description=("The limit the process judges itself by now (RankStatus.stall_limit): above the soft timeout "
                     "before the iteration's first ping; None: unknown, the soft timeout applies."))
    recovery: RecoveryMarks | None = Field(
        default=None, description="The marks of the iteration it runs (the phases of its recovery).")


class RankExit(ApiModel):
    """A rank process that ended on its own (not stopped by its agent), and where it was."""

    local_rank: int = Field(ge=0, description="Local rank on the node.")
    slot: int = Field(ge=0, description="The process's slot.")
    rank: int | None = Field(default=None, description="Its global rank when it ended, when known.")
    round: int = Field(ge=0, description="Rendezvous round.")
    iteration: int = Field(default=0, ge=0, description="The iteration it was in.")
    pid: int = Field(ge=1, description="Process id.")
    exit_code: int | None = Field(default=None, description="Exit code (None when a signal ended it).")
    signal: str | None = Field(default=None, max_length=16, description="The signal that ended it, e.g. SIGKILL.")
    hung: bool = Field(default=False, description="The agent killed it: no progress within its hard timeout.")
    time: float = Field(description="Wall-clock time the agent saw it end (Unix seconds).")


class RoundSummary(ApiModel):
    """What a node saw of one round: how far training got and which iterations needed new processes."""

    round: int = Field(ge=0, description="Rendezvous round.")
    epoch: int = Field(ge=0, description="Its epoch.")
    stepped: int | None = Field(
        default=None, description="The last in-process iteration in which one of the node's ranks completed a step.")
    faulted: int | None = Field(
        default=None,
        description="The last iteration one of the node's ranks ran its training function in that ended in a fault.")
    respawned: list[int] = Field(
        default_factory=list, max_length=1024,
        description="Iterations that respawned rank processes of this node joined (process restarts).")
    kept: bool = Field(
        default=False,
        description=("The node's rank processes entered the round already running (handed over from its last "
                     "round, or a warm spare's parked processes): none was started for it."))
    joined: float | None = Field(default=None, description="Wall-clock time the node's agent joined the round.")
    previous_end_seen: float | None = Field(
        default=None, description="Wall-clock time the node's agent saw the round it ran before this one end.")


class ProgressRecord(ApiModel):
    """An agent's progress report, one per node, read by the operator."""

    node_id: str = Field(description="The reporting node (pod).")
    epoch: int = Field(ge=0, description="Epoch of the node's current rendezvous round (0 before the first).")
    round: int = Field(ge=0, description="Rendezvous round number.")
    state: Literal["joining", "running", "restarting", "succeeded", "failed"] = Field(
        description="The node's state.")
    step: int | None = Field(default=None, description="Highest step reported by the node's ranks.")
    world_size: int | None = Field(default=None, description="World size of the current iteration.")
    restarts_in_process: int = Field(default=0, ge=0, description="In-process restarts seen by the node.")
    process_restarts: int = Field(default=0, ge=0, description="Rank processes respawned by the agent.")
    respawns_unplaced: int = Field(
        default=0, ge=0, description=("Rank processes respawned in this round that have not yet said which "
                                      "iteration they joined (the operator counts no recovery of the round "
                                      "until they have)."))
    last_failure: FailureInfo | None = Field(default=None, description="The node's most recent failure.")
    updated: float = Field(description="Wall-clock time (Unix seconds) of this report.")
    incarnation: str = Field(default="", max_length=64,
                             description="Identity of the reporting agent process (a new one after a restart).")
    ranks: list[RankReport] = Field(default_factory=list, max_length=1024, description="The node's rank processes.")
    exits: list[RankExit] = Field(default_factory=list, max_length=MAX_EXITS,
                                  description="Rank processes that ended on their own, newest last.")
    history: list[RoundSummary] = Field(default_factory=list, max_length=MAX_HISTORY,
                                        description="The node's last rounds, oldest first.")
    parked_failure: FailureInfo | None = Field(
        default=None, description=("The last parked process of the node (a warm spare's, or its standby) that "
                                   "ended before a round took it: its prepare hook raised (the exception), or it "
                                   "died. Not a failure of the running job."))


def failure_info(rec: FaultRecord) -> FailureInfo:
    """The :class:`FailureInfo` (status form) of a fault record."""
    return FailureInfo(rank=rec.rank, pod=rec.node_id, reason=f"{rec.kind}: {rec.reason}"[:_REASON], kind=rec.kind,
                       exception=rec.exception, message=rec.message, iteration=rec.iteration, time=rec.time)
