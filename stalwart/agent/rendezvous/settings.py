"""Bounds and timeouts of one job's rendezvous, validated when constructed."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stalwart.api.job_record import JobRecord


@dataclass(frozen=True, slots=True)
class RendezvousSettings:
    """How a round is formed.

    A round is sealed as soon as ``max_nodes`` nodes are present, or every node of the operator's expected
    set is present (with at least ``min_nodes``); with at least ``min_nodes`` but fewer than ``max_nodes``
    present it is sealed ``last_call_timeout`` seconds after the sealer first saw ``min_nodes`` (the last
    call for stragglers). Present nodes beyond ``max_nodes`` become the round's spares.

    ``join_timeout`` bounds :meth:`NodeHandle.join`; ``node_ttl`` is the TTL (seconds) of each node's lease,
    i.e. how long a dead node keeps its place before its key expires and the round ends.
    """

    min_nodes: int
    max_nodes: int
    last_call_timeout: float = 10.0
    join_timeout: float = 600.0
    node_ttl: int = 10

    def __post_init__(self) -> None:
        if self.min_nodes < 1:
            raise ValueError(f"min_nodes: must be >= 1, got {self.min_nodes}")
        if self.max_nodes < self.min_nodes:
            raise ValueError(f"max_nodes: must be >= min_nodes ({self.min_nodes}), got {self.max_nodes}")
        for name in ("last_call_timeout", "join_timeout"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"{name}: must be a finite number of seconds >= 0, got {v}")
        if self.join_timeout <= 0:
            raise ValueError(f"join_timeout: must be > 0 seconds, got {self.join_timeout}")
        if not isinstance(self.node_ttl, int) or self.node_ttl < 2:
            raise ValueError(f"node_ttl: must be an integer number of seconds >= 2, got {self.node_ttl}")

    @classmethod
    def from_job_record(cls, record: JobRecord) -> RendezvousSettings:
        """The settings the operator's :class:`JobRecord` gives. A lease TTL below 2 s becomes 2 s, which is
        what etcd grants anyway (its minimum TTL is about 1.5 election timeouts)."""
        return cls(min_nodes=record.min_nodes, max_nodes=record.max_nodes,
                   last_call_timeout=record.last_call_seconds, join_timeout=record.join_timeout_seconds,
                   node_ttl=max(2, record.lease_ttl_seconds))
