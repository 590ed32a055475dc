"""The agent's tunables (its command-line flags), validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from stalwart.agent.relay import DEFAULT_LINGER
from stalwart.api.base import positive_seconds

__all__ = ["AgentTuning"]


@dataclass(frozen=True, slots=True)
class AgentTuning:
    """Tunables of the agent (CLI flags), validated on construction."""

    max_restarts: int = 10
    poll_interval: float = 0.1
    progress_interval: float = 1.0
    status_interval: float = 0.5
    term_grace: float = 30.0
    finish_grace: float = 60.0
    join_timeout: float = 600.0
    last_call_timeout: float = 5.0
    #: The TTL of the node's rendezvous lease; None: the job's ``rendezvous.leaseTTLSeconds`` from its record,
    #: 10 s for a job without one.
    node_ttl: int | None = None
    spare_ranks: bool = False
    #: Start the ranks by fork from a process that imported torch once (:mod:`stalwart.forkserver`).
    fork_server: bool = True
    #: Keep rank processes across rounds and start a spare's parked (also on when the job's record says so).
    warm_spares: bool = False
    #: How long a rank's barrier request waits at the relay for the pod's other ranks (:mod:`.relay`).
    relay_linger: float = DEFAULT_LINGER
    #: Keep a parked standby process per pod to replace a rank process that dies (:mod:`.standby`).
    standby: bool = True

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts: expected >= 0, got {self.max_restarts}")
        if self.node_ttl is not None and self.node_ttl < 2:
            raise ValueError(f"node_ttl: expected an integer number of seconds >= 2, got {self.node_ttl}")
        if not 0 <= self.relay_linger <= 1:
            raise ValueError(f"relay_linger: expected seconds in [0, 1], got {self.relay_linger}")
        for name in ("poll_interval", "progress_interval", "status_interval", "term_grace", "finish_grace",
                     "join_timeout"):
            positive_seconds(name, getattr(self, name))
