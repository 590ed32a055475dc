"""Completion records: the callee's memory of which requests it has run, so a duplicate is never run twice.

A request is identified by ``(sender, incarnation, request id)``; ids of one sender incarnation grow. While a
request runs, a duplicate waits for the same result; once it is done, a duplicate replays the stored reply.
Records are collected without clocks: every request carries the sender's low-water mark (``ack``: every id
below it is finished at the sender, which will never resend it), and records below it are dropped. A
duplicate below the mark is answered ``expired`` (the sender has nothing waiting for it). All records of a
sender are dropped when it dies or leaves the round.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

R = TypeVar("R")

Sender = tuple[str, str]  # (worker name, incarnation)


@dataclass(slots=True)
class _SenderRecords(Generic[R]):
    low_water: int = 0
    # request id -> None while running, the stored reply once done
    records: dict[int, R | None] = field(default_factory=dict)


class Verdict:
    NEW = "new"  # run it
    RUNNING = "running"  # a duplicate of a request still running: wait for its reply
    DONE = "done"  # a duplicate of a finished request: replay the stored reply
    EXPIRED = "expired"  # below the sender's low-water mark: its record is gone and nobody waits for it


class CompletionTable(Generic[R]):
    """The records of one callee. Pure bookkeeping (no I/O, no clock); driven from the agent's event loop."""

    def __init__(self) -> None:
        self._senders: dict[Sender, _SenderRecords[R]] = {}

    def admit(self, sender: Sender, request_id: int, ack: int) -> tuple[str, R | None]:
        """Classify an arriving request and advance the sender's low-water mark to ``ack``.

        Returns ``(verdict, stored reply)``; the reply is set only for :attr:`Verdict.DONE`. A NEW request is
        recorded as running.
        """
        s = self._senders.get(sender)
        if s is None:
            s = self._senders[sender] = _SenderRecords()
        if ack > s.low_water:
            s.low_water = ack
            for rid in [rid for rid in s.records if rid < ack]:
                del s.records[rid]
        if request_id in s.records:
            stored = s.records[request_id]
            return (Verdict.RUNNING, None) if stored is None else (Verdict.DONE, stored)
        if request_id < s.low_water:
            return Verdict.EXPIRED, None
        s.records[request_id] = None
        return Verdict.NEW, None

    def complete(self, sender: Sender, request_id: int, reply: R) -> None:
        """Store the reply of a request that ran (dropped if the sender has moved past it or is gone)."""
        s = self._senders.get(sender)
        if s is not None and request_id in s.records:
            s.records[request_id] = reply

    def forget_worker(self, name: str) -> int:
        """Drop every record of every incarnation of ``name``; returns how many were dropped."""
        dropped = 0
        for key in [k for k in self._senders if k[0] == name]:
            dropped += len(self._senders.pop(key).records)
        return dropped

    def forget_sender(self, sender: Sender) -> int:
        """Drop the records of one incarnation of a worker; returns how many were dropped."""
        s = self._senders.pop(sender, None)
        return 0 if s is None else len(s.records)

    def forget_others(self, keep: Iterable[Sender]) -> None:
        """Drop every sender not in ``keep`` (e.g. incarnations that were replaced)."""
        keep_set = set(keep)
        for key in [k for k in self._senders if k not in keep_set]:
            del self._senders[key]

    def __len__(self) -> int:
        return sum(len(s.records) for s in self._senders.values())
