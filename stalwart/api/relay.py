"""The barrier relay's wire format: what a rank process asks its pod's agent, and the answer.

At a restart barrier every rank of the world writes its arrival and, in the same request, reads the
interrupted iteration's fault records (the cause) and what its wait starts from. At 10,000 ranks that is
10,000 etcd requests, each of them a raft proposal, and etcd serves them one after another (docs/scale.md).
The ranks of one pod ask their agent instead: it sends what its ranks asked for together as one fenced
transaction (every arrival a put bound to its own rank's lease; the reads once) and answers each rank with
what it asked for. So the number of etcd
requests a barrier costs grows with the nodes, not the ranks. A rank whose agent does not answer in time, or
answers that it could not do it, makes the same request itself: the relay only ever saves requests.

One request or answer is one line of JSON on the agent's Unix socket (in its private run directory). Nothing
on this socket is ever unpickled. Keys are relative to the round's restart prefix (``RestartKeys.base``): a
rank names what to read, never where to write: the agent binds each connection to the rank process that
made it (its peer's process id, ``SO_PEERCRED``, is one of the agent's own rank processes) and derives the
arrival's key from the slot it gave that process; an arrival for another slot is refused, and the arrival's
``lease`` must be the lease of that slot's ``alive`` key (the transaction compares them).

A rank also asks its agent for the lease its ``alive`` key and arrivals are bound to (``lease_ttl``): one
lease for the pod's ranks, kept alive by the agent, instead of one per rank kept alive by each
(:mod:`stalwart.agent.rank_liveness`).
"""

from __future__ import annotations

from typing import Self

from pydantic import Field, model_validator

from stalwart.api.base import ApiModel
from stalwart.api.restart import ArrivalRecord

__all__ = ["MAX_FRAME_BYTES", "MAX_LEASE_TTL", "MAX_READS", "RelayAnswer", "RelayRange", "RelayRequest", "RelayValue"]

#: The largest line either side sends (an answer holds what its reads returned: a few records, in practice).
MAX_FRAME_BYTES = 8 << 20
#: The most ranges one request may read.
MAX_READS = 4
#: etcd's revisions and lease ids are signed 64-bit integers.
_INT64 = 2**63 - 1
#: The longest TTL a rank may ask the pod's liveness lease to have (an hour: liveness is seconds).
MAX_LEASE_TTL = 3600


class RelayRange(ApiModel):
    """A key, or every key under a prefix, relative to the round's restart prefix."""

    key: str = Field(max_length=256, description="Relative to the round's restart prefix.")
    prefix: bool = Field(default=False, description="Read every key that starts with ``key``.")

    @model_validator(mode="after")
    def _relative(self) -> Self:
        if self.key.startswith("/") or ".." in self.key.split("/"):
            raise ValueError(f"key: expected a key relative to the round's restart prefix, got {self.key!r}")
        return self


class RelayRequest(ApiModel):
    """A rank's arrival at the barrier of ``iteration`` (with the reads its wait starts from), or a read only."""

    epoch: int = Field(ge=1, le=_INT64, description="The round the rank belongs to: the transaction is fenced by it.")
    iteration: int = Field(ge=0, le=_INT64,
                           description="The barrier's iteration (of the arrival), or what the read is about.")
    arrival: ArrivalRecord | None = Field(default=None, description="The arrival to write; none: a read only.")
    lease: int = Field(default=0, ge=0, le=_INT64,
                       description="The rank's heartbeat lease, which the arrival is bound to: the relay "
                                   "writes it only if it is the lease of the slot's alive key.")
    reads: list[RelayRange] = Field(default_factory=list, max_length=MAX_READS)
    lease_ttl: int = Field(
        default=0, ge=0, le=MAX_LEASE_TTL,
        description=("Asks for the pod's liveness lease instead (its TTL in seconds, should the agent grant it "
                     "now): nothing else may be asked with it; ``lease``, if set, names one the rank found gone."))

    @model_validator(mode="after")
    def _complete(self) -> Self:
        if self.lease_ttl:
            if self.arrival is not None or self.reads:
                raise ValueError("lease_ttl: a request for the pod's lease may not arrive or read as well")
            return self
        if self.arrival is not None and self.lease < 1:
            raise ValueError("lease: an arrival must be bound to the rank's heartbeat lease (>= 1)")
        if self.arrival is None and not self.reads:
            raise ValueError("reads: a request without an arrival must read something")
        return self

    @property
    def op(self) -> str:
        """What kind of step this is at its barrier: ranks on one node take the same steps together."""
        return "lease" if self.lease_ttl else "arrive" if self.arrival is not None else "read"


class RelayValue(ApiModel):
    """One key as etcd returned it."""

    key: str = Field(description="Relative to the round's restart prefix.")
    value: str = Field(description="The stored bytes, base64.")
    mod_revision: int = Field(ge=0)


class RelayAnswer(ApiModel):
    """The answer to one :class:`RelayRequest`: the revision of the transaction and, per read in the order
    asked, the keys it returned; or ``ok`` false and why (the rank then makes the request itself)."""

    ok: bool
    revision: int = Field(default=0, ge=0)
    values: list[list[RelayValue]] = Field(default_factory=list)
    reason: str = Field(default="", max_length=2048)
    lease: int = Field(default=0, ge=0, le=_INT64, description="The pod's liveness lease (to a ``lease_ttl`` request).")
