"""Whether this pod recovers a lost peer in process: survivors keep their processes, spares park theirs.

``restartPolicy.inProcess.warmSpares`` says so where the job sets it. Unset, it is on for a job with spares:
a script wrapped with ``@stalwart.restartable`` already handles being called again in the same process, so
pod loss should not cost a process start. Only a wrapped script can wait parked, though, and a spare cannot
tell from the command line whether the script is wrapped; a process of an unwrapped script started early
would run the script outside any round. So, unset, a spare parks its processes only once a worker's ranks have
shown that they run the wrapper: their agents report each rank's status file, which only the wrapper writes
(:func:`shows_wrapper`). Until then, and for a script without the wrapper, the spare starts its processes
when a round takes it, as without warm spares; survivors keep theirs only when every one of them runs the
wrapper (:func:`~stalwart.agent.handover.keep_at_round_end`).

A pod that arrives while the job runs on after a loss (a lost pod's replacement, :func:`joins_late`) becomes a
spare of a round that has just recovered: its survivors and promoted spare are about to take their first step,
the one that costs the most, and on the same machines. Its fork server's imports and its parked processes'
``prepare`` hooks (the model built) would take cores from that step (measured: 1.75-2.5 CPU-seconds of a
replacement pod's start inside the first step at 100 M parameters, the step 1.5-1.9 s longer than the others).
So such a pod starts neither until every member's ranks have stepped in the round (:func:`round_stepped`), or
until :data:`SETTLE_LIMIT` has passed, for a script that reports no steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from stalwart.agent.rendezvous.view import View
from stalwart.api.job_record import JobRecord
from stalwart.api.restart import ProgressRecord
from stalwart.api.spec import warm_spares_on
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store, StoreError

log = logging.getLogger(__name__)

__all__ = ["SETTLE_LIMIT", "SteppedProbe", "WrapperProbe", "joins_late", "keeps_processes", "park_now",
           "round_stepped", "shows_wrapper"]

#: The longest a pod that joined a running job waits for the round's ranks to step before it starts its fork
#: server and parks: a spare that is cold for longer is a spare a second loss would find cold.
SETTLE_LIMIT = 30.0


def keeps_processes(forced: bool, record: JobRecord | None, *, spare_ranks: bool = False) -> bool:
    """Whether a pod that stays keeps its processes at a round's end (if they all run the wrapper): the agent
    was told so (``--warm-spares``), or the job's setting, or, unset, the job has spares, unless the agent runs
    its spares' ranks inside the rounds (``--spare-ranks``, which keeps them running its own way). Pure."""
    if forced:
        return True
    if record is None or (record.warm_spares is None and spare_ranks):
        return False
    return warm_spares_on(record.warm_spares, len(record.spares))


def park_now(forced: bool, record: JobRecord | None, wrapper_shown: Callable[[], bool]) -> bool:
    """Whether a spare (or a node waiting outside the round) starts its processes parked now. With the
    setting unset, only once ``wrapper_shown()`` (asked only then). Pure but for that call."""
    if forced:
        return True
    if record is None:
        return False
    if record.warm_spares is not None:
        return record.warm_spares
    return len(record.spares) > 0 and wrapper_shown()


def shows_wrapper(progress: Iterable[ProgressRecord]) -> bool:
    """Whether some node's report shows a rank process that wrote a status file (only the restart wrapper
    writes one). Pure."""
    return any(r.state is not None for rec in progress for r in rec.ranks)


def joins_late(view: View, node_id: str) -> bool:
    """Whether this node arrives while the job runs on after a loss: a round later than the first was sealed
    before it came, without it (a lost pod's replacement). A pod of the job's first round that comes after its
    seal (a spare scheduled late) is not: no recovered round's first step is under way, and the spare is wanted
    warm early. (A view that does not hold the node's part of a large round cannot tell: not late.) Pure."""
    r = view.sealed
    return (r is not None and r.header.round > 1 and r.knows(node_id) and node_id not in r.members
            and node_id not in r.spares)


def round_stepped(progress: Iterable[ProgressRecord], epoch: int, members: int) -> bool:
    """Whether ``members`` nodes report, in the round of ``epoch``, ranks that each took a step after their first
    in the round: the round's first step, the costly one, is behind it. (A count, not names: a spare of a large
    round does not hold its member list. Only members report ranks with a place in the round.) Pure."""
    def has_stepped(rec: ProgressRecord) -> bool:
        active = [r for r in rec.ranks if r.rank is not None]  # an inactive rank (a spare slot) takes no steps
        return bool(active) and all(
            r.step is not None and r.first_step is not None and r.step > r.first_step for r in active)

    return members > 0 and sum(1 for rec in progress if rec.epoch == epoch and has_stepped(rec)) >= members


class _ReportsProbe:
    """Reads the job's progress reports, at most every ``interval`` seconds, until :meth:`_holds` says yes;
    from then on answers True without reading. Unreadable reports count as not yet."""

    def __init__(self, store: Store, keys: JobKeys, *, interval: float, context: str) -> None:
        self._store, self._keys, self._interval, self._ctx = store, keys, interval, context
        self._held = False
        self._read_at = float("-inf")

    def _holds(self, reports: list[ProgressRecord]) -> bool:
        raise NotImplementedError

    def __call__(self) -> bool:
        now = time.monotonic()
        if self._held or now - self._read_at < self._interval:
            return self._held
        self._read_at = now
        try:
            kvs, _ = self._store.get_prefix(self._keys.progress)
        except StoreError as e:
            log.debug("%s: cannot read the job's progress reports: %s", self._ctx, e)
            return False
        reports = []
        for kv in kvs:
            try:
                reports.append(ProgressRecord.from_json_bytes(kv.value))
            except ValueError:
                continue  # one bad report does not hide the others
        self._held = self._holds(reports)
        return self._held


class WrapperProbe(_ReportsProbe):
    """Whether some worker's ranks have shown the restart wrapper (:func:`shows_wrapper`)."""

    def __init__(self, store: Store, keys: JobKeys, *, interval: float = 2.0, context: str = "") -> None:
        super().__init__(store, keys, interval=interval, context=context)

    def _holds(self, reports: list[ProgressRecord]) -> bool:
        if shown := shows_wrapper(reports):
            log.info("%s: the workers' ranks run the restart wrapper: parking this spare's processes", self._ctx)
        return shown


class SteppedProbe(_ReportsProbe):
    """Whether the round of ``epoch`` has stepped (:func:`round_stepped`), or ``limit`` seconds have passed
    since the probe was made."""

    def __init__(self, store: Store, keys: JobKeys, epoch: int, members: int, *,
                 limit: float = SETTLE_LIMIT, interval: float = 1.0, context: str = "") -> None:
        super().__init__(store, keys, interval=interval, context=context)
        self._epoch, self._members = epoch, members
        self._until = time.monotonic() + limit
        self._limit = limit

    def __call__(self) -> bool:
        if not self._held and time.monotonic() >= self._until:
            self._held = True
            log.info("%s: the round's ranks reported no second step in %.0f s: starting this spare's processes "
                     "anyway", self._ctx, self._limit)
        return super().__call__()

    def _holds(self, reports: list[ProgressRecord]) -> bool:
        if stepped := round_stepped(reports, self._epoch, self._members):
            log.info("%s: every member's ranks stepped in the round: starting this spare's processes", self._ctx)
        return stepped
