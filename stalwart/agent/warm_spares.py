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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from stalwart.api.job_record import JobRecord
from stalwart.api.restart import ProgressRecord
from stalwart.api.spec import warm_spares_on
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store, StoreError

log = logging.getLogger(__name__)

__all__ = ["WrapperProbe", "keeps_processes", "park_now", "shows_wrapper"]


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


class WrapperProbe:
    """Reads the job's progress reports, at most every ``interval`` seconds, until one shows the wrapper;
    from then on answers True without reading. Unreadable reports count as not shown yet."""

    def __init__(self, store: Store, keys: JobKeys, *, interval: float = 2.0, context: str = "") -> None:
        self._store, self._keys, self._interval, self._ctx = store, keys, interval, context
        self._shown = False
        self._read_at = float("-inf")

    def __call__(self) -> bool:
        now = time.monotonic()
        if self._shown or now - self._read_at < self._interval:
            return self._shown
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
        self._shown = shows_wrapper(reports)
        if self._shown:
            log.info("%s: the workers' ranks run the restart wrapper: parking this spare's processes", self._ctx)
        return self._shown
